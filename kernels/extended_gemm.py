"""LoRA as extra K columns of the base GEMM: ``y = [x | hm]·[W | T]ᵀ``, one cuBLAS call.

The ``gemm`` backend's LoRA linears above ``gemm_lora.GEMM_MAX_TOKENS`` (prefill sizes), where its
own Triton GEMM trails cuBLAS and the pair's expand reads and writes y once more than the GEMM.

Layout, for a linear of K inputs, S output slices, rank R and L slots (``kernels.tail_width``: E = L·S·R):
the model stores its weight as the first K columns of ``W_ext [N, K + E]``; column
``K + (l·S + s)·R + r`` of row n holds ``B[l][n, r]`` when n lies in slice s, else 0 (block
diagonal over the slices: one GEMM cannot give slice s's rows only h_s). Its input ``x_ext [T, K +
E]`` holds x, then hm: token t's h (its S·R scaled shrink outputs, rounded to the model's dtype as
an expand reads them) in its slot's S·R columns, zeros elsewhere, and zeros for a token that is
not served (a base-model token, or a slot past the launch count). So the GEMM adds ``B[slot]·h``
to each token's row: the expand, with y written once, by cuBLAS, whose base GEMM this is too.

What it costs: the GEMM's K grows by E/K whatever the active count (extra FLOPs at prefill, extra
weight bytes at decode), plus ``tail_shrink``: one launch that reads x and writes hm straight into
x_ext's tail (no fp32 scratch, no separate pack). The model extends a
linear only where ``E <= K · EXTEND_MAX_FRACTION`` (``kernels.extends``); the others keep the pair. ``scripts/catk_probe.py``
times the extended GEMM against cuBLAS alone and the pair. The tail is a copy of B: the model
refreshes it wherever B is written (``LoRALinear.refresh_tail``). Adapters must be finite: a zero
of hm times an Inf in another slot's B is NaN, as in ``gemm_lora``'s epilogue.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .launch import cdiv, next_pow2, pow2_floor, sm_count, upcast
from .meta import LoRAMeta
from .tiles import own_rank

TAIL_BLOCK_K = 64  # the tail shrink's reduction step


def build_tail(tail: torch.Tensor, lora_b: torch.Tensor, slice_starts, slot: int | None = None) -> None:
    """Write B into the tail [N, L·S·R] (all slots, or one): slot l's slice s at columns
    (l·S + s)·R ..., its rows only; the rest of the block stays zero. slice_starts may end before N
    (a fully sharded rank's share of the outputs): the rows past it stay zero."""
    slices, rank = len(slice_starts) - 1, lora_b.shape[2]
    for l in range(lora_b.shape[0]) if slot is None else (slot,):
        for s in range(slices):
            lo, hi = slice_starts[s], slice_starts[s + 1]
            col = (l * slices + s) * rank
            tail[lo:hi, col:col + rank].copy_(lora_b[l, lo:hi])


@triton.jit
def _tail_shrink_kernel(
    x_ptr,  # [T, K + E] the extended input: x in its first K columns, hm written at columns K ..
    a_ptr,  # [L, S·RA, K] stacked A
    token_slot_ptr,  # [T] slot of every token, -1 for base-model tokens
    active_ptr,  # [>= launch count] active slot ids, -1 past the active count
    rank_ptr,  # [L] each slot's own rank (RANKED only)
    T,  # tokens
    K,  # x's own columns
    SR,  # a slot's tail columns: S · R
    RA,  # A's rows per slice: R, or R / TP (a fully sharded rank's share; h's other columns stay 0)
    R,  # the rank: tail columns per slice
    LAUNCH,  # launch count: the active slots served
    scale,
    stride_x, stride_al, stride_an,
    BLOCK_M: tl.constexpr,  # tokens per program
    BLOCK_E: tl.constexpr,  # tail columns per program (of one slot's block)
    BLOCK_K: tl.constexpr,  # reduction step
    E_TILES: tl.constexpr,  # programs per slot block: cdiv(S·R, BLOCK_E)
    LAUNCH_PAD: tl.constexpr,  # next power of two >= the launch count
    UPCAST: tl.constexpr,  # dot in fp32 (interpreter + bf16 only)
    RANKED: tl.constexpr,  # columns past a slot's own rank stay zero, their A unread
):
    pid_m = tl.program_id(0)
    slot = tl.program_id(1) // E_TILES
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = (tl.program_id(1) % E_TILES) * BLOCK_E + tl.arange(0, BLOCK_E)  # columns of the slot's block
    rows = offs_m.to(tl.int64)
    m_mask = offs_m < T
    offs_l = tl.arange(0, LAUNCH_PAD)
    launched = tl.load(active_ptr + offs_l, mask=offs_l < LAUNCH, other=-1)
    served = tl.where(tl.max((launched == slot).to(tl.int32), axis=0) > 0, slot, -2)  # -2: no token's slot
    token_slot = tl.load(token_slot_ptr + offs_m, mask=m_mask, other=-1)
    take = m_mask & (token_slot == served)  # the tile's tokens whose h this block holds
    r = offs_e % R
    a_row = (offs_e // R) * RA + r  # column s·R + r holds A's row s·RA + r
    e_ok = (offs_e < SR) & (r < RA)
    if RANKED:
        e_ok = e_ok & (r < own_rank(rank_ptr, slot, R))
    out = x_ptr + rows[:, None] * stride_x + K + slot * SR + offs_e[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_E), dtype=tl.float32)
    if tl.max(take.to(tl.int32), axis=0) > 0:  # else the block is zeros: nothing read
        a_base = a_ptr + slot.to(tl.int64) * stride_al
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            x = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=take[:, None] & k_mask[None, :],
                        other=0.0)
            a = tl.load(a_base + a_row[None, :].to(tl.int64) * stride_an + offs_k[:, None],
                        mask=e_ok[None, :] & k_mask[:, None], other=0.0)
            if UPCAST:
                x = x.to(tl.float32)
                a = a.to(tl.float32)
            acc += tl.dot(x, a)
        acc = tl.where(take[:, None] & e_ok[None, :], acc * scale, 0.0)
    tl.store(out, acc.to(x_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_e < SR)[None, :])


