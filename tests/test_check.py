"""The correctness check: it passes lorabench's dispatch, catches a launch count one short with
the smallest batch that shows it, says when it cannot tell, and reaches every sweep row (those of
tests/test_sweep_report.py's sweep: ``test_rows_carry_the_check_verdict``)."""

import random
from contextlib import nullcontext

import pandas as pd
import pytest
import torch
from conftest import DEVICE, HAS_CUDA, fault_injected
from lorabench.kernels import BACKENDS, get_backend

from lorabench.cli import main
from lorabench.config.models import resolve, shortened
from lorabench.config.strategies import capture_counts
from lorabench.config.strategies import strategy as strategy_named
from lorabench.config.tolerance import TOLERANCE
from lorabench.runtime.check import MIN_SENSITIVITY, Case, cases, check
from lorabench.runtime.dispatch import Dispatcher, Route
from lorabench.runtime.model import LlamaLoRA

DTYPE = "float16" if HAS_CUDA else "float32"


def build(kernels="torch", strategy="pow2", max_loras=4, sizes=(1, 2, 4, 8), scale=1.0, layers=None):
    model = LlamaLoRA(shortened(resolve("tiny"), layers), max_loras=max_loras, rank=16, max_tokens=max(sizes),
                      context_len=16, dtype=getattr(torch, DTYPE), device=DEVICE)
    d = Dispatcher(model, get_backend(kernels), max_loras=max_loras, capture_sizes=list(sizes),
                   counts=capture_counts(strategy, max_loras), use_graphs=HAS_CUDA, lora_scale=scale,
                   bucket_grid=strategy_named(strategy).bucket_grid)
    d.warm_up()
    d.capture()
    return d


def test_cases_cover_every_servable_graph_smallest_first():
    d = build(strategy="dense")
    cs = cases(d, random.Random(0))
    sizes = [(c.tokens, c.n_active, c.base) for c in cs]
    assert sizes == sorted(sizes)
    assert {(d.route(c.tokens, c.n_active).tokens, d.route(c.tokens, c.n_active).launch) for c in cs} == set(d.keys)
    # every n at every batch length, with and without base requests
    assert any(c.n_active == 3 and c.base == 0 for c in cs) and any(c.n_active == 3 and c.base > 0 for c in cs)


@pytest.mark.parametrize("kernels,strategy", [("torch", "max"), ("torch", "pow2"), ("torch", "[3,4]"), ("triton", "pow2"), ("fused", "pow2"), ("gemm", "pow2"),
                                             ("fused", "agnostic"), ("torch", "agnostic")])
def test_lorabench_dispatch_is_correct(kernels, strategy):
    # Triton's interpreter on the CPU: one layer and buckets 1 and 2 (tests/test_graphs.py runs
    # every bucket through the Triton kernels); the torch kernels and a GPU check every bucket.
    interpreted = not HAS_CUDA and BACKENDS[kernels].triton
    d = build(kernels, strategy, sizes=(1, 2) if interpreted else (1, 2, 4, 8), layers=1 if interpreted else None)
    v = check(d, DTYPE)
    assert v.correct is True, v.detail
    assert v.graphs_checked == v.graphs_total and v.max_err < v.tolerance
    assert v.sensitivity > 10 * v.tolerance
    assert v.detail.startswith("ok:")


def one_short_dispatcher(monkeypatch, scale=1.0):
    d = build("torch", "pow2", scale=scale)
    good = Dispatcher.route

    def one_short(self, tokens, n):
        r = good(self, tokens, n)
        return Route(r.tokens, r.launch - 1, r.graphed) if r.launch > 1 and r.graphed else r

    monkeypatch.setattr(Dispatcher, "route", one_short)
    for key in [(b, c) for b in (2, 4, 8) for c in (1, 3) if c <= b]:  # the keys the short routes land on
        d.runners[key] = lambda key=key: d.forward(*key)
        d.grid[key] = key[1]
    return d


def test_one_short_is_caught_with_the_smallest_batch(monkeypatch):
    """A dispatcher that rounds a mixed batch's count one short (the class of bug docs/design.md warns
    about) fails, and the verdict names the smallest batch, its graph and the error."""
    v = check(one_short_dispatcher(monkeypatch), DTYPE)
    assert v.correct is False
    f = v.first
    assert Case(f.slots).tokens == 2 and Case(f.slots).n_active == 2, f  # n=2 -> key 1: the smallest such batch
    assert (f.graph_tokens, f.key, f.grid) == (2, 1, 1) and f.max_err > v.tolerance
    assert "WRONG" in v.detail and "grid 1" in v.detail and str(f.slots) in v.detail


def test_a_failure_is_wrong_even_where_a_pass_could_not_be_told(monkeypatch):
    """An update that moves the logits by under 10 tolerances makes a pass inconclusive, never a
    failure: an error past the tolerance is one rounding cannot explain (vLLM's specialised graphs
    on 2 layers of Llama-3.1-8B in bf16: dropped updates of 1.17, the update moving logits by 0.92)."""
    tol = TOLERANCE[DTYPE].logits
    sens = check(build("torch", "max"), DTYPE).sensitivity
    v = check(one_short_dispatcher(monkeypatch, scale=4 * tol / sens), DTYPE)
    assert v.sensitivity < MIN_SENSITIVITY * tol and v.first.max_err > tol
    assert v.correct is False and "WRONG" in v.detail


def test_a_check_that_cannot_tell_says_so():
    """With a LoRA update too small to see, a dropped update would go unnoticed: no verdict."""
    v = check(build("torch", "max", scale=1e-7), DTYPE)
    assert v.correct is None and "inconclusive" in v.detail


def _cli(argv, fault=None):
    with fault_injected(fault) if fault else nullcontext():
        return main(argv)


@pytest.mark.e2e
def test_check_command(tmp_path, capsys):
    argv = ["check", "--out", str(tmp_path), "--max-loras", "2", "--capture-sizes", "1,2", "--strategy", "max,dense",
            "--device", "cpu"]
    assert _cli(argv) == 0
    out = capsys.readouterr().out
    assert "2 correct, 0 wrong" in out and "ok" in out
    assert not list(tmp_path.glob("*/points.parquet")) or pd.read_parquet(next(tmp_path.glob("*/points.parquet"))).empty


@pytest.mark.e2e
def test_check_command_fails_without_a_verdict(tmp_path, capsys):
    argv = ["check", "--out", str(tmp_path), "--max-loras", "2", "--capture-sizes", "1,2", "--strategy", "max", "--device", "cpu"]
    assert _cli(argv, fault="check") == 1
    assert "1 without a verdict" in capsys.readouterr().out


def test_agnostic_is_one_graph_per_bucket_sized_by_the_bucket():
    """Strategy agnostic: one LoRA graph per bucket, its grid min(bucket, max_loras), whatever n."""
    d = build("torch", "agnostic", max_loras=4, sizes=(1, 2, 4, 8))
    assert sorted(d.keys) == [(b, k) for b in (1, 2, 4, 8) for k in (0, min(b, 4))]
    for tokens in (1, 2, 3, 5, 8):
        for n in range(1, min(tokens, 4) + 1):
            r = d.route(tokens, n)
            assert d.grid_of(r) == min(r.tokens, 4) >= n
