"""Every graph's output equals the eager plain-torch reference, through the real dispatch path:
for every bucket, every active count 0..max_loras, batches mixing base and adapter requests.
On the CPU the graphs are eager callables; on a GPU they are captured CUDA graphs.

On the GPU every backend runs every strategy on the whole tiny model. On the CPU, where Triton's
interpreter takes about a second per step, the routing of every strategy is checked with the torch
kernels (the launch-count semantics in torch ops) and each Triton backend runs the whole dispatch
path once, strategy pow2 (launch counts equal to n and above it), on one layer; the kernels
themselves are checked at every launch count and active count in tests/test_kernels.py."""

import gc
import random
import zlib

import pytest
import torch
from conftest import DEVICE, HAS_CUDA, requires_cuda
from lorabench.kernels import BACKENDS, get_backend

from lorabench.config.batches import mixed_batch
from lorabench.config.models import resolve, shortened
from lorabench.config.strategies import capture_counts
from lorabench.runtime.check import row_errors
from lorabench.runtime.dispatch import Dispatcher, Route
from lorabench.runtime.model import LlamaLoRA

MAX_LORAS = 4
SIZES = [1, 2, 4, 8]
DTYPE = torch.float16 if HAS_CUDA else torch.float32
TOL = 3e-2 if HAS_CUDA else 1e-4


def on_one_layer(kernels: str) -> bool:
    """Whether a test of ``kernels`` builds the tiny model with one layer (Triton's interpreter)."""
    return not HAS_CUDA and BACKENDS[kernels].triton


def build(kernels: str, strategy: str, seed: int = 0) -> Dispatcher:
    model = LlamaLoRA(
        shortened(resolve("tiny"), 1 if on_one_layer(kernels) else None), max_loras=MAX_LORAS, rank=16,
        max_tokens=16, context_len=32, dtype=DTYPE, device=DEVICE, seed=seed,
    )
    d = Dispatcher(
        model, get_backend(kernels), max_loras=MAX_LORAS, capture_sizes=SIZES,
        counts=capture_counts(strategy, MAX_LORAS), use_graphs=HAS_CUDA,
    )
    d.warm_up()
    d.capture()
    return d


def mismatches(d: Dispatcher, seed: int, first: bool = False):
    """Every (batch tokens, n) with a mixed batch: list of (slots, route, worst row error);
    ``first``: stop at the first mismatch."""
    rng = random.Random(seed)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    bad = []
    for tokens in [1, 2, 3, 4, 5, 8, 11]:  # 11 > the largest capture size: eager
        for n in range(min(tokens, MAX_LORAS) + 1):
            slots = mixed_batch(tokens, n, MAX_LORAS, rng)
            ids = torch.randint(0, d.model.cfg.vocab, (tokens,), device=DEVICE, generator=gen)
            prep = d.prepare(slots)
            d.input_ids[:tokens].copy_(ids)
            out = d.launch(prep).clone()
            ref = d.reference(slots, ids)
            err = row_errors(out, ref).max().item()
            if not err < TOL:
                bad.append((slots, prep.route, err))
                if first:
                    return bad
    return bad


STRATEGIES = ["max", "pow2", "dense", "[3,4]"]


@pytest.mark.parametrize("strategy,kernels", [(s, k) for k in ["triton", "fused", "gemm", "torch"] for s in STRATEGIES
                                              if HAS_CUDA or k == "torch" or s == "pow2"])
def test_every_graph_matches_reference(kernels, strategy):
    d = build(kernels, strategy)
    assert mismatches(d, seed=zlib.crc32(strategy.encode()) % 1000) == []  # the same batches in every process


