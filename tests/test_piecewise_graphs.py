"""Mixed steps under PIECEWISE graphs: the model's pieces split at attention give its forward's
answer, every mixed key (token bucket, launch count) is served and checked against the reference
on steps mixing a prompt chunk, decode tokens and base requests, and a launch count one short on
a mixed step is caught with the smallest step that shows it."""

import random

import pytest
import torch
from conftest import DEVICE, HAS_CUDA
from lorabench.kernels import BACKENDS, get_backend

from lorabench.config.batches import mixed_step
from lorabench.config.models import resolve, shortened
from lorabench.config.strategies import capture_counts
from lorabench.runtime import check as check_module
from lorabench.runtime.check import MIN_MIXED_SENSITIVITY, NOISE_MARGIN, Case, check, mixed_cases, rounding_floor
from lorabench.runtime.dispatch import Dispatcher, Route
from lorabench.runtime.mixed_attention import MixedLayout
from lorabench.runtime.model import LlamaLoRA
from lorabench.runtime.piecewise_graphs import PiecewiseStep

DTYPE = "float16" if HAS_CUDA else "float32"


def build(kernels="torch", strategy="pow2", max_loras=4, sizes=(1, 2, 4, 8), mixed=(2, 4, 8), max_tokens=12, layers=None):
    model = LlamaLoRA(shortened(resolve("tiny"), layers), max_loras=max_loras, rank=16, max_tokens=max_tokens,
                      context_len=16, dtype=getattr(torch, DTYPE), device=DEVICE, cache_rows=max_tokens + max_loras + 2)
    d = Dispatcher(model, get_backend(kernels), max_loras=max_loras, capture_sizes=list(sizes),
                   counts=capture_counts(strategy, max_loras), use_graphs=HAS_CUDA, mixed_sizes=list(mixed))
    d.warm_up()
    d.capture()
    d.capture_mixed()
    return d


def test_mixed_steps_hold_what_they_are_asked_for():
    rng = random.Random(0)
    for tokens, n, base in [(1, 0, 1), (1, 1, 0), (5, 2, 1), (12, 4, 0), (40, 3, 1)]:
        step = mixed_step(tokens, n, 4, 16, rng, base)
        assert step.tokens == tokens and len(step.adapters) == n
        assert sum(p.adapter < 0 for p in step.pieces) >= base
        assert all(p.context + p.tokens <= 16 for p in step.pieces)
        assert sum(p.prefill for p in step.pieces) >= 1 and all(p.tokens <= 16 for p in step.pieces)
    with pytest.raises(ValueError):
        mixed_step(2, 2, 4, 16, rng, 1)  # three requests in two tokens


def test_the_pieces_give_the_forward_s_answer():
    """A step run piece by piece with attention between (the PIECEWISE runner's eager path, over
    a padded bucket) gives the whole forward's logits, decode and mixed alike."""
    d = build(sizes=(8,), mixed=())
    step = mixed_step(6, 2, 4, 16, random.Random(1), 1)
    layout = MixedLayout.of(step, {p.request: p.request for p in step.pieces})
    d.rules.load(d.rules.pack(step.token_adapters)[0])
    whole = d.forward(6, 2, layout=layout)
    pieces = PiecewiseStep(d.model, d.input_ids[:8], d.attn, lambda: d.lora_step(2))
    torch.testing.assert_close(d.model.logits(pieces.run_eager(layout)[:6]), whole, rtol=1e-4, atol=1e-4)
    # a mixed step samples each piece's last token, as vLLM does
    sampled = d.launch(d.prepare(step.token_adapters, layout))
    last = [s + n - 1 for s, n in zip(layout.starts, layout.lengths)]
    torch.testing.assert_close(sampled, whole[last], rtol=1e-4, atol=1e-4)


def test_mixed_cases_reach_every_mixed_key_and_the_eager_path():
    d = build(strategy="dense")
    cs = mixed_cases(d, random.Random(0))
    routes = [d.prepare(c.slots, c.layout).route for c in cs]
    assert {(r.tokens, r.launch) for r in routes if r.graphed} == set(d.mixed_keys)
    assert any(not r.graphed and r.tokens == 12 for r in routes)  # past the largest mixed size
    assert all(r.mixed for r in routes)
    assert any(c.base and c.n_active == 4 for c in cs)  # base requests among every adapter
    counts = lambda t: sorted({c.n_active for c in cs if c.tokens == t})  # noqa: E731
    assert counts(9) == [0, 1, 2, 3, 4]  # just past the largest size: the eager path at every n
    assert counts(12) == [0, 1, 4]  # the largest step: its ends only


@pytest.mark.parametrize("kernels,strategy", [("torch", "max"), ("torch", "pow2"), ("triton", "pow2"),
                                             ("gemm", "pow2")])
