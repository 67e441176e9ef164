"""Expert LoRA: the LoRA of every routed expert of a MoE layer, updating the per-entry intermediates.

For a projection with slices ``s`` (w13: gate and up; w2: one) and each routed entry ``i`` (token
``t = i // top_k``, expert ``e``) whose token's slot is an adapter with expert LoRA::

    y[i, slice s] += scale · B[s, slot, e] @ (A[s, slot, e] @ x[row(i)])   (· routing weight, for w2)

Layouts as ``expert_call.ExpertCall`` says. Two Triton paths:

- **per-entry** (``moe_lora_per_entry``): one launch per projection, the shrink and the expand
  fused, its grid independent of the adapters;
- **sorted** (here: ``sorted_shrink_kernel``, then ``sorted_expand_kernel``): programs over the base
  MoE's own expert blocks (no second alignment) x ``launch_count`` adapter columns; column ``z``
  serves the block's entries of slot ``active_slots[z]``, so the grid follows the active count
  like the dense kernels. The shrink writes each entry's h once (A read once per block and slot),
  and the expand's programs per output tile read it back: a fused kernel recomputing h in every
  output tile read A tens of times over (Mixtral's w13 has 224 tiles of 64) and cost more than
  the second launch saves. ``SortedTiling`` sets how many programs cover the blocks and the
  output tiles (by default one per block of the static worst case, the expand's tiles grouped to
  about 512 programs per adapter column).

Which one a step takes is the backend's rule (``moe_path``), a function of the bucket's tokens and
the graph's launch count (its adapter columns).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .expert_call import ExpertCall
from .launch import INTERPRET, cdiv, dot_width, upcast
from .meta import LoRAMeta
from .moe_gemm import BLOCK_M, gathered_dot
from .moe_lora_per_entry import PerEntryTiling, per_entry_apply

PER_ENTRY, SORTED = "per-entry", "sorted"
PER_ENTRY_TOKENS = 32  # lorabench's rule: buckets of up to this many tokens take the per-entry path,
PER_ENTRY_TOKENS_WIDE = 64  # and of up to this many where the graph launches WIDE_LAUNCH adapter columns or more
WIDE_LAUNCH = 16


def moe_path(tokens: int, top_k: int, experts: int, max_loras: int, launch_count: int) -> str:
    """lorabench's choice for a graph of ``tokens`` tokens launched for ``launch_count`` adapter
    columns: per-entry up to 32 tokens, and up to 64 where it launches 16 columns or more; sorted
    otherwise. Per-entry's cost grows with the routed entries (each rereads its expert's A and B,
    mostly from L2) and not with the columns; the sorted path's grows with the columns (an adapter
    column of programs over every block) and shares each block's A and B among its entries, so it
    wins at many tokens over few columns. Every layer's expert LoRA after its grouped GEMM, 16 slots,
    one base token, ms over the GEMM alone, per-entry (the GEMM's PDL successor) / sorted, H100, git
    8cb194b (``moe/expert-lora-gemm``): Qwen3-30B-A3B (128 experts, top-8) 32 tokens, 1 column 1.45
    / 1.79, 8 columns 1.71 / 2.84; 64 tokens, 1 column 2.84 / **1.92**, 16 columns 3.55 / 4.15;
    Mixtral-8x7B (8 experts, top-2) 32 tokens, 1 column 1.75 / 2.51, 8 columns 2.42 / 3.05; 64
    tokens, 1 column 2.92 / **2.62**, 16 columns 4.15 / 4.39; per-entry wins at 2 and 8 tokens by
    2-6x on both. Between 32 and 64 tokens with 2 to 8 columns neither is timed (the sorted path's
    cost per column there, ~0.15 ms on Qwen3, puts it ahead at 4). Above 64 tokens (mixed steps'
    prompts) sorted, where blocks fill. A ``max`` graph launches every slot's column whatever its
    batch holds, so with few active it takes per-entry where sorted would likely win (64 tokens,
    1 active, 16 launched is not timed). The experts and top-k do not enter: the crossover sat near
    the same token count on both models, at 4 and at 16 entries an expert."""
    del top_k, experts, max_loras
    if tokens <= PER_ENTRY_TOKENS or (tokens <= PER_ENTRY_TOKENS_WIDE and launch_count >= WIDE_LAUNCH):
        return PER_ENTRY
    return SORTED


@triton.jit
def _block_of_slot(pid_m, slot, sorted_ptr, token_slot_ptr, numel, top_k, BLOCK_M: tl.constexpr):
    """Block ``pid_m``'s entries and which of them are ``slot``'s (a padding entry is no one's)."""
    entry = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = entry < numel
    mine = valid & (tl.load(token_slot_ptr + entry // top_k, mask=valid, other=-1) == slot)
    return entry, mine


@triton.jit
def _column_slot(pid_m, z, post_pad_ptr, active_ptr, enabled_ptr, BLOCK_M: tl.constexpr, BLOCK_PROGRAMS: tl.constexpr):
    """Adapter column ``z``'s slot, or -1 where it has nothing to do: a column past the batch's
    active slots, a slot without expert LoRA, and (one program per block) a block past the padded
    count, asked first so that its load is issued with the slot's."""
    slot = tl.load(active_ptr + z)  # int32: the branches below keep its type
    if BLOCK_PROGRAMS == 0:
        if pid_m * BLOCK_M >= tl.load(post_pad_ptr):
            slot = -1
    if slot >= 0:
        if tl.load(enabled_ptr + slot) == 0:
            slot = -1
    return slot


@triton.jit
def _shrink_block(
    pid_m, slot, s, x_ptr, a_ptr, h_ptr, sorted_ptr, expert_ids_ptr, token_slot_ptr,
    K, R, numel, top_k, scale, stride_xm, stride_as, stride_al, stride_ae, stride_ar, stride_hs, stride_hp,
    X_PER_ENTRY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Block ``pid_m``'s h for slot ``slot``'s entries, slice ``s`` (nothing when it holds none)."""
    entry, mine = _block_of_slot(pid_m, slot, sorted_ptr, token_slot_ptr, numel, top_k, BLOCK_M)
    if tl.max(mine.to(tl.int32), axis=0) > 0:
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        rows = entry if X_PER_ENTRY else entry // top_k
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        a_base = a_ptr + s * stride_as + slot * stride_al + expert * stride_ae
        h = gathered_dot(x_ptr, rows, mine, stride_xm, a_base, offs_r, r_mask, stride_ar, K, BLOCK_M, BLOCK_R, BLOCK_K,
                         UPCAST)
        offs_p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        out = h_ptr + s * stride_hs + offs_p[:, None] * stride_hp + offs_r[None, :]
        tl.store(out, (h * scale).to(h_ptr.dtype.element_ty), mask=mine[:, None] & r_mask[None, :])


@triton.jit
def _sorted_shrink_kernel(
    x_ptr, a_ptr, h_ptr,
    sorted_ptr,  # [P] the base MoE's entries per expert, in blocks of BLOCK_M, pad value numel
    expert_ids_ptr,  # [P / BLOCK_M]
    post_pad_ptr,  # [1]
    token_slot_ptr,  # [T]
    active_ptr,  # [>= launch count] active slots, -1 past the batch's
    enabled_ptr,  # [L]
    K, R, numel, top_k, scale,
    stride_xm,
    stride_as, stride_al, stride_ae, stride_ar,
    stride_hs, stride_hp,  # h [S, P, R]
    BLOCK_PROGRAMS: tl.constexpr,  # 0: one program per block; else this many, each walking every BLOCK_PROGRAMS-th
    X_PER_ENTRY: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,  # >= 16 for tl.dot
    UPCAST: tl.constexpr,  # dot in fp32 (interpreter + bf16 only)
):
    """h[s, p] = scale · A[s, slot, e] @ x[row(p)] for the block's entries p of the column's slot."""
    s = tl.program_id(1)
    slot = _column_slot(tl.program_id(0), tl.program_id(2), post_pad_ptr, active_ptr, enabled_ptr, BLOCK_M,
                        BLOCK_PROGRAMS)
    if slot < 0:
        return
    slot = slot.to(tl.int64)
    if BLOCK_PROGRAMS == 0:
        _shrink_block(tl.program_id(0), slot, s, x_ptr, a_ptr, h_ptr, sorted_ptr, expert_ids_ptr, token_slot_ptr,
                      K, R, numel, top_k, scale, stride_xm, stride_as, stride_al, stride_ae, stride_ar,
                      stride_hs, stride_hp, X_PER_ENTRY, BLOCK_M, BLOCK_K, BLOCK_R, UPCAST)
    else:
        used = (tl.load(post_pad_ptr) + BLOCK_M - 1) // BLOCK_M  # the blocks that hold entries
        for pid_m in range(tl.program_id(0), used, BLOCK_PROGRAMS):
            _shrink_block(pid_m, slot, s, x_ptr, a_ptr, h_ptr, sorted_ptr, expert_ids_ptr, token_slot_ptr,
                          K, R, numel, top_k, scale, stride_xm, stride_as, stride_al, stride_ae, stride_ar,
                          stride_hs, stride_hp, X_PER_ENTRY, BLOCK_M, BLOCK_K, BLOCK_R, UPCAST)


@triton.jit
def _expand_block(
    pid_m, slot, pid_n, h_ptr, b_ptr, y_ptr, sorted_ptr, expert_ids_ptr, routed_ptr, token_slot_ptr,
    NS, R, numel, top_k, stride_hs, stride_hp, stride_bs, stride_bl, stride_be, stride_bn, stride_ym,
    GROUPS: tl.constexpr, N_LOOP: tl.constexpr, MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr,
):
    """Block ``pid_m``'s update of its group ``pid_n`` of output tiles for slot ``slot``'s entries."""
    entry, mine = _block_of_slot(pid_m, slot, sorted_ptr, token_slot_ptr, numel, top_k, BLOCK_M)
    if tl.max(mine.to(tl.int32), axis=0) > 0:
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        s = pid_n // GROUPS
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        offs_p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        h = tl.load(h_ptr + s * stride_hs + offs_p[:, None] * stride_hp + offs_r[None, :],
                    mask=mine[:, None] & r_mask[None, :], other=0.0)
        if UPCAST:
            h = h.to(tl.float32)
        if MUL_WEIGHT:
            weight = tl.load(routed_ptr + entry, mask=mine, other=0.0)
        b_base = b_ptr + s * stride_bs + slot * stride_bl + expert * stride_be
        for t in tl.static_range(N_LOOP):  # tiles past the slice's last are masked off (offs_n >= NS)
            offs_n = ((pid_n % GROUPS) * N_LOOP + t) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < NS
            b = tl.load(b_base + offs_n[None, :] * stride_bn + offs_r[:, None], mask=n_mask[None, :] & r_mask[:, None],
                        other=0.0)
            if UPCAST:
                b = b.to(tl.float32)
            delta = tl.dot(h, b)
            if MUL_WEIGHT:
                delta *= weight[:, None]
            out = y_ptr + entry[:, None] * stride_ym + s * NS + offs_n[None, :]
            mask = mine[:, None] & n_mask[None, :]
            cur = tl.load(out, mask=mask, other=0.0).to(tl.float32)
            tl.store(out, (cur + delta).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sorted_expand_kernel(
    h_ptr, b_ptr, y_ptr,
    sorted_ptr, expert_ids_ptr, post_pad_ptr,
    routed_ptr,  # [numel] (MUL_WEIGHT)
    token_slot_ptr, active_ptr, enabled_ptr,
    NS, R, numel, top_k,
    stride_hs, stride_hp,
    stride_bs, stride_bl, stride_be, stride_bn,
    stride_ym,
    BLOCK_PROGRAMS: tl.constexpr,  # as the shrink's
    GROUPS: tl.constexpr,  # program columns per slice
    N_LOOP: tl.constexpr,  # output tiles each program walks, its h and routing weights loaded once
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """y[p, slice s, tiles] += B[s, slot, e][tiles] @ h[s, p] (· routing weight) for the same entries."""
    pid_n = tl.program_id(1)
    slot = _column_slot(tl.program_id(0), tl.program_id(2), post_pad_ptr, active_ptr, enabled_ptr, BLOCK_M,
                        BLOCK_PROGRAMS)
    if slot < 0:
        return
    slot = slot.to(tl.int64)
    if BLOCK_PROGRAMS == 0:
        _expand_block(tl.program_id(0), slot, pid_n, h_ptr, b_ptr, y_ptr, sorted_ptr, expert_ids_ptr, routed_ptr,
                      token_slot_ptr, NS, R, numel, top_k, stride_hs, stride_hp, stride_bs, stride_bl, stride_be,
                      stride_bn, stride_ym, GROUPS, N_LOOP, MUL_WEIGHT, BLOCK_M, BLOCK_N, BLOCK_R, UPCAST)
    else:
        used = (tl.load(post_pad_ptr) + BLOCK_M - 1) // BLOCK_M
        for pid_m in range(tl.program_id(0), used, BLOCK_PROGRAMS):
            _expand_block(pid_m, slot, pid_n, h_ptr, b_ptr, y_ptr, sorted_ptr, expert_ids_ptr, routed_ptr,
                          token_slot_ptr, NS, R, numel, top_k, stride_hs, stride_hp, stride_bs, stride_bl, stride_be,
                          stride_bn, stride_ym, GROUPS, N_LOOP, MUL_WEIGHT, BLOCK_M, BLOCK_N, BLOCK_R, UPCAST)


class SortedTiling(NamedTuple):
    """How the sorted path's programs cover its work. ``scripts/moe_lora_bench.py`` times the
    others side by side. The default groups the expand's tiles to about 512 programs per adapter
    column: on the H200 (expert LoRA alone, 16 slots, bf16) that cut Qwen3-30B-A3B's 32 tokens /
    8 active from 4.57 to 2.81 ms and 64 / 16 from 8.42 to 4.09 ms, Mixtral's 64 / 16 from 6.28 to
    4.38 ms, and cost at most 1 % where it lost (Mixtral, 2 tokens, 1 active). Walking the blocks
    (``block_programs``) lost at every point measured, 2-30 %."""

    expand_programs: int | None = 512  # the expand's programs per adapter column (``expand_groups``); None: one per tile
    block_programs: int | None = None  # programs over the expert blocks, each walking every block_programs-th
    # block that holds entries; None: one per block of the static worst case, most of them empty at small batches

    def walkers(self, blocks: int) -> int:
        """The programs over ``blocks`` expert blocks (the grids' first axis)."""
        return min(blocks, self.block_programs) if self.block_programs else blocks


def expand_groups(n_tiles: int, busy: int, programs: int | None) -> tuple[int, int]:
    """The sorted expand's (program columns per slice, output tiles each walks). ``programs``
    None: one program per tile. Else the fewest columns that
    still give about ``programs`` programs per adapter column over the ``busy`` (block, slice) pairs
    that can hold entries (at most min(entries, experts) blocks per slice): every program of an
    adapter column that has nothing to do still costs a launch slot, and at 16 slots those empty
    programs cost Qwen3-30B-A3B's step 0.2 ms per column."""
    if programs is None:
        return n_tiles, 1
    groups = max(1, min(n_tiles, cdiv(programs, max(1, busy))))
    n_loop = cdiv(n_tiles, groups)
    return cdiv(n_tiles, n_loop), n_loop


def sorted_shrink(call: ExpertCall, meta: LoRAMeta, launch_count: int, scale: float,
                  tiling: SortedTiling = SortedTiling()) -> torch.Tensor:
    """The sorted path's shrink alone: h [S, P, R] in y's dtype (x's where y is None), row p the
    update's rank-R piece of the base layout's entry at padded position p, scale applied, for the
    entries of the first ``launch_count`` active slots with expert LoRA; other rows are not
    written (garbage: a reader masks them by slot, as the expand does)."""
    if tiling.block_programs is not None and tiling.block_programs < 1:
        raise ValueError(f"block_programs must be at least 1, not {tiling.block_programs}")
    slices, _, _, rank, k = call.lora_a.shape
    tokens, top_k = call.topk_ids.shape
    block_r = dot_width(rank)
    sorted_ids, expert_ids, post_pad = call.layout
    blocks = cdiv(sorted_ids.shape[-1], BLOCK_M)
    dtype = (call.y if call.y is not None else call.x).dtype
    h = torch.empty(slices, blocks * BLOCK_M, rank, dtype=dtype, device=call.x.device)
    _sorted_shrink_kernel[(tiling.walkers(blocks), slices, launch_count)](
        call.x, call.lora_a, h, sorted_ids, expert_ids, post_pad, meta.token_slot, meta.active_slots, call.enabled,
        k, rank, tokens * top_k, top_k, scale, *call.shrink_strides(), h.stride(0), h.stride(1),
        BLOCK_PROGRAMS=tiling.block_programs or 0, X_PER_ENTRY=call.x_per_entry, BLOCK_M=BLOCK_M,
        BLOCK_K=32 if INTERPRET else (128 if block_r <= 64 else 64), BLOCK_R=block_r,
        UPCAST=upcast(call.x.dtype), num_warps=4,
    )
    return h


def moe_lora_apply(call: ExpertCall, meta: LoRAMeta, launch_count: int, scale: float,
                   path_name: str | None = None, tiling: SortedTiling = SortedTiling(),
                   per_entry: PerEntryTiling = PerEntryTiling()) -> None:
    """``call.y += expert LoRA`` with lorabench's kernels, on ``path_name`` (``PER_ENTRY`` or
    ``SORTED``; None: the one ``moe_path`` chooses), the sorted path's programs as ``tiling`` says,
    the per-entry path's as ``per_entry`` does. The triton and fused backends' MoE op."""
    if launch_count <= 0:
        return
    slices, max_loras, experts, rank, k = call.lora_a.shape
    ns = call.lora_b.shape[3]
    tokens, top_k = call.topk_ids.shape
    numel = tokens * top_k
    if numel == 0:
        return
    path_name = path_name or moe_path(tokens, top_k, experts, max_loras, launch_count)
    if path_name == PER_ENTRY:
        per_entry_apply(call, meta, scale, per_entry)
        return
    block_r = dot_width(rank)
    h = sorted_shrink(call, meta, launch_count, scale, tiling)  # [S, blocks · BLOCK_M, R]
    sorted_ids, expert_ids, post_pad = call.layout
    block_n = 32 if INTERPRET else 64
    groups, n_loop = expand_groups(cdiv(ns, block_n), min(numel, experts) * slices, tiling.expand_programs)
    _sorted_expand_kernel[(tiling.walkers(h.shape[1] // BLOCK_M), slices * groups, launch_count)](
        h, call.lora_b, call.y, sorted_ids, expert_ids, post_pad, call.topk_weights, meta.token_slot, meta.active_slots,
        call.enabled, ns, rank, numel, top_k, h.stride(0), h.stride(1), *call.expand_strides(),
        BLOCK_PROGRAMS=tiling.block_programs or 0, GROUPS=groups, N_LOOP=n_loop, MUL_WEIGHT=call.mul_weight,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=block_r, UPCAST=upcast(call.x.dtype), num_warps=4,
    )