@pytest.mark.parametrize(
    "strategy,keys",
    [
        ("max", [(8, 4), (8, 0), (4, 4), (4, 0), (2, 4), (2, 0), (1, 4), (1, 0)]),
        ("pow2", [(8, 4), (8, 2), (8, 1), (8, 0), (4, 4), (4, 2), (4, 1), (4, 0), (2, 2), (2, 1), (2, 0), (1, 1), (1, 0)]),
        ("[3,4]", [(8, 4), (8, 3), (8, 0), (4, 4), (4, 3), (4, 0), (2, 3), (2, 0), (1, 3), (1, 0)]),
    ],
)
def test_only_reachable_keys_are_captured_largest_first(strategy, keys):
    assert build("torch", strategy).keys == keys


def test_every_key_is_served():
    """The batches above reach every captured (bucket, launch count), so every graph is checked."""
    d = build("torch", "dense")
    rng = random.Random(0)
    seen = set()
    for tokens in [1, 2, 3, 4, 5, 8]:
        for n in range(min(tokens, MAX_LORAS) + 1):
            r = d.prepare(mixed_batch(tokens, n, MAX_LORAS, rng)).route
            seen.add((r.tokens, r.launch))
    assert seen == set(d.keys)


@pytest.mark.parametrize("kernels", ["triton", "fused", "gemm", "torch"])
def test_check_catches_a_launch_count_one_short(kernels, monkeypatch):
    """The check can fail: a dispatcher that rounds the count down on a mixed batch (the class
    of bug docs/design.md warns about) is caught."""
    d = build(kernels, "pow2")
    good_route = Dispatcher.route

    def one_short(self, tokens, n):
        r = good_route(self, tokens, n)
        return Route(r.tokens, max(r.launch - 1, 1), r.graphed) if r.launch > 1 and r.graphed else r

    monkeypatch.setattr(Dispatcher, "route", one_short)
    d.runners.update({(b, c): (lambda b=b, c=c: d.forward(b, c)) for b in SIZES for c in range(1, MAX_LORAS)})
    assert mismatches(d, seed=3, first=True), "a launch count one short went unnoticed"


def test_no_lora_graph_runs_no_lora_kernels():
    d = build("torch", "max")
    calls = []
    d.backend = type("Spy", (), {"NEEDS_ZEROED_SCRATCH": False, "lora_apply": staticmethod(lambda *a: calls.append(1))})
    d.forward(4, 0)
    assert calls == []
    d.forward(4, 4)
    assert len(calls) == 4 * resolve("tiny").layers


@requires_cuda
def test_a_collection_during_capture_finds_no_dead_graph():
    """Dead objects that hold captured graphs (here a cycle) are collected before a capture
    starts: destroying a graph while a stream captures invalidates that capture. Every LoRA
    launch below runs the collector while the dispatcher captures."""
    torch_lora = get_backend("torch")

    def collect_then_apply(*args):
        gc.collect()
        torch_lora.lora_apply(*args)

    collecting = type("Collecting", (), {"NEEDS_ZEROED_SCRATCH": False, "lora_apply": staticmethod(collect_then_apply)})
    model = LlamaLoRA(resolve("tiny"), max_loras=MAX_LORAS, rank=16, max_tokens=16, context_len=32, dtype=DTYPE, device=DEVICE)
    d = Dispatcher(model, collecting, max_loras=MAX_LORAS, capture_sizes=SIZES, counts=capture_counts("pow2", MAX_LORAS),
                   use_graphs=True)
    d.warm_up()
    dead = build("torch", "max")
    dead.cycle = dead  # garbage only the cyclic collector frees, with its CUDA graphs
    del dead
    d.capture()
    assert mismatches(d, seed=1) == []


@requires_cuda
def test_the_floors_probe_measures_both_bandwidths_and_a_kernels_cost():
    from lorabench.runtime.probe import probe

    p = probe(graph_kernels=32, copy_mib=64, replays=5)
    assert set(p) == {"probe_copy_gbs", "probe_rmw_gbs", "probe_kernel_us"}
    assert 50 < p["probe_copy_gbs"] < 20_000 and 50 < p["probe_rmw_gbs"] < 20_000 and 0 < p["probe_kernel_us"] < 100
