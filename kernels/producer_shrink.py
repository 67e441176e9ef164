"""The shrink fused into the kernel that produces its input: one launch for ``add_rmsnorm`` (or
``silu_mul``) and ``h += scale · x·A[slot]ᵀ``, instead of the base op and then the shrink.

At decode sizes a LoRA linear's shrink is a launch of its own, mostly latency; the op before the
linear already holds its input. Program (token t, chunk c) produces x[t, chunk c] as the base op
does (the norm recomputes its row's sum of squares from the whole row: 8 KB from L2 at 4096
features), stores it, and if t's slot is one of the first ``launch_count`` active slots, adds
that chunk's part of x[t]·A[slot]ᵀ to h[t] (fp32 atomics: h must be zero first). x is rounded
to the model's dtype before the dot, as the separate shrink reads it, so the LoRA sees the same
input. A token reads its slot's A itself: A is read once per adapter token (fine at decode, where
it is L2-resident; ``MAX_TOKENS`` bounds it, larger steps take the separate shrink). Nothing a
step writes decides which A rows a program needs, so under PDL it loads its slot and its first
``BLOCK_N`` rows of A (as many as ``PRELOAD_ELEMENTS`` leaves room for) before it waits for its
predecessor, while that GEMM still runs; only x waits.

Used by the ``gemm`` backend for qkv (the input norm), gate_up (the post-attention norm) and down
(SiLU·mul); o's input comes from attention, so o keeps its own shrink.
"""

import torch
import triton
import triton.language as tl

from .launch import INTERPRET, cdiv, next_pow2, pdl_enabled, pdl_launch, pdl_wait, pow2_floor  # noqa: F401
from .meta import LoRAMeta
from .tiles import own_rank, token_served

MAX_TOKENS = 64  # above: the base op, then the separate shrink (whose token tiles read A once per tile)
CHUNK = 256  # input features per program
# What a program holds in registers before its wait: the norm's row (ROW) and BLOCK_N x CHUNK of A. At
# K 4096 that is A's 64 rows (rank 16's qkv whole; 64 bytes of spills on sm_90, the version measured
# fast); at K 8192 32 rows (64 would spill 320 bytes).
PRELOAD_ELEMENTS = 20480
NORM, SILU_MUL = 0, 1  # the producers


