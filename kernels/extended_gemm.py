"""LoRA as extra K columns of the base GEMM: ``y = [x | hm]·[W | T]ᵀ``, one cuBLAS call.

The ``gemm`` backend's LoRA linears above ``gemm_lora.GEMM_MAX_TOKENS`` (prefill sizes), where its
own Triton GEMM trails cuBLAS and the pair's expand reads and writes y once more than the GEMM.

Layout, for a linear of K inputs, S output slices, rank R and a step that launches n slots: the
model stores its weight as the first K columns of ``W_ext [N, K + E]`` (E = ``kernels.tail_width``:
room for every slot, L·S·R rounded up to ``TAIL_ALIGN``). Each step's ``pack_step`` writes the
tail's first n blocks from B in launch order: column ``K + (j·S + s)·R + r`` of row n holds
``B[active[j]][n, r]`` when n lies in slice s, else 0 (block diagonal over the slices: one GEMM
cannot give slice s's rows only h_s). The input ``x_ext [T, K + E]`` holds x, then hm: token t's h
(its S·R scaled shrink outputs, rounded to the model's dtype as an expand reads them) in the block
of its slot's place among the launched, zeros elsewhere, and zeros for a token that is not served
(a base-model token, or a slot past the launch count). The GEMM then reads the first K + E_n
columns of both (E_n = n·S·R rounded up to ``TAIL_ALIGN``, ``tail_width``), so it adds ``B[slot]·h``
to each token's row: the expand, with y written once, by cuBLAS, whose base GEMM this is too.

What it costs: the GEMM's K grows by E_n / K, with the launch count and not the slots held (one
launched adapter of 16 slots pays for one), plus the shrink and ``pack_step`` (one launch that
writes hm and copies the launched slots' B into the tail: about their B's bytes twice). The tail
holds no state between steps, so nothing that writes B has to refresh it. The model extends a
linear only where ``E <= K · EXTEND_MAX_FRACTION`` (``kernels.extends``); the others keep the
pair. ``scripts/catk_probe.py`` times the extended GEMM against cuBLAS alone and the pair.
Adapters must be finite: a zero of hm times an Inf in B is NaN, as in ``gemm_lora``'s epilogue.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import tail_width
from .launch import cdiv, next_pow2
from .meta import LoRAMeta
from .shrink import shrink_into
from .tiles import launch_positions, slice_ends

PACK_TOKENS = 16  # tokens per packing program
PACK_COLUMNS = 256  # at most this many tail columns per packing program
COPY_ROWS = 64  # B's rows per copying program
COPY_RANK = 64  # at most this many of B's columns per copying program


@triton.jit
def _pack_step_kernel(
    x_ptr,  # [T, K + E] the extended input: hm written at columns K .. K + EW
    h_ptr,  # [T, >= S·R] float32 shrink output (scale applied)
    b_ptr,  # [L, >= NB, R] stacked B
    tail_ptr,  # [N, >= EW] the weight's tail (W_ext's columns K ..): block (j, s) gets B[active[j]]'s slice s
    token_slot_ptr,  # [T] slot of every token, -1 for base-model tokens
    active_ptr,  # [>= launch count] active slot ids, -1 past the active count
    T,  # tokens
    K,  # x's own columns
    EW,  # the step's tail columns: S·R·launch rounded up to TAIL_ALIGN
    S,  # slices
    R,  # rank: B's columns
    NB,  # B's rows copied: the last slice's end (may be before N: a fully sharded rank's share)
    n1, n2,  # the first two slices' ends (past the last slice: the last end)
    LAUNCH,  # launch count: the active slots served
    stride_x, stride_h, stride_bl, stride_bn, stride_br, stride_t,
    LAUNCH_PAD: tl.constexpr,  # next power of two >= the launch count
    TOKENS: tl.constexpr,  # packing: tokens per program
    COLUMNS: tl.constexpr,  # packing: tail columns per program
    ROWS: tl.constexpr,  # copying: B's rows per program
    RANK_BLOCK: tl.constexpr,  # copying: B's columns per program
):
    """Programs [0, P) pack hm into x_ext's tail (a TOKENS x COLUMNS tile each, P = the tiles);
    the rest copy B of the launched slots into the weight's tail, (launch place j, ROWS rows,
    RANK_BLOCK columns) each. A place whose active id is -1 gets zeros."""
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(EW, COLUMNS)
    pack_programs = tl.cdiv(T, TOKENS) * col_blocks
    if pid < pack_programs:  # (the branches' names differ: Triton types a name once across them)
        tokens = (pid // col_blocks) * TOKENS + tl.arange(0, TOKENS)
        offs = (pid % col_blocks) * COLUMNS + tl.arange(0, COLUMNS)
        t_mask = tokens < T
        place = launch_positions(token_slot_ptr, tokens, t_mask, active_ptr, LAUNCH, LAUNCH_PAD)
        SR = S * R
        take = t_mask[:, None] & (offs[None, :] < EW) & (offs[None, :] // SR == place[:, None])
        tok = tokens.to(tl.int64)[:, None]
        hm = tl.load(h_ptr + tok * stride_h + offs[None, :] % SR, mask=take, other=0.0)
        tl.store(x_ptr + tok * stride_x + K + offs[None, :], hm.to(x_ptr.dtype.element_ty),
                 mask=t_mask[:, None] & (offs[None, :] < EW))
    else:
        g = pid - pack_programs
        rank_blocks = tl.cdiv(R, RANK_BLOCK)
        per_place = tl.cdiv(NB, ROWS) * rank_blocks
        j = g // per_place
        rows = ((g % per_place) // rank_blocks) * ROWS + tl.arange(0, ROWS)
        offs_r = (g % rank_blocks) * RANK_BLOCK + tl.arange(0, RANK_BLOCK)
        slot = tl.load(active_ptr + j)
        mask = (rows[:, None] < NB) & (offs_r[None, :] < R)
        b = tl.load(b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bl + rows[:, None].to(tl.int64) * stride_bn
                    + offs_r[None, :] * stride_br, mask=mask & (offs_r[None, :] * 0 + slot >= 0), other=0.0)
        s = (rows >= n1).to(tl.int32) + (rows >= n2).to(tl.int32)  # each row's slice
        cols = (j * S + s[:, None]) * R + offs_r[None, :]
        tl.store(tail_ptr + rows[:, None].to(tl.int64) * stride_t + cols, b.to(tail_ptr.dtype.element_ty), mask=mask)


def pack_step(x_ext: torch.Tensor, k: int, tail: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, slice_starts,
              meta: LoRAMeta, launch_count: int) -> int:
    """One launch: hm into x_ext's columns k .. k + E_n (each served token's h row in the block of
    its slot's launch place, zeros elsewhere) and the launched slots' B into ``tail`` (W_ext's
    columns k ..), in launch order: each slice's rows of each block, B's rows up to the last
    slice's end. The blocks' other rows are never written: the caller keeps them zero (``extend``
    allocates zeros). Returns E_n (``tail_width`` of the launch count), the columns the GEMM then reads."""
    tokens = x_ext.shape[0]
    slices, rank = len(slice_starts) - 1, lora_b.shape[2]
    width = tail_width(slices, max(0, launch_count), rank)
    if h.shape[1] < slices * rank or h.stride(-1) != 1 or x_ext.stride(-1) != 1 or tail.stride(-1) != 1:
        raise ValueError(f"h of {h.shape[1]} columns for {slices} x rank {rank}, or a last axis not contiguous")
    if width > min(x_ext.shape[1] - k, tail.shape[1]) or slice_starts[-1] > tail.shape[0]:
        raise ValueError(f"{launch_count} launched slots need {width} tail columns over {slice_starts[-1]} rows; "
                         f"the input has {x_ext.shape[1] - k}, the weight {tuple(tail.shape)}")
    if launch_count > meta.active_slots.shape[0] or lora_b.shape[1] < slice_starts[-1]:
        raise ValueError(f"{launch_count} launched of {meta.active_slots.shape[0]} active ids, or B of "
                         f"{lora_b.shape[1]} rows for slices ending at {slice_starts[-1]}")
    ends, _ = slice_ends(slice_starts, "extended")
    rank_block = min(COPY_RANK, next_pow2(rank))
    columns = min(PACK_COLUMNS, next_pow2(max(1, width)))
    packing = cdiv(tokens, PACK_TOKENS) * cdiv(width, columns)
    copying = max(0, launch_count) * cdiv(slice_starts[-1], COPY_ROWS) * cdiv(rank, rank_block)
    if packing + copying == 0:
        return width
    _pack_step_kernel[(packing + copying,)](
        x_ext, h, lora_b, tail, meta.token_slot, meta.active_slots, tokens, k, width, slices, rank, slice_starts[-1],
        ends[0], ends[1], max(0, launch_count),
        x_ext.stride(0), h.stride(0), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), tail.stride(0),
        LAUNCH_PAD=next_pow2(max(1, launch_count)), TOKENS=PACK_TOKENS, COLUMNS=columns, ROWS=COPY_ROWS,
        RANK_BLOCK=rank_block, num_warps=4,
    )
    return width


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


def extended_linear(x_ext, k, weight_ext, bias, lora_a, lora_b, slice_starts, meta: LoRAMeta, launch_count, scale,
                    scratch, pdl=None, shrunk=False) -> torch.Tensor:
    """``x·Wᵀ + bias`` plus the LoRA of the first ``launch_count`` active slots, as a new [T, N]:
    the shrink of x (x_ext's first K columns) into scratch (float32, zero on entry; ``shrunk``:
    scratch holds h already, from the op that produced x, ``prompt_shrink``), then ``pack_step``
    (hm into x_ext's tail, the launched slots' B into weight_ext's), then ``F.linear`` over the
    first K + E_n columns of both (strided views: no copies)."""
    slices, rank = len(slice_starts) - 1, lora_b.shape[2]
    if shrunk:
        h = scratch[:x_ext.shape[0], :slices * rank]
    else:
        h = shrink_into(x_ext[:, :k], lora_a, meta, launch_count, scale, slices, rank, scratch, pdl)
    width = pack_step(x_ext, k, weight_ext[:, k:], h, lora_b, slice_starts, meta, launch_count)
    return F.linear(x_ext[:, :k + width], weight_ext[:, :k + width], bias)
