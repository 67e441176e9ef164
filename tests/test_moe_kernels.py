"""The MoE ops against plain torch: routing, the grouped expert GEMM, and expert LoRA on both of
lorabench's paths (and the torch backend's, and vLLM's where it is installed) at every active
count with base tokens mixed in, a slot without expert LoRA, experts with no entries."""

import pytest
import torch
from conftest import DEVICE

from lorabench.kernels import get_backend, reference, torch_lora
from lorabench.kernels.moe_align import align_blocks
from lorabench.kernels.moe_gemm import BLOCK_M, expert_gemm, route
from lorabench.kernels.expert_call import ExpertCall
from lorabench.kernels.launch import cdiv
from lorabench.kernels.moe_lora import PER_ENTRY, SORTED, SortedTiling, expand_groups, moe_lora_apply
from lorabench.kernels.moe_lora import moe_path as path
from lorabench.kernels import moe_gemm as moe_gemm_module, moe_lora as moe_lora_module, moe_lora_per_entry
from lorabench.kernels.moe_lora_per_entry import PerEntryTiling
from lorabench.runtime.lora_meta import MetaBuffer

# Triton's dot takes fp32 operands as TF32 on the GPU (10-bit mantissa): fp32 checks loosen there.
TOL = {torch.float32: 1e-4 if DEVICE == "cpu" else 1e-2, torch.float16: 2e-2, torch.bfloat16: 4e-2}
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cpu" else [torch.float16, torch.bfloat16]


def routing(tokens, experts, top_k, gen):
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE)
    return ids, weights / weights.sum(1, keepdim=True)