@triton.jit
def _producer_shrink_kernel(
    x_ptr,  # NORM: [T, K] residual stream in; SILU_MUL: [T, 2K] gate | up
    d_ptr,  # [T, K] delta added first (NORM with HAS_DELTA)
    w_ptr,  # [K] norm weight (NORM)
    res_ptr,  # [T, K] out: x + delta (NORM with HAS_DELTA)
    out_ptr,  # [T, K] out: the linear's input
    a_ptr,  # [L, N, K] stacked A, N = slices · A's rows per slice
    h_ptr,  # [T, >= S·R] float32, zero on entry: h += scale · out·A[slot]ᵀ
    token_slot_ptr,  # [T] slot of every token, -1 for base-model tokens
    active_ptr,  # [>= launch count] active slot ids, -1 past the active count
    rank_ptr,  # [max_loras] each slot's own rank (RANKED only)
    K,  # the linear's input features
    N,  # A's rows
    RA,  # A's rows per slice (the rank, or rank / TP when fully sharded)
    R,  # h's columns per slice (the rank)
    LAUNCH,  # launch count: the active slots served
    eps,
    scale,
    stride_al, stride_an, stride_hm,
    PRODUCER: tl.constexpr,  # NORM or SILU_MUL
    HAS_DELTA: tl.constexpr,
    ROW: tl.constexpr,  # >= K: the norm's whole row
    CHUNK: tl.constexpr,  # input features per program
    BLOCK_N: tl.constexpr,  # A rows per step
    LAUNCH_PAD: tl.constexpr,  # next power of two >= the launch count
    USE_PDL: tl.constexpr,  # PDL-launched: load the slot and A's first rows, let the consumer launch, then wait
    RANKED: tl.constexpr,  # skip each slot's padding past its own rank
):
    t = tl.program_id(0).to(tl.int64)
    offs_k = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    k_mask = offs_k < K
    # Which slot t is, and its first BLOCK_N rows of A over this chunk: none of it is written within
    # a step, so under PDL it loads while the predecessor (the GEMM before) still runs.
    slot, served = token_served(token_slot_ptr, t, active_ptr, LAUNCH, LAUNCH_PAD)
    a_base = a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_al
    limit = RA
    if RANKED:
        limit = own_rank(rank_ptr, tl.maximum(slot, 0), RA)
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = (offs_n < N) & (offs_n % RA < limit) & (offs_n * 0 + served > 0)
    a = tl.load(a_base + offs_n[:, None] * stride_an + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the consumer (the GEMM) waits before it reads
    pdl_wait(USE_PDL)
    if PRODUCER == 0:
        offs = tl.arange(0, ROW)
        row = tl.load(x_ptr + t * K + offs, mask=offs < K, other=0.0).to(tl.float32)
        part = tl.load(x_ptr + t * K + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if HAS_DELTA:  # the residual stream is kept in the model's dtype, as add_rmsnorm keeps it
            row = (row + tl.load(d_ptr + t * K + offs, mask=offs < K, other=0.0).to(tl.float32))
            row = row.to(res_ptr.dtype.element_ty).to(tl.float32)
            part = part + tl.load(d_ptr + t * K + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            part = part.to(res_ptr.dtype.element_ty)
            tl.store(res_ptr + t * K + offs_k, part, mask=k_mask)
            part = part.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(row * row, axis=0) / K + eps)
        w = tl.load(w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        xo = ((part * inv).to(out_ptr.dtype.element_ty).to(tl.float32) * w).to(out_ptr.dtype.element_ty)
    else:
        g = tl.load(x_ptr + t * 2 * K + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + t * 2 * K + K + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        xo = (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * K + offs_k, xo, mask=k_mask)

    if served > 0:
        xf = xo.to(tl.float32)
        for n0 in range(0, N, BLOCK_N):
            if n0 > 0:  # rows past the first block load now
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_mask = (offs_n < N) & (offs_n % RA < limit)
                a = tl.load(a_base + offs_n[:, None] * stride_an + offs_k[None, :],
                            mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            contrib = tl.sum(a.to(tl.float32) * xf[None, :], axis=1) * scale
            out_n = (offs_n // RA) * R + offs_n % RA  # offs_n unless A is a fully sharded rank's R / TP rows
            tl.atomic_add(h_ptr + t * stride_hm + out_n, contrib, mask=n_mask)


def _launch(producer, x, delta, weight, eps, out, res, lora_a, h, meta: LoRAMeta, launch_count, scale, rank, slices,
            k, pdl):
    tokens = out.shape[0]
    n = lora_a.shape[1]
    for name, t in (("A", lora_a), ("h", h)):
        if t.stride(-1) != 1:
            raise ValueError(f"the producer shrink needs {name}'s last axis contiguous (stride {t.stride(-1)})")
    ranked = meta.slot_rank is not None
    row = next_pow2(k) if producer == NORM else 0
    block_n = min(next_pow2(n), max(16, pow2_floor((PRELOAD_ELEMENTS - row) // CHUNK)))
    pdl = pdl and pdl_enabled(out.device)
    _producer_shrink_kernel[(tokens, cdiv(k, CHUNK))](
        x, delta if delta is not None else x, weight if weight is not None else x, res if res is not None else out, out,
        lora_a, h, meta.token_slot, meta.active_slots, meta.slot_rank if ranked else meta.active_slots,
        k, n, n // slices, rank, max(0, launch_count), eps, scale,
        lora_a.stride(0), lora_a.stride(1), h.stride(0),
        PRODUCER=producer, HAS_DELTA=delta is not None, ROW=next_pow2(k), CHUNK=CHUNK, BLOCK_N=block_n,
        LAUNCH_PAD=next_pow2(max(1, launch_count)), USE_PDL=pdl, RANKED=ranked, num_warps=4,
        **pdl_launch(pdl),
    )


def add_rmsnorm_shrink(x, delta, weight, eps, lora_a, h, meta: LoRAMeta, launch_count, scale, rank, slices, pdl=False):
    """``base_ops.add_rmsnorm(x, delta, weight, eps)`` -> (normed, x + delta), and h += scale ·
    normed·A[slot]ᵀ for the tokens of the first ``launch_count`` active slots. x, delta [T, K]
    contiguous; lora_a [L, slices · rows, K]; h float32 [T, >= slices · rank], zero on entry."""
    t, k = x.shape
    res = torch.empty_like(x) if delta is not None else x
    out = torch.empty_like(x)
    _launch(NORM, x, delta, weight, eps, out, res if delta is not None else None, lora_a, h, meta, launch_count, scale,
            rank, slices, k, pdl)
    return out, res


def silu_mul_shrink(gate_up, lora_a, h, meta: LoRAMeta, launch_count, scale, rank, pdl=False):
    """``base_ops.silu_mul(gate_up)`` -> act [T, I], and h += scale · act·A[slot]ᵀ (one slice) for
    the tokens of the first ``launch_count`` active slots. gate_up [T, 2·I] contiguous."""
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=gate_up.dtype, device=gate_up.device)
    _launch(SILU_MUL, gate_up, None, None, 0.0, out, None, lora_a, h, meta, launch_count, scale, rank, 1, two_i // 2,
            pdl)
    return out
