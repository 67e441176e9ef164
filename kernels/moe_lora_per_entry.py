"""Expert LoRA's per-entry path: the shrink and the expand fused, one launch per projection.

One program per routed entry and group of output tiles, each recomputing its entry's h from A
(a few entries: A comes from L2) and adding ``B[s, slot, e] @ h`` to its tiles of y. The grid does
not depend on the adapters, so it serves every adapter token at any launch count (the launch
count decides nothing here, as on vLLM's per-token path). ``moe_lora.moe_path`` decides when a
step takes it: buckets of up to 32 tokens, and up to 64 where the graph launches many adapter columns.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .expert_call import ExpertCall
from .launch import INTERPRET, cdiv, dot_width, next_pow2, pdl_enabled, pdl_launch, pdl_wait, sm_count
from .meta import LoRAMeta

PER_ENTRY_GROUPS = 16  # at most this many per-entry programs per entry and slice, each recomputing h from A
# sm90+: launch as a PDL successor of the expert GEMM, h computed while the GEMM runs and y touched
# after it (False: an ordinary launch). Every layer's expert LoRA after its GEMM, 16 slots, one base
# token, H100 (git b7856f1, scripts/moe_lora_bench.py --with-gemm; its "per-entry no pdl" variant
# gives the ordinary launch): Qwen3-30B-A3B 0.21 against 0.61 ms at 2 tokens, 0.61 against 1.07 at 8,
# 3.58 against 4.08 at 64; Mixtral-8x7B 0.39 against 2.05 at 2 tokens, 4.16 against 4.75 at 64.
PER_ENTRY_PDL = True
PER_ENTRY_UNROLL = 8  # at most this many output tiles a program walks unrolled, per step of its tile loop
SPREAD_ENTRIES = 16  # up to this many routed entries, each entry's output tiles are spread over programs
# (PER_ENTRY_GROUPS at most); above it the grid aims at one program per SM (PerEntryTiling.programs)


class PerEntryTiling(NamedTuple):
    """How the per-entry path's programs load A. ``scripts/moe_lora_bench.py`` times others
    side by side (``--per-entry``). The default takes A in steps of 32768 elements (Qwen3-30B-A3B's
    whole rank-16 A in one): its few programs are bound by the latency of their K loop's dependent
    loads, and wider steps keep more loads in flight. Every layer's expert LoRA after its GEMM,
    2 tokens (1 base), 16 slots, H100, an ordinary launch (git 0e5ab06): 0.60 against 1.21 ms
    (Qwen3-30B-A3B) and 1.15 against 4.30 ms (Mixtral-8x7B) with the earlier 8192 elements and 4
    warps; 16 warps were no faster."""

    a_elements: int = 32768  # A elements (BLOCK_K · BLOCK_R) a program loads per step of its K loop
    num_warps: int = 8
    # Programs to aim for: each entry's output tiles are split over just enough programs that the
    # grid holds at least this many (one an entry and slice at the fewest, PER_ENTRY_GROUPS at
    # most). Every program recomputes its entry's h from A, so each split reads A again from L2. None: PER_ENTRY_GROUPS an entry up to
    # SPREAD_ENTRIES entries, about one program per SM above (H100, 16 slots, per-entry forced, the
    # PDL successor (git b7856f1): Qwen3-30B-A3B 8 tokens 0.61 against 1.03 ms with PER_ENTRY_GROUPS an
    # entry at any count, 32 tokens 1.69 against 4.18, 64 tokens 3.58 against 9.06; Mixtral-8x7B 32
    # tokens 2.44 against 6.77; aiming at 264 or 528 programs is slower but at Qwen3's 64 tokens, 3.54
    # and 3.52, and Mixtral's 8, 1.37 with 264; at 2 tokens a tile each wins, 0.61 against 0.83 with
    # an ordinary launch, git a4b6911).
    programs: int | None = None


@triton.jit
def _per_entry_kernel(
    x_ptr, a_ptr, b_ptr, y_ptr,
    topk_ptr,  # [numel] each entry's expert
    routed_ptr,  # [numel] routing weights (MUL_WEIGHT)
    token_slot_ptr,  # [T] slot per token, -1 base
    enabled_ptr,  # [L]
    K, NS, R, E, numel, top_k, scale,
    GROUPS,  # program columns per slice
    N_LOOP,  # output tiles each program walks, its h computed once
    stride_xm,
    stride_as, stride_al, stride_ae, stride_ar,
    stride_bs, stride_bl, stride_be, stride_bn,
    stride_ym,
    X_PER_ENTRY: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    UNROLL: tl.constexpr,  # output tiles a step of the runtime tile loop walks unrolled
    USE_PDL: tl.constexpr,  # PDL-launched after the expert GEMM: h first, then wait before touching y
    # > 0: N_LOOP (= STATIC_TILES) known to the compiler, the tiles walked in a static loop; 0: the runtime loop.
    # Why: with a runtime tile count ptxas (Triton 3.6) gave w2's K loop 106 registers instead of 128 and kept
    # 4 of A's and x's 128-bit loads in flight instead of 12; Mixtral-8x7B's expert LoRA at 2 tokens, an
    # ordinary launch, took 2.05 ms against 1.15 (H100, git a4b6911 and b7856f1 against 0e5ab06).
    STATIC_TILES: tl.constexpr,
):
    entry = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    token = entry // top_k
    slot = tl.load(token_slot_ptr + token).to(tl.int64)
    if slot < 0:
        pdl_wait(USE_PDL)
        return
    if tl.load(enabled_ptr + slot) == 0:
        pdl_wait(USE_PDL)
        return
    expert = tl.load(topk_ptr + entry).to(tl.int64)
    if (expert < 0) | (expert >= E):
        pdl_wait(USE_PDL)
        return
    row = entry if X_PER_ENTRY else token
    s = pid_n // GROUPS
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    a_base = a_ptr + s * stride_as + slot * stride_al + expert * stride_ae
    h = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + row * stride_xm + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_base + offs_r[:, None] * stride_ar + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)
        h += tl.sum(a * x[None, :], axis=1)
    h = (h * scale).to(y_ptr.dtype.element_ty).to(tl.float32)  # rounded like a shrink's output
    b_base = b_ptr + s * stride_bs + slot * stride_bl + expert * stride_be
    weight = 1.0
    if MUL_WEIGHT:
        weight = tl.load(routed_ptr + entry)
    pdl_wait(USE_PDL)  # y is the GEMM's output: touched only once the GEMM is done (h computed before)
    y_row = y_ptr + entry * stride_ym + s * NS  # this entry's slice of y
    if STATIC_TILES > 0:  # tiles past the slice's last masked off (offs_n >= NS)
        for t in tl.static_range(STATIC_TILES):
            offs_n = ((pid_n % GROUPS) * STATIC_TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
            _add_tile(b_base, y_row, offs_n, offs_n < NS, offs_r, r_mask, h, weight, stride_bn)
    else:
        first = (pid_n % GROUPS) * N_LOOP  # this program's first output tile
        end = tl.minimum(NS, (first + N_LOOP) * BLOCK_N)  # past its last tile, or the slice's end
        for t0 in range(0, N_LOOP, UNROLL):  # UNROLL tiles at a time, unrolled: their loads in flight together
            for u in tl.static_range(UNROLL):  # past the program's tiles or the slice's last: masked off
                offs_n = (first + t0 + u) * BLOCK_N + tl.arange(0, BLOCK_N)
                _add_tile(b_base, y_row, offs_n, offs_n < end, offs_r, r_mask, h, weight, stride_bn)


@triton.jit
def _add_tile(b_base, y_row, offs_n, n_mask, offs_r, r_mask, h, weight, stride_bn):
    """y_row[offs_n] += (B tile @ h) · weight, masked by n_mask."""
    b = tl.load(b_base + offs_n[:, None] * stride_bn + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :],
                other=0.0).to(tl.float32)
    delta = tl.sum(b * h[None, :], axis=1) * weight
    cur = tl.load(y_row + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_row + offs_n, (cur + delta).to(y_row.dtype.element_ty), mask=n_mask)


def per_entry_apply(call: ExpertCall, meta: LoRAMeta, scale: float, tiling: PerEntryTiling = PerEntryTiling()) -> None:
    """``call.y += expert LoRA`` for every routed entry whose token's slot has expert LoRA."""
    slices, _, experts, rank, k = call.lora_a.shape
    ns = call.lora_b.shape[3]
    tokens, top_k = call.topk_ids.shape
    entries = tokens * top_k
    if entries == 0:
        return
    block_r = dot_width(rank)
    block_n = 32 if INTERPRET else 128
    bad_programs = tiling.programs is not None and tiling.programs < 1
    if tiling.a_elements < block_r or tiling.num_warps not in (1, 2, 4, 8, 16, 32) or bad_programs:
        raise ValueError(f"{tiling}: a_elements at least BLOCK_R ({block_r}), num_warps a power of two, programs >= 1")
    block_k = max(16, min(next_pow2(k), next_pow2(tiling.a_elements // block_r)))
    n_tiles = cdiv(ns, block_n)
    spread = tiling.programs is None and entries <= SPREAD_ENTRIES
    if spread:
        split = PER_ENTRY_GROUPS  # programs an entry and slice, at most
    else:
        split = cdiv(tiling.programs or sm_count(call.y.device), entries * slices)
    n_loop = cdiv(n_tiles, min(split, PER_ENTRY_GROUPS))  # tiles a program walks, its h computed once
    groups = cdiv(n_tiles, n_loop)
    # a static tile loop where the tiles a program walks are few and set by the entry's width alone (the default
    # grid up to SPREAD_ENTRIES): at most PER_ENTRY_UNROLL variants; the SM-count grids keep the runtime loop
    static_tiles = n_loop if spread and n_loop <= PER_ENTRY_UNROLL else 0
    pdl = PER_ENTRY_PDL and pdl_enabled(call.y.device)
    _per_entry_kernel[(entries, slices * groups)](
        call.x, call.lora_a, call.lora_b, call.y, call.topk_ids, call.topk_weights, meta.token_slot, call.enabled,
        k, ns, rank, experts, entries, top_k, scale, groups, n_loop, *call.shrink_strides(), *call.expand_strides(),
        X_PER_ENTRY=call.x_per_entry, MUL_WEIGHT=call.mul_weight, UNROLL=min(next_pow2(n_loop), PER_ENTRY_UNROLL),
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=block_r, USE_PDL=pdl, STATIC_TILES=static_tiles,
        num_warps=tiling.num_warps, **pdl_launch(pdl),
    )
