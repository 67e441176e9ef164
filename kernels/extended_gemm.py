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
weight bytes at decode), plus the shrink and ``pack_tail`` (one small launch). The model extends a
linear only where ``E <= K · EXTEND_MAX_FRACTION`` (``kernels.extends``); the others keep the pair. ``scripts/catk_probe.py``
times the extended GEMM against cuBLAS alone and the pair. The tail is a copy of B: the model
refreshes it wherever B is written (``LoRALinear.refresh_tail``). Adapters must be finite: a zero
of hm times an Inf in another slot's B is NaN, as in ``gemm_lora``'s epilogue.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .launch import cdiv, next_pow2
from .meta import LoRAMeta
from .shrink import shrink_into
from .tiles import token_served

PACK_BLOCK = 256  # tail columns per program


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
def _pack_tail_kernel(
    x_ptr,  # [T, K + E] the extended input: hm written at columns K ..
    h_ptr,  # [T, >= S·R] float32 shrink output (scale applied)
    token_slot_ptr,  # [T] slot of every token, -1 for base-model tokens
    active_ptr,  # [>= launch count] active slot ids, -1 past the active count
    K,  # x's own columns
    E,  # tail columns: L · S·R
    SR,  # h's columns per token: S · R
    LAUNCH,  # launch count: the active slots served
    stride_x, stride_h,
    LAUNCH_PAD: tl.constexpr,  # next power of two >= the launch count
    BLOCK: tl.constexpr,  # tail columns per program
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_e = offs < E
    slot, served = token_served(token_slot_ptr, t, active_ptr, LAUNCH, LAUNCH_PAD)
    block = tl.where(served > 0, slot, -1)  # the tail block token t's h goes to; -1: none
    take = in_e & (offs // SR == block)
    hm = tl.load(h_ptr + t * stride_h + offs % SR, mask=take, other=0.0)
    tl.store(x_ptr + t * stride_x + K + offs, hm.to(x_ptr.dtype.element_ty), mask=in_e)


def pack_tail(x_ext: torch.Tensor, k: int, h: torch.Tensor, meta: LoRAMeta, launch_count: int) -> None:
    """hm into x_ext[:, k:]: each served token's h row in its slot's block, zeros elsewhere."""
    tokens, width = x_ext.shape
    e, sr = width - k, h.shape[1]
    if e % sr or h.stride(-1) != 1 or x_ext.stride(-1) != 1:
        raise ValueError(f"tail of {e} columns for h of {sr}: not whole slot blocks, or a last axis not contiguous")
    _pack_tail_kernel[(tokens, cdiv(e, PACK_BLOCK))](
        x_ext, h, meta.token_slot, meta.active_slots, k, e, sr, max(0, launch_count), x_ext.stride(0), h.stride(0),
        LAUNCH_PAD=next_pow2(max(1, launch_count)), BLOCK=PACK_BLOCK, num_warps=4,
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


def extended_linear(x_ext, k, weight_ext, bias, lora_a, meta: LoRAMeta, launch_count, scale, slices, rank, scratch,
                    pdl=None) -> torch.Tensor:
    """``x·Wᵀ + bias`` plus the LoRA of the first ``launch_count`` active slots, as a new [T, N]:
    the shrink of x (x_ext's first K columns) into scratch (float32, zero on entry), hm packed
    into x_ext's tail, then ``F.linear(x_ext, weight_ext, bias)``."""
    h = shrink_into(x_ext[:, :k], lora_a, meta, launch_count, scale, slices, rank, scratch, pdl)
    pack_tail(x_ext, k, h, meta, launch_count)
    return F.linear(x_ext, weight_ext, bias)