def test_lorabench_mixed_steps_are_correct(kernels, strategy):
    interpreted = not HAS_CUDA and BACKENDS[kernels].triton
    d = build(kernels, strategy, sizes=(1, 2), mixed=(2, 4), max_tokens=5, layers=1) if interpreted else build(kernels, strategy)
    v = check(d, DTYPE)
    assert v.correct is True, v.detail
    assert v.mixed_batches > 0 and v.mixed_graphs_checked == v.mixed_graphs_total == len(d.mixed_keys)
    assert v.graphs_checked == v.graphs_total and "PIECEWISE" in v.detail


def short_mixed_routes(d: Dispatcher, monkeypatch) -> None:
    """Mixed steps routed to a launch count one short (the class of bug the check is for), with the
    PIECEWISE graphs those short keys need."""
    good = Dispatcher.route_mixed

    def one_short(self, tokens, n):
        r = good(self, tokens, n)
        return Route(r.tokens, r.launch - 1, r.graphed, mixed=True) if r.launch > 1 and r.graphed else r

    monkeypatch.setattr(Dispatcher, "route_mixed", one_short)
    for key in [(b, c) for b in (2, 4, 8) for c in (1, 3) if c <= b]:  # the keys the short routes land on
        d.mixed_runners[key] = d._pieces(key)
        d.mixed_grid[key] = key[1]


def test_one_short_on_a_mixed_step_is_caught_with_the_smallest_step(monkeypatch):
    d = build()
    short_mixed_routes(d, monkeypatch)
    v = check(d, DTYPE)
    assert v.correct is False and not v.failing_graphs and not v.eager_wrong  # decode steps are right
    f = v.first
    case = Case(f.slots)
    assert case.tokens == 2 and case.n_active == 2 and (f.graph_tokens, f.key, f.grid) == (2, 1, 1), f
    assert f.pieces and v.failing_mixed_graphs and "mixed step [" in v.detail and "PIECEWISE graphs" in v.detail


def deep_bf16(cfg) -> Dispatcher:
    """A deeper model in bf16 on the torch backend, eager, with mixed sizes 8 and 16: rounding shows."""
    model = LlamaLoRA(cfg, max_loras=4, rank=16, max_tokens=24, context_len=48, dtype=torch.bfloat16,
                      device=DEVICE, cache_rows=30)
    d = Dispatcher(model, get_backend("torch"), max_loras=4, capture_sizes=[1, 2], counts=capture_counts("max", 4),
                   use_graphs=False, mixed_sizes=[8, 16])
    d.warm_up()
    d.capture()
    d.capture_mixed()
    return d


def test_mixed_steps_are_held_to_their_rounding_floor_in_16_bit():
    """In a 16-bit dtype at depth, rounding alone moves a mixed step's logits (prompt tokens attend to
    each other's fresh keys): the check measures that floor on the model (the reference against its
    rounded self), and a correct backend's mixed steps stay within NOISE_MARGIN times it."""
    from lorabench.config.models import ModelConfig

    deep = ModelConfig("deep-tiny", 12, 128, 4, 2, 256, 512)
    d = deep_bf16(deep)
    floor = rounding_floor(d, 0)
    assert 1e-4 < floor < 0.1  # bf16 rounding, well under what an update moves (~1)
    v = check(d, "bfloat16")
    assert v.rounding_floor == floor and v.mixed_tolerance == max(v.tolerance, NOISE_MARGIN * floor)
    assert v.correct is True and v.mixed_max_err < v.mixed_tolerance, v.detail


def test_an_moe_model_s_rounding_floor_keeps_its_routing():
    """The rounded reference takes the experts the first answer chose: a near-tie flipped by
    rounding would send a token to another expert, and the floor would measure routing (0.3-1.2 at
    8 layers of a Mixtral-like model in bf16) instead of rounding (under 0.1)."""
    from dataclasses import replace

    moe = resolve("tiny-moe")
    deep = replace(moe, name="deep-tiny-moe", layers=8, full_layers=8)
    d = deep_bf16(deep)
    assert max(rounding_floor(d, seed) for seed in range(4)) < 0.1


