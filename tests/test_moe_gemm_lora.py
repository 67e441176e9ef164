"""Expert LoRA inside the expert GEMM (the ``gemm`` backend's MoE op) against the grouped GEMM
plus the reference's expert LoRA: w13 and w2, every active count with base tokens mixed in, a
slot without expert LoRA, ranks past one step of the walk, a short launch count, the fallback."""

import pytest
import torch
from conftest import DEVICE
from test_moe_kernels import DTYPES, TOL, expert_case

from lorabench.kernels import get_backend, reference
from lorabench.kernels.moe_gemm import expert_gemm
from lorabench.kernels.moe_gemm_lora import IN_GEMM, IN_GEMM_SHRUNK, expert_gemm_lora, tile_n


def case(slots, dtype, w2, seed, **kw):
    """An ExpertCall, its meta and active count, and the base weights W [E, N, K] of its projection."""
    gen = torch.Generator().manual_seed(seed)
    if not w2:
        kw.setdefault("n_out", 32)  # slices of 32: a tile's width divides them (24 would fall back)
    call, meta, n = expert_case(len(slots), slots, dtype, w2, gen, **kw)
    experts, k = call.lora_a.shape[2], call.lora_a.shape[4]
    w = (torch.randn(experts, call.y.shape[1], k, generator=gen) * k**-0.5).to(DEVICE, dtype)
    return call, meta, n, w


def unfused(call, w, meta, launch_count, scale):
    """The grouped GEMM, then the reference's expert LoRA over its output: what the op must equal."""
    y = expert_gemm(call.x, w, call.topk_ids, call.layout, routed=call.topk_weights if call.mul_weight else None,
                    x_per_entry=call.x_per_entry, fused=False)
    out = call._replace(y=y)
    reference.moe_lora_apply(out, meta, launch_count, scale)
    return out.y


# (shrink_first, one_pass): h in the GEMM's K loop where a block holds one slot's entries, else per tile
# after it; every block per tile after it; the sorted shrink first.
SHRINK = pytest.mark.parametrize("mode", [(False, True), (False, False), (True, True)],
                                 ids=["one-pass", "two-pass", "shrink-first"])


@SHRINK
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("w2", [False, True], ids=["w13", "w2"])
def test_the_gemm_with_expert_lora_matches_the_gemm_then_the_reference_at_every_active_count(dtype, w2, mode):
    for seed, slots in enumerate(([0], [-1], [3, -1, 0, 3, 1], [1, 2, -1, -1, 0, 3], [2, 2, 2], [1, 0, 3] * 4)):
        call, meta, n, w = case(slots, dtype, w2, seed)
        got = expert_gemm_lora(w, call._replace(y=None), meta, n, 0.5, *mode)
        want = unfused(call, w, meta, n, 0.5)
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype] * 4, rtol=TOL[dtype])
        base = expert_gemm(call.x, w, call.topk_ids, call.layout, routed=call.topk_weights if w2 else None,
                           x_per_entry=w2)
        rows = torch.tensor(slots, device=DEVICE).repeat_interleave(2)
        untouched = (rows < 0) | (rows == 2)  # base tokens, and slot 2 has no expert LoRA
        torch.testing.assert_close(got[untouched].float(), base[untouched].float(), atol=TOL[dtype], rtol=TOL[dtype])


@SHRINK
@pytest.mark.parametrize("w2", [False, True], ids=["w13", "w2"])
def test_full_blocks_wide_slices_long_k_and_high_slots_match(w2, mode):
    """37 tokens over 2 experts (full blocks, an expert over several, the last padded), slices of
    96 (several output tiles each), K = 200 (several steps of either K loop on a GPU too), 8 slots
    with slots 4-7 active and slot 6 without expert LoRA, base tokens mixed in."""
    slots = [4, 5, 6, 7, -1, 0, 3] * 5 + [7, -1]
    call, meta, n, w = case(slots, DTYPES[-1], w2, 29, experts=2, max_loras=8, n_out=96, k_in=200)
    enabled = torch.tensor([1, 1, 1, 1, 1, 1, 0, 1, 0], dtype=torch.int32, device=DEVICE)
    call = call._replace(enabled=enabled)
    got = expert_gemm_lora(w, call, meta, n, 0.5, *mode)
    tol = TOL[DTYPES[-1]]
    torch.testing.assert_close(got.float(), unfused(call, w, meta, n, 0.5).float(), atol=tol * 4, rtol=tol)
    rows = torch.tensor(slots, device=DEVICE).repeat_interleave(2)
    base = expert_gemm(call.x, w, call.topk_ids, call.layout, routed=call.topk_weights if w2 else None, x_per_entry=w2)
    torch.testing.assert_close(got[(rows < 0) | (rows == 6)].float(), base[(rows < 0) | (rows == 6)].float(),
                               atol=tol, rtol=tol)


@SHRINK
@pytest.mark.parametrize("w2", [False, True], ids=["w13", "w2"])
@pytest.mark.parametrize("rank", [8, 80])
def test_ranks_below_and_past_one_step_of_the_walk_match(w2, rank, mode):
    """Rank 8 (below tl.dot's 16: masked), rank 80 (three steps of 32 of the rank walk, the last partial)."""
    call, meta, n, w = case([0, -1, 3, 1], DTYPES[0], w2, 21, rank=rank)
    got = expert_gemm_lora(w, call, meta, n, 1.0, *mode)
    torch.testing.assert_close(got.float(), unfused(call, w, meta, n, 1.0).float(), atol=TOL[DTYPES[0]] * 4,
                               rtol=TOL[DTYPES[0]])