def test_route_takes_the_top_k_of_the_softmax_and_renormalises():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 5.0, -1.0, 0.0]], device=DEVICE)
    for fused in (True, False):
        ids = torch.empty(2, 2, dtype=torch.int64, device=DEVICE)
        w = torch.empty(2, 2, dtype=torch.float32, device=DEVICE)
        route(logits, 2, False, ids, w, fused)
        probs = torch.softmax(logits, -1)
        assert ids[0].tolist() == [1, 3]
        assert sorted(ids[1].tolist()) == [0, 1]  # a tie: both experts, in either order from torch
        torch.testing.assert_close(w[0], probs[0, [1, 3]])
        route(logits, 2, True, ids, w, fused)
        torch.testing.assert_close(w.sum(1), torch.ones(2, device=DEVICE))
    route(logits, 2, False, ids, w, fused=True)
    assert ids[1].tolist() == [0, 1]  # the kernel breaks ties to the lower expert id


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (5, 6, 3), (9, 16, 4)])
def test_the_grouped_gemm_matches_torch_with_and_without_routing_weights(dtype, tokens, experts, top_k):
    gen = torch.Generator().manual_seed(tokens)
    ids, weights = routing(tokens, experts, top_k, gen)
    layout = align_blocks(ids, experts, BLOCK_M)
    x = torch.randn(tokens, 48, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(experts, 40, 48, generator=gen) * 0.2).to(DEVICE, dtype)
    got = expert_gemm(x, w, ids, layout)
    want = torch.stack([x[i // top_k].float() @ w[ids.reshape(-1)[i]].float().T for i in range(tokens * top_k)])
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    entries = torch.randn(tokens * top_k, 48, generator=gen).to(DEVICE, dtype)
    got = expert_gemm(entries, w, ids, layout, routed=weights, x_per_entry=True)
    want = expert_gemm(entries, w, ids, layout, routed=weights, x_per_entry=True, fused=False)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype] * 4, rtol=TOL[dtype])


def expert_case(tokens, slots, dtype, w2, gen, experts=6, top_k=2, rank=16, max_loras=4, n_out=None, k_in=None):
    """One projection's ExpertCall (w13: 2 slices, x per token; w2: 1 slice, x per entry, weights)."""
    ids, weights = routing(tokens, experts, top_k, gen)
    k, n, s = (24, 40, 1) if w2 else (40, 24, 2)
    n, k = n_out or n, k_in or k
    x = torch.randn(tokens * top_k if w2 else tokens, k, generator=gen).to(DEVICE, dtype)
    a = (torch.randn(s, max_loras, experts, rank, k, generator=gen) * k**-0.5).to(DEVICE, dtype)
    b = (torch.randn(s, max_loras, experts, n, rank, generator=gen) * rank**-0.5).to(DEVICE, dtype)
    y = torch.randn(tokens * top_k, s * n, generator=gen).to(DEVICE, dtype)
    enabled = torch.tensor([1, 1, 0, 1, 0][:max_loras + 1], dtype=torch.int32, device=DEVICE)  # slot 2: none
    buf = MetaBuffer(tokens, max_loras, DEVICE)
    packed, n_active = buf.pack(slots)
    buf.load(packed)
    call = ExpertCall(y, x, a, b, ids, weights, w2, align_blocks(ids, experts, BLOCK_M), enabled)
    return call, buf.meta, n_active


def fresh(call):
    return call._replace(y=call.y.clone())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("w2", [False, True], ids=["w13", "w2"])
@pytest.mark.parametrize("kernel_path", [PER_ENTRY, SORTED])
def test_expert_lora_matches_the_reference_at_every_active_count_with_base_tokens(dtype, w2, kernel_path):
    gen = torch.Generator().manual_seed(7)
    for slots in ([0], [-1], [3, -1, 0, 3, 1], [1, 2, -1, -1, 0, 3], [2, 2, 2]):
        call, meta, n = expert_case(len(slots), slots, dtype, w2, gen)
        want = fresh(call)
        reference.moe_lora_apply(want, meta, 4, 0.5)
        got = fresh(call)
        moe_lora_apply(got, meta, n, 0.5, kernel_path)
        torch.testing.assert_close(got.y.float(), want.y.float(), atol=TOL[dtype] * 4, rtol=TOL[dtype])
        slot_of_entry = torch.tensor(slots, device=DEVICE).repeat_interleave(2)
        untouched = (slot_of_entry < 0) | (slot_of_entry == 2)  # base tokens, and slot 2 has no expert LoRA
        assert torch.equal(got.y[untouched], call.y[untouched])


@pytest.mark.parametrize("w2", [False, True], ids=["w13", "w2"])
@pytest.mark.parametrize("groups, n_out", [(1, 72), (2, 150)], ids=["one-program-3-tiles", "two-programs-of-3-tiles"])
def test_per_entry_programs_of_the_default_grid_walking_several_tiles_match_the_reference(w2, groups, n_out, monkeypatch):
    """Wide outputs (Mixtral's 14336) make each per-entry program walk several tiles with one h;
    under the default grid of few entries, in a loop the compiler knows the length of: 3 tiles of
    32 walked by one program, and 5 tiles by two programs of 3 (the second's last past the slice's
    end), each from its own first tile."""
    monkeypatch.setattr(moe_lora_per_entry, "PER_ENTRY_GROUPS", groups)
    gen = torch.Generator().manual_seed(13)
    slots = [0, -1, 3, 1]
    call, meta, n = expert_case(len(slots), slots, DTYPES[0], w2, gen, n_out=n_out)
    want = fresh(call)
    reference.moe_lora_apply(want, meta, n, 0.5)
    got = fresh(call)
    moe_lora_apply(got, meta, n, 0.5, PER_ENTRY)
    torch.testing.assert_close(got.y.float(), want.y.float(), atol=TOL[DTYPES[0]] * 4, rtol=TOL[DTYPES[0]])


@pytest.mark.parametrize("w2", [False, True], ids=["w13", "w2"])
@pytest.mark.parametrize("tiling", [PerEntryTiling(256, 4), PerEntryTiling(16384, 8), PerEntryTiling(32768, 16)],
                         ids=["k-steps-of-16", "one-k-step-8-warps", "one-k-step-16-warps"])
def test_per_entry_k_steps_of_every_size_match_the_reference(w2, tiling):
    """The per-entry K loop in steps of 16 (K = 24 or 40: the last step partial) and in one step,
    with base tokens and a slot without expert LoRA mixed in; the warps a program has."""
    gen = torch.Generator().manual_seed(19)
    slots = [0, -1, 3, 2, 1]
    call, meta, n = expert_case(len(slots), slots, DTYPES[-1], w2, gen)
    want = fresh(call)
    reference.moe_lora_apply(want, meta, n, 0.5)
    got = fresh(call)
    moe_lora_apply(got, meta, n, 0.5, PER_ENTRY, per_entry=tiling)
    torch.testing.assert_close(got.y.float(), want.y.float(), atol=TOL[DTYPES[-1]] * 4, rtol=TOL[DTYPES[-1]])
    rows = torch.tensor(slots, device=DEVICE).repeat_interleave(2)
    assert torch.equal(got.y[(rows < 0) | (rows == 2)], call.y[(rows < 0) | (rows == 2)])


@pytest.mark.parametrize("switch", [False, True], ids=["ordinary", "pdl"])
def test_the_per_entry_path_is_the_expert_gemms_pdl_successor_only_when_switched_on(monkeypatch, switch):
    """As on an sm90 GPU (stood in for: the kernels are recorded, not run), the expert GEMM lets a
    PDL successor launch at once, and the per-entry path launches as that successor only with
    ``PER_ENTRY_PDL`` (its h while the GEMM runs, y after it: tests/compile_sm90.py checks the PTX)."""
    launches = {}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.__setitem__(self.name, kwargs)

    monkeypatch.setattr(moe_lora_per_entry, "_per_entry_kernel", Recorder("per-entry"))
    monkeypatch.setattr(moe_gemm_module, "_expert_gemm_kernel", Recorder("gemm"))
    for module in (moe_lora_per_entry, moe_gemm_module):
        monkeypatch.setattr(module, "pdl_enabled", lambda device: True)
    monkeypatch.setattr(moe_lora_per_entry, "PER_ENTRY_PDL", switch)
    call, meta, n = expert_case(3, [0, -1, 1], torch.float32, False, torch.Generator().manual_seed(3))
    expert_gemm(call.x, torch.empty(6, 48, 40, device=DEVICE), call.topk_ids, call.layout)
    moe_lora_apply(call, meta, n, 0.5, PER_ENTRY)
    assert launches["gemm"]["LAUNCH_DEPENDENTS"] is True
    assert launches["per-entry"]["USE_PDL"] is switch and launches["per-entry"].get("launch_pdl", False) is switch


def gemm_then_per_entry(w2: bool, gen):
    """A GEMM then the per-entry expert LoRA on its output, as a MoE layer runs them: the step, the
    list holding its last output, the reference's answer and the tolerance (bf16, 8 tokens with
    base ones, 6 experts)."""
    slots = [0, -1, 3, 1, 0, 3, 1, -1]
    call, meta, n = expert_case(len(slots), slots, torch.bfloat16, w2, gen, n_out=256, k_in=512)
    w = (torch.randn(6, call.y.shape[1], call.x.shape[1], generator=gen) * call.x.shape[1] ** -0.5).to(DEVICE, torch.bfloat16)
    routed = call.topk_weights if w2 else None
    base = expert_gemm(call.x, w, call.topk_ids, call.layout, routed=routed, x_per_entry=w2)
    want = call._replace(y=base.float())
    reference.moe_lora_apply(want, meta, 4, 0.5)
    out = []

    def step():
        y = expert_gemm(call.x, w, call.topk_ids, call.layout, routed=routed, x_per_entry=w2)
        moe_lora_apply(call._replace(y=y), meta, n, 0.5, PER_ENTRY)
        out[:] = [y]
        return y

    tol = TOL[torch.bfloat16]
    assert (want.y - base.float()).abs().max() > 10 * tol  # an update a race could lose or double shows
    return step, out, want.y, tol


@pytest.mark.parametrize("w2", [False, True], ids=["w13", "w2"])
def test_a_gemm_then_the_per_entry_path_gives_the_references_answer(w2):
    step, _, want, tol = gemm_then_per_entry(w2, torch.Generator().manual_seed(13))
    torch.testing.assert_close(step().float(), want, atol=tol, rtol=tol)


@pytest.mark.skipif(DEVICE != "cuda", reason="programmatic dependent launch needs a GPU")
@pytest.mark.parametrize("w2", [False, True], ids=["w13", "w2"])
def test_the_per_entry_path_as_the_expert_gemms_pdl_successor_gives_the_references_answer(monkeypatch, w2):
    """The per-entry kernel PDL-launched after the GEMM (``PER_ENTRY_PDL``: its h while the GEMM
    runs, y after it), eagerly and replayed from a CUDA graph, 20 times in turn (a race shows only
    now and then): the reference's answer every time."""
    from lorabench.kernels.launch import pdl_enabled
    from lorabench.runtime.graphs import capture_graph

    if not pdl_enabled(torch.device(DEVICE)):
        pytest.skip("needs sm90 or newer with PDL on")
    monkeypatch.setattr(moe_lora_per_entry, "PER_ENTRY_PDL", True)
    step, out, want, tol = gemm_then_per_entry(w2, torch.Generator().manual_seed(13))
    graph = capture_graph(step)
    graph_y = out[0]  # what the captured step writes
    for i in range(20):
        if i % 2:
            graph.replay()
        got = graph_y if i % 2 else step()
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("w2", [False, True], ids=["w13", "w2"])
@pytest.mark.parametrize("split", [1, 2, 10**6], ids=["one-program-all-tiles", "two-the-last-past-the-end", "a-tile-each"])
@pytest.mark.parametrize("unroll", [8, 2], ids=["unrolled", "in-steps-of-2"])
def test_per_entry_programs_walking_several_output_tiles_match_the_reference(w2, split, unroll, monkeypatch):
    """The per-entry path with each entry's output tiles split over fewer programs (``programs``):
    5 tiles of 32 over 150 outputs (the last partial), walked by one program (h computed once), by
    two of 3 tiles (the second walking past the slice's end) and one a tile, in one unrolled step
    or in steps of 2 tiles (the first program's second step reaching into the second's tiles,
    which it must leave alone); base tokens and a slot without expert LoRA mixed in."""
    monkeypatch.setattr(moe_lora_per_entry, "PER_ENTRY_UNROLL", unroll)
    gen = torch.Generator().manual_seed(23)
    slots = [0, -1, 3, 1, 2, 3]
    call, meta, n = expert_case(len(slots), slots, DTYPES[0], w2, gen, n_out=150)  # 5 tiles of 32 on the CPU
    entries_slices = call.topk_ids.numel() * call.lora_a.shape[0]
    want = fresh(call)
    reference.moe_lora_apply(want, meta, n, 0.5)
    got = fresh(call)
    moe_lora_apply(got, meta, n, 0.5, PER_ENTRY, per_entry=PerEntryTiling(1024, 4, entries_slices * split))
    torch.testing.assert_close(got.y.float(), want.y.float(), atol=TOL[DTYPES[0]] * 4, rtol=TOL[DTYPES[0]])
    rows = torch.tensor(slots, device=DEVICE).repeat_interleave(2)
    assert torch.equal(got.y[(rows < 0) | (rows == 2)], call.y[(rows < 0) | (rows == 2)])


@pytest.mark.parametrize("tokens, w13, w2", [(2, 7, 2), (8, 7, 2), (9, 0, 0), (64, 0, 0)])
def test_the_tile_loop_is_static_for_the_default_grid_of_few_entries(monkeypatch, tokens, w13, w2):
    """At Mixtral-8x7B's shapes on a GPU (128-wide tiles; recorded, not run), up to 16 routed entries
    each program walks a count of tiles the compiler is given (w13: 112 tiles over 16 programs, 7
    each; w2: 32 tiles, 2 each): with a runtime count, ptxas kept a third of w2's K-loop loads in
    flight (tests/compile_sm90.py compiles both loops). Above, the SM-count grid's runtime loop."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, kwargs))

    monkeypatch.setattr(moe_lora_per_entry, "_per_entry_kernel", Recorder())
    monkeypatch.setattr(moe_lora_per_entry, "INTERPRET", False)  # a GPU's tiles
    monkeypatch.setattr(moe_lora_per_entry, "sm_count", lambda device: 132)
    gen = torch.Generator().manual_seed(2)
    for is_w2, want in ((False, w13), (True, w2)):
        n, k = (4096, 14336) if is_w2 else (14336, 4096)
        call, meta, count = expert_case(tokens, [0] * tokens, torch.bfloat16, is_w2, gen, experts=8, n_out=n, k_in=k)
        launches.clear()
        moe_lora_apply(call, meta, count, 0.5, PER_ENTRY)
        (grid, kwargs), = launches
        assert kwargs["STATIC_TILES"] == want
        if want:
            assert grid == (tokens * 2, (1 if is_w2 else 2) * cdiv(cdiv(n, 128), want))


def test_a_per_entry_tiling_that_cannot_run_is_refused():
    call, meta, n = expert_case(2, [0, 1], DTYPES[0], False, torch.Generator().manual_seed(1))
    for bad in (PerEntryTiling(8, 4), PerEntryTiling(8192, 3), PerEntryTiling(8192, 4, 0)):
        with pytest.raises(ValueError, match="a_elements"):
            moe_lora_apply(call, meta, n, 0.5, PER_ENTRY, per_entry=bad)


@pytest.mark.parametrize("w2", [False, True], ids=["w13", "w2"])
@pytest.mark.parametrize("groups,n_loop", [(3, 1), (1, 3), (2, 2), (2, 3)],
                         ids=["a-tile-each", "one-column", "partial-last-group", "a-column-past-the-end"])
def test_sorted_expand_programs_walking_several_output_tiles_match_the_reference(w2, groups, n_loop, monkeypatch):
    """The sorted expand with fewer program columns than output tiles (each walking several with
    one h): 3 tiles of 32 over 72 outputs (the last partial), in columns of 1, 2 and 3 tiles, one
    group walking past the slice's end; base tokens and a slot without expert LoRA mixed in."""
    monkeypatch.setattr(moe_lora_module, "expand_groups", lambda n_tiles, busy, programs: (groups, n_loop))
    programs = 1
    gen = torch.Generator().manual_seed(17)
    slots = [0, -1, 3, 1, 2, 3]
    call, meta, n = expert_case(len(slots), slots, DTYPES[0], w2, gen, n_out=72)  # 3 tiles of 32 on the CPU
    want = fresh(call)
    reference.moe_lora_apply(want, meta, n, 0.5)
    got = fresh(call)
    moe_lora_apply(got, meta, n, 0.5, SORTED, SortedTiling(expand_programs=programs))
    torch.testing.assert_close(got.y.float(), want.y.float(), atol=TOL[DTYPES[0]] * 4, rtol=TOL[DTYPES[0]])
    rows = torch.tensor(slots, device=DEVICE).repeat_interleave(2)
    assert torch.equal(got.y[(rows < 0) | (rows == 2)], call.y[(rows < 0) | (rows == 2)])


@pytest.mark.parametrize("w2", [False, True], ids=["w13", "w2"])
@pytest.mark.parametrize("tiling", [SortedTiling(block_programs=1), SortedTiling(block_programs=3),
                                    SortedTiling(block_programs=10**6), SortedTiling(expand_programs=1, block_programs=2)],
                         ids=["one-walker", "three-walkers", "a-walker-each", "grouped-and-walked"])
def test_sorted_programs_walking_the_expert_blocks_match_the_reference_at_every_active_count(w2, tiling):
    """Fewer programs than expert blocks, each walking every k-th block that holds entries (the
    static worst case has mostly empty blocks): every active count, base tokens, a slot without
    expert LoRA; at the batch's launch count against the reference, at a short one (which drops
    the slots past it) against the default tiling."""
    gen = torch.Generator().manual_seed(19)
    for slots in ([0], [-1, 1], [3, -1, 0, 3, 1], [1, 2, -1, -1, 0, 3] * 2):
        call, meta, n = expert_case(len(slots), slots, DTYPES[0], w2, gen)
        want = fresh(call)
        reference.moe_lora_apply(want, meta, n, 0.5)
        got = fresh(call)
        moe_lora_apply(got, meta, n, 0.5, SORTED, tiling)
        torch.testing.assert_close(got.y.float(), want.y.float(), atol=TOL[DTYPES[0]] * 4, rtol=TOL[DTYPES[0]])
        short, walked = fresh(call), fresh(call)
        moe_lora_apply(short, meta, 1, 0.5, SORTED)
        moe_lora_apply(walked, meta, 1, 0.5, SORTED, tiling)
        torch.testing.assert_close(walked.y.float(), short.y.float(), atol=TOL[DTYPES[0]], rtol=TOL[DTYPES[0]])


def test_expand_groups_cover_every_tile_with_the_fewest_columns_for_the_programs_asked():
    assert expand_groups(24, 256, None) == (24, 1)  # one program per tile
    assert expand_groups(12, 256, 1024) == (4, 3)  # Qwen3-30B-A3B w13 at 64 tokens: 128 blocks x 2 slices
    assert expand_groups(12, 16, 1024) == (12, 1)  # few busy blocks: every tile its own program
    assert expand_groups(3, 8, 16) == (2, 2)  # a partial last group: 2 columns walk tiles 0-1 and 2
    for tiles in range(1, 40):
        for busy in (1, 7, 300):
            groups, loop = expand_groups(tiles, busy, 512)
            assert groups * loop >= tiles > (groups - 1) * loop  # every tile, no empty column


@pytest.mark.parametrize("w2", [False, True], ids=["w13", "w2"])
def test_a_short_grid_drops_slots_on_the_sorted_path_only(w2):
    gen = torch.Generator().manual_seed(3)
    slots = [0, 1, 3, -1]
    call, meta, n = expert_case(len(slots), slots, torch.float32, w2, gen)
    want = fresh(call)
    reference.moe_lora_apply(want, meta, n, 1.0)
    per_entry = fresh(call)
    moe_lora_apply(per_entry, meta, 1, 1.0, PER_ENTRY)  # its grid ignores the count
    tol = TOL[torch.float32]
    torch.testing.assert_close(per_entry.y, want.y, atol=tol, rtol=tol)
    short = fresh(call)
    moe_lora_apply(short, meta, 1, 1.0, SORTED)
    rows = torch.tensor(slots, device=DEVICE).repeat_interleave(2)
    torch.testing.assert_close(short.y[rows == 0], want.y[rows == 0], atol=tol, rtol=tol)
    assert torch.equal(short.y[rows == 3], call.y[rows == 3])  # slot 3 is past a grid of 1


@pytest.mark.parametrize("w2", [False, True], ids=["w13", "w2"])
def test_the_torch_backend_follows_the_same_paths(w2):
    gen = torch.Generator().manual_seed(5)
    for slots in ([0, 1, 3, -1], [0, 1, 3, -1] * 9):  # 4 tokens: per-entry; 36 over a few columns: sorted
        call, meta, n = expert_case(len(slots), slots, torch.float32, w2, gen, experts=16)
        for count in (1, n):
            assert path(len(slots), 2, 16, 4, count) == (PER_ENTRY if len(slots) == 4 else SORTED)
            want = fresh(call)
            moe_lora_apply(want, meta, count, 0.5, path(len(slots), 2, 16, 4, count))
            got = fresh(call)
            torch_lora.moe_lora_apply(got, meta, count, 0.5)
            torch.testing.assert_close(got.y, want.y, atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_experts_without_entries_and_a_batch_of_base_tokens_leave_y_alone():
    gen = torch.Generator().manual_seed(11)
    call, meta, n = expert_case(3, [-1, -1, -1], torch.float32, False, gen, experts=32)
    for kernel_path in (PER_ENTRY, SORTED):
        got = fresh(call)
        moe_lora_apply(got, meta, 4, 1.0, kernel_path)
        assert torch.equal(got.y, call.y)


def test_lorabenchs_rule_takes_per_entry_up_to_32_tokens_and_up_to_64_over_16_columns_or_more():
    for top_k, experts in ((8, 128), (2, 8), (8, 64), (2, 16)):  # Qwen3-30B-A3B, Mixtral, OLMoE, tiny: the same
        assert path(32, top_k, experts, 16, 1) == path(32, top_k, experts, 4, 4) == PER_ENTRY
        assert path(33, top_k, experts, 16, 1) == path(64, top_k, experts, 16, 15) == SORTED
        assert path(64, top_k, experts, 16, 16) == path(64, top_k, experts, 32, 32) == PER_ENTRY
        assert path(65, top_k, experts, 32, 32) == path(8192, top_k, experts, 4, 1) == SORTED
    assert path(1, 8, 128, 4, 0) == PER_ENTRY  # nothing launched: the rule still answers
    assert get_backend("triton").moe_path(64, 8, 128, 4, 1) == SORTED
    assert get_backend("triton").moe_path(64, 8, 128, 16, 16) == PER_ENTRY
    # vLLM's: tokens · top_k · 8 <= E · max_loras, whatever it launches
    assert get_backend("vllm").moe_path(8, 8, 128, 4, 1) == get_backend("vllm").moe_path(8, 8, 128, 4, 4) == PER_ENTRY


def vllm_available() -> bool:
    from lorabench.kernels import vllm_lora

    return vllm_lora.available()


# On a GPU only: vLLM's small-batch kernel asks its platform for the SM count, which its CPU platform lacks.
@pytest.mark.skipif(DEVICE == "cpu" or not vllm_available(), reason="needs a GPU and vLLM's Python files")
@pytest.mark.parametrize("w2", [False, True], ids=["w13", "w2"])
@pytest.mark.parametrize("tokens", [1, 6])  # vLLM's per-token path, then its sorted path
def test_vllms_fused_moe_lora_matches_the_reference_with_base_tokens(w2, tokens):
    from lorabench.kernels.vllm_lora import VllmMeta, load_ops

    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(tokens)
    slots = [[0], [3, -1, 0, 1, -1, 3]][tokens > 1]
    call, meta, _ = expert_case(tokens, slots, dtype, w2, gen, experts=4, max_loras=4)
    kernel_meta = load_ops()[2].make(4, tokens, torch.device(DEVICE))
    kernel_meta.prepare_tensors(torch.tensor(slots, dtype=torch.int32, device=DEVICE))
    want = fresh(call)
    reference.moe_lora_apply(want, meta, 4, 1.0)
    got = fresh(call)
    get_backend("vllm").moe_lora_apply(got, VllmMeta(kernel_meta, False), 5, 1.0)
    torch.testing.assert_close(got.y.float(), want.y.float(), atol=0.1, rtol=TOL[dtype])


def test_the_model_replays_the_last_routing_when_asked():
    from lorabench.config.models import resolve
    from lorabench.runtime.model import LlamaLoRA

    model = LlamaLoRA(resolve("tiny-moe"), max_loras=2, rank=8, max_tokens=4, context_len=8, dtype=torch.float32,
                      device=DEVICE)
    ids, pos = torch.tensor([1, 2, 3], device=DEVICE), torch.tensor([7, 7, 7], device=DEVICE)
    first = model(ids, pos)
    routed = [layer.moe.topk_ids[:3].clone() for layer in model.layers]
    for layer in model.layers:
        layer.moe.router.data = -layer.moe.router.data  # another router: other experts
    model.reuse_routing = True
    torch.testing.assert_close(model(ids, pos), first)
    model.reuse_routing = False
    model(ids, pos)
    assert any(not torch.equal(layer.moe.topk_ids[:3], r) for layer, r in zip(model.layers, routed))


@pytest.mark.skipif(DEVICE == "cpu" or not vllm_available(), reason="needs a GPU and vLLM's Python files")
def test_vllms_kernel_configs_are_the_ones_vllm_makes():
    try:
        from vllm.lora.layers.utils import try_get_optimal_moe_lora_config
    except ImportError:
        pytest.skip("vLLM's config package needs dependencies this machine lacks")
    from lorabench.kernels.vllm_moe_lora import vllm_configs

    for experts, inter, hidden, top_k in ((128, 768, 2048, 8), (8, 14336, 4096, 2)):
        for tokens in (1, 8, 64):
            ours = vllm_configs(experts, inter, 16, tokens, torch.device("cuda"))
            for part, mine in zip(("shrink", "expand"), ours):
                theirs = try_get_optimal_moe_lora_config(f"fused_moe_lora_w13_{part}", (experts, 2 * inter, hidden),
                                                         (experts, hidden, inter), 16, top_k, None, tokens)
                assert {k.upper(): v for k, v in theirs.items()} == {k.upper(): v for k, v in mine.items()}