def test_a_raised_mixed_tolerance_still_catches_a_dropped_update(monkeypatch):
    """A rounding floor of 0.15 lifts the mixed steps' tolerance to 0.3 (the decode batches keep the
    dtype's): a launch count one short on a mixed step still fails, named against 0.3; a floor too
    close to what the update moves makes a right configuration's check inconclusive."""
    d = build()
    monkeypatch.setattr(check_module, "rounding_floor", lambda d, seed, refs=None: 0.15)
    right = Dispatcher.route_mixed
    short_mixed_routes(d, monkeypatch)
    v = check(d, DTYPE)
    assert v.mixed_tolerance == pytest.approx(0.3) and v.tolerance < 0.3
    assert v.correct is False and v.first.pieces and v.first.max_err > 0.3, v.detail
    assert "tolerance 0.3" in v.detail
    monkeypatch.setattr(check_module, "rounding_floor", lambda d, seed, refs=None: v.sensitivity / 4)
    assert check(d, DTYPE).correct is False  # beyond its limit: WRONG however close the floor comes
    monkeypatch.setattr(Dispatcher, "route_mixed", right)
    inconclusive = check(build(), DTYPE)  # right, but a dropped update would now pass too
    assert inconclusive.correct is None and "inconclusive on mixed steps" in inconclusive.detail


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_decode_batches_keep_the_dtype_tolerance_when_mixed_steps_get_more(monkeypatch, kind):
    """Logits off by 0.1 relative: over the dtype's tolerance, under a mixed tolerance of 0.3
    (floor 0.15). On decode batches that is WRONG; on mixed steps it passes."""
    d = build()
    monkeypatch.setattr(check_module, "rounding_floor", lambda d, seed, refs=None: 0.15)
    good = Dispatcher.launch

    def off(self, prep, every_token=False):
        out = good(self, prep, every_token)
        return out * 1.1 if (prep.layout is None) == (kind == "decode") else out

    monkeypatch.setattr(Dispatcher, "launch", off)
    v = check(d, DTYPE)
    assert v.tolerance < 0.1 < v.mixed_tolerance
    if kind == "decode":
        assert v.correct is False and v.failing_graphs and not v.failing_mixed_graphs, v.detail
    else:
        assert v.correct is True and 0.09 < v.mixed_max_err < v.mixed_tolerance, v.detail


def test_a_decode_failure_stays_wrong_when_mixed_steps_cannot_tell(monkeypatch):
    """A rounding floor too high for the mixed steps to be conclusive takes no verdict away from
    the decode batches: a launch count one short there is still WRONG."""
    d = build()
    good = Dispatcher.route

    def one_short(self, tokens, n):
        r = good(self, tokens, n)
        return Route(r.tokens, r.launch - 1, r.graphed) if r.launch > 1 and r.graphed else r

    monkeypatch.setattr(Dispatcher, "route", one_short)
    for key in [(b, c) for b in (2, 4, 8) for c in (1, 3) if c <= b]:
        d.runners[key] = lambda key=key: d.forward(*key)
        d.grid[key] = key[1]
    monkeypatch.setattr(check_module, "rounding_floor", lambda d, seed, refs=None: 0.3)
    v = check(d, DTYPE)
    assert v.sensitivity < MIN_MIXED_SENSITIVITY * v.mixed_tolerance  # mixed steps alone could not tell
    assert v.correct is False and v.failing_graphs and "WRONG" in v.detail


def test_a_layout_past_the_cache_rows_gets_one_line():
    model = LlamaLoRA(resolve("tiny", 1), max_loras=2, rank=8, max_tokens=8, context_len=8, dtype=torch.float32,
                      device=DEVICE, cache_rows=2)
    step = mixed_step(4, 2, 2, 8, random.Random(0), 1)
    with pytest.raises(ValueError, match="cache row"):
        model(torch.zeros(4, dtype=torch.long, device=DEVICE), None, None,
              MixedLayout.of(step, {p.request: p.request for p in step.pieces}))


def test_the_warm_up_runs_a_mixed_steps_attention_kernels(monkeypatch):
    """Warm-up runs the pieces without attention; it then runs one token's attention, so that on a
    GPU the mixed attention's kernels compile before any timed step (``--warmup 0`` included)."""
    import lorabench.runtime.model as model_mod

    d = build()
    d.model.fused = True  # as on a GPU
    calls = []
    real = model_mod.varlen_attention
    monkeypatch.setattr(model_mod, "varlen_attention", lambda *a, **k: calls.append(a[3].shape) or real(*a, **k))
    d.warm_up()
    assert calls == [(1, 4)]  # one block: the token of layer 0


def test_warm_eager_runs_one_step_per_eager_route():
    """Before a point's timed steps, one step of each eager route (decode and mixed apart, then by
    token count and launch count): an eager step at a new token count or launch count compiles
    kernels, which must not land in a timed step. Batches a graph serves are not run."""
    from lorabench.runtime.dispatch import MixedBatch

    d = build()
    rng = random.Random(0)

    def mixed(tokens):
        step = mixed_step(tokens, 2, 4, 16, rng, 1)
        return MixedBatch(step.token_adapters, MixedLayout.of(step, {p.request: p.request for p in step.pieces}))

    batches = [[0, 1], [0] * 10, mixed(4), [1] * 10, mixed(10), mixed(10), [0] * 5 + [1] * 5, [0] * 11, mixed(12),
               [2] * 8]
    want = [batches[1], batches[4], batches[6], batches[7], batches[8]]  # [0] * 5 + [1] * 5: 10 tokens, a new launch count
    assert [batch for batch, _ in d.eager_steps(batches)] == want
    ran = []
    real = d.launch
    d.launch = lambda prep, every_token=False: ran.append((prep.batch_tokens, prep.route)) or real(prep, every_token)
    assert d.warm_eager(batches) == 5
    assert [(t, r.launch) for t, r in ran] == [(10, 1), (10, 2), (10, 2), (11, 1), (12, 2)]
    assert all(not route.graphed for _, route in ran) and [r.mixed for _, r in ran] == [False, True, False, False, True]