@SHRINK
@pytest.mark.parametrize("w2", [False, True], ids=["w13", "w2"])
def test_a_short_launch_count_drops_the_slots_past_it(w2, mode):
    """The launch count bounds the walk over the active slots, as the other kernels' grids: slots
    past it get the base GEMM alone."""
    slots = [0, 1, 3, -1]  # active slots 0, 1, 3
    call, meta, n, w = case(slots, torch.float32, w2, 3)
    got = expert_gemm_lora(w, call, meta, 1, 1.0, *mode)
    want = unfused(call, w, meta, n, 1.0)
    base = expert_gemm(call.x, w, call.topk_ids, call.layout, routed=call.topk_weights if w2 else None, x_per_entry=w2)
    rows = torch.tensor(slots, device=DEVICE).repeat_interleave(2)
    tol = TOL[torch.float32]
    torch.testing.assert_close(got[rows == 0], want[rows == 0], atol=tol, rtol=tol)
    torch.testing.assert_close(got[rows >= 1], base[rows >= 1], atol=tol, rtol=tol)
    assert not torch.allclose(got[rows == 3], want[rows == 3], atol=tol, rtol=tol)


def test_no_launch_is_the_base_gemm_and_an_odd_slice_width_falls_back():
    call, meta, n, w = case([0, -1, 3], torch.float32, False, 5)
    base = expert_gemm(call.x, w, call.topk_ids, call.layout)
    assert torch.equal(expert_gemm_lora(w, call, meta, 0, 1.0), base)
    call, meta, n, w = case([0, -1, 3], torch.float32, False, 5, n_out=20)  # 2 slices of 20: no tile width divides
    assert tile_n(20, 2) is None and tile_n(20, 1) is not None
    got = expert_gemm_lora(w, call, meta, n, 1.0)  # the GEMM, then moe_lora_apply
    tol = TOL[torch.float32]
    torch.testing.assert_close(got, unfused(call, w, meta, n, 1.0), atol=tol * 4, rtol=tol)


def test_the_gemm_backend_takes_it_and_names_its_path():
    gemm = get_backend("gemm")
    assert gemm.expert_gemm_lora is expert_gemm_lora
    assert gemm.moe_path(1, 8, 128, 4, 1) == gemm.moe_path(16, 8, 128, 4, 4) == IN_GEMM  # at most an entry per expert
    assert gemm.moe_path(17, 8, 128, 4, 1) == gemm.moe_path(5, 2, 8, 16, 16) == IN_GEMM_SHRUNK  # Mixtral: from 5 tokens
    assert not hasattr(get_backend("triton"), "expert_gemm_lora")


def test_the_check_passes_a_moe_model_whose_expert_lora_runs_inside_the_gemm(monkeypatch):
    """Every captured graph of a tiny MoE model under the gemm backend (pow2: launch counts 1, 2, 4)
    against the plain-torch reference, base tokens mixed in at every active count; the expert
    projections go through expert_gemm_lora (one layer and buckets up to 4 under the interpreter)."""
    from conftest import HAS_CUDA

    from lorabench.config.models import resolve, shortened
    from lorabench.config.strategies import capture_counts
    from lorabench.kernels import gemm_lora
    from lorabench.runtime.check import check
    from lorabench.runtime.dispatch import Dispatcher
    from lorabench.runtime.model import LlamaLoRA

    calls = []
    monkeypatch.setattr(gemm_lora, "expert_gemm_lora", lambda *a: calls.append(a[3]) or expert_gemm_lora(*a))
    dtype = torch.float16 if HAS_CUDA else torch.float32
    model = LlamaLoRA(shortened(resolve("tiny-moe"), 1), max_loras=4, rank=16, max_tokens=4, context_len=16,
                      dtype=dtype, device=DEVICE)
    d = Dispatcher(model, get_backend("gemm"), max_loras=4, capture_sizes=[1, 2, 4], counts=capture_counts("pow2", 4),
                   use_graphs=HAS_CUDA)
    d.warm_up()
    d.capture()
    verdict = check(d, str(dtype).removeprefix("torch."))
    assert verdict.correct is True, verdict.detail
    assert verdict.graphs_checked == verdict.graphs_total
    assert {1, 2, 4} <= set(calls)  # every launch count's graphs ran the op


@pytest.mark.parametrize("slots", [[0], [0, -1, 0]], ids=["one-slot", "one-slot-and-base"])
def test_blocks_of_one_launched_slot_take_the_one_pass_branch(slots):
    """Which branch a block took, probed: with its slot listed twice among the launched ones, the
    walk after the K loop adds the slot's update twice, the one-pass branch once. Every block here
    holds one slot's entries (and base tokens: 2 experts, each token routed to both)."""
    call, meta, _, w = case(slots, torch.float32, False, 31, experts=2)
    meta.active_slots[:2] = 0  # slot 0, twice
    base = expert_gemm(call.x, w, call.topk_ids, call.layout)
    once = unfused(call, w, meta, 1, 1.0)
    tol = TOL[torch.float32]
    torch.testing.assert_close(expert_gemm_lora(w, call, meta, 2, 1.0, False, True), once, atol=tol, rtol=tol)
    twice = expert_gemm_lora(w, call, meta, 2, 1.0, False, False)
    torch.testing.assert_close(twice, base + 2 * (once - base), atol=tol * 4, rtol=tol)