def tail_block_m(tokens: int, device: torch.device) -> int:
    """Tokens per tail-shrink program: a program or more per SM for one slot's tokens (16 to 64)."""
    return max(16, min(64, pow2_floor(tokens // max(1, sm_count(device)))))


def tail_shrink(x_ext: torch.Tensor, k: int, lora_a: torch.Tensor, meta: LoRAMeta, launch_count: int, scale: float,
                slices: int, rank: int) -> None:
    """hm into x_ext[:, k:], from x_ext's first k columns: each served token's scale · x·A[slot]ᵀ
    in its slot's S·R columns, in x's dtype; zeros elsewhere (other slots' blocks, base tokens,
    slots past the launch count). One launch, no fp32 scratch: a program per (token tile, slot
    block) computes the block only where one of its tokens is that slot's, else writes zeros."""
    tokens, width = x_ext.shape
    sr = slices * rank
    e = width - k
    if e % sr or x_ext.stride(-1) != 1 or lora_a.stride(-1) != 1:
        raise ValueError(f"tail of {e} columns for {sr} per slot: not whole slot blocks, or a last axis not contiguous")
    block_e = max(16, min(64, next_pow2(sr)))
    e_tiles = cdiv(sr, block_e)
    block_m = tail_block_m(tokens, x_ext.device)
    ranked = meta.slot_rank is not None
    _tail_shrink_kernel[(cdiv(tokens, block_m), (e // sr) * e_tiles)](
        x_ext, lora_a, meta.token_slot, meta.active_slots, meta.slot_rank if ranked else meta.active_slots,
        tokens, k, sr, lora_a.shape[1] // slices, rank, max(0, launch_count), scale,
        x_ext.stride(0), lora_a.stride(0), lora_a.stride(1),
        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_K=TAIL_BLOCK_K, E_TILES=e_tiles,
        LAUNCH_PAD=next_pow2(max(1, launch_count)), UPCAST=upcast(x_ext.dtype), RANKED=ranked, num_warps=4,
        num_stages=3,
    )


def input_buffer(tokens: int, k: int, width: int, dtype, device) -> torch.Tensor:
    """A new extended input [T, width]'s first K columns: where the op producing x writes it."""
    return torch.empty(tokens, width, dtype=dtype, device=device)[:, :k]


def extended_of(x: torch.Tensor, width: int) -> torch.Tensor | None:
    """The extended input [T, width] x is the first K columns of (``input_buffer``), or None when
    x's rows are not ``width`` apart inside one allocation that holds them."""
    t = x.shape[0]
    if x.dim() != 2 or x.stride(1) != 1 or (t > 1 and x.stride(0) != width):
        return None
    end = (x.storage_offset() + t * width) * x.element_size()
    if end > x.untyped_storage().nbytes():
        return None
    return torch.as_strided(x, (t, width), (width, 1), x.storage_offset())


def extended_linear(x_ext, k, weight_ext, bias, lora_a, meta: LoRAMeta, launch_count, scale, slices,
                    rank) -> torch.Tensor:
    """``x·Wᵀ + bias`` plus the LoRA of the first ``launch_count`` active slots, as a new [T, N]:
    hm written into x_ext's tail from x (its first K columns; ``tail_shrink``), then
    ``F.linear(x_ext, weight_ext, bias)``."""
    tail_shrink(x_ext, k, lora_a, meta, launch_count, scale, slices, rank)
    return F.linear(x_ext, weight_ext, bias)
