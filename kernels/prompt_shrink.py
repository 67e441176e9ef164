"""The shrink fused into SiLU·mul at prompt sizes: one launch for ``silu_mul`` and ``h = scale ·
act·A[slot]ᵀ``, so down's shrink never reads its input back (Llama-3.1-8B at 2048 tokens: 58 MB a
layer).

``producer_shrink`` does this at decode sizes, a program per token, reading A once per token. A
prompt step has thousands of tokens: here a program owns a tile of ``block_t`` consecutive tokens
(a prompt's tokens share a slot) and one of ``parts`` parts of K, walked in ``chunk``-wide steps.
Each step computes act's chunk as ``silu_mul`` does, stores it, and adds ``tl.dot(act chunk, A[slot]
chunkᵀ)`` for each launch place from the tile's lowest to its highest (rows of other places masked
to zero): a tile of one prompt makes one dot, a tile of decode tokens from many slots up to the
launch count. A is read once per tile and part, from L2. With more than one part the
programs add into h with fp32 atomics (h zero on entry, as the step's scratch is); the parts fill
the GPU at shorter steps. act is rounded to the model's dtype before the dot, as the separate
shrink reads it.

The norms keep the separate shrink: a norm needs its rows' sum of squares before it writes, so a
fused norm's program must own whole rows, and with 16-token tiles over 4096 features it measured
slower than the norm and the separate shrink together (BENCHMARKS.md, "Down's shrink inside
SiLU·mul at prompt sizes"). Used by the ``gemm`` backend for down where it runs as the extended GEMM.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import WAVE_PROGRAMS, cdiv, dot_width, next_pow2, upcast
from .meta import LoRAMeta
from .tiles import launch_positions, own_rank

# A's rows up to which SiLU·mul takes the shrink (rank 32; above, the separate shrink): at 64 rows, even in
# 128-wide chunks, the kernel spills registers on sm_90 (tests/compile_sm90.py)
MAX_ROWS = 32


@dataclass(frozen=True)
class PromptShrinkConfig:
    """block_t: tokens per program; chunk: K per step; parts: programs per token tile, over K."""

    block_t: int = 16
    chunk: int = 256
    parts: int = 1
    num_warps: int = 4
    num_stages: int = 2


def default_config(tokens: int, k: int) -> PromptShrinkConfig:
    """16-token tiles, 256-wide chunks, and as many parts as keep the grid within one wave of
    ``WAVE_PROGRAMS``, at most one per 1024 features. Measured at rank 16 on an H100: at 2048 tokens 4
    parts took 18.8 µs over SiLU·mul alone, 5 (a second, partial wave) 33.4 (BENCHMARKS.md)."""
    return PromptShrinkConfig(16, 256, max(1, min(WAVE_PROGRAMS // cdiv(tokens, 16), k // 1024)))


@triton.jit
def _silu_mul_shrink_kernel(
    gu_ptr,  # [T, 2K] gate | up, contiguous
    out_ptr,  # [T, K] out: act, rows stride_out apart (the extended GEMM's input)
    a_ptr,  # [L, N, K] stacked A (one slice: N = A's rows)
    h_ptr,  # [T, >= R] float32: h = scale · act·A[slot]ᵀ (+= when ATOMIC: zero on entry)
    token_slot_ptr,  # [T] slot of every token, -1 for base-model tokens
    active_ptr,  # [>= launch count] active slot ids, -1 past the active count
    rank_ptr,  # [max_loras] each slot's own rank (RANKED only)
    T,  # tokens
    K,  # act's features: down's input
    N,  # A's rows (the rank, or rank / TP when fully sharded)
    LAUNCH,  # launch count: the active slots served
    PART_K,  # K per part: a multiple of CHUNK
    scale,
    stride_out, stride_al, stride_an, stride_hm,
    BLOCK_T: tl.constexpr,  # tokens per program
    CHUNK: tl.constexpr,  # K per step
    BLOCK_N: tl.constexpr,  # >= N, at least 16
    LAUNCH_PAD: tl.constexpr,  # next power of two >= the launch count
    ATOMIC: tl.constexpr,  # more than one part: add into h
    RANKED: tl.constexpr,  # skip each slot's padding past its own rank
    UPCAST: tl.constexpr,  # dot in fp32 (interpreter + bf16 only)
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tokens < T
    rows = tokens.to(tl.int64)
    place = launch_positions(token_slot_ptr, tokens, t_mask, active_ptr, LAUNCH, LAUNCH_PAD)
    first = tl.min(tl.where(place >= 0, place, LAUNCH_PAD), axis=0)
    last = tl.max(place, axis=0)  # -1: no token of the tile served, no dot
    offs_n = tl.arange(0, BLOCK_N)
    k_lo = tl.program_id(1) * PART_K
    k_hi = tl.minimum(k_lo + PART_K, K)

    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, CHUNK):
        offs_k = k0 + tl.arange(0, CHUNK)
        k_mask = offs_k < K
        m = t_mask[:, None] & k_mask[None, :]
        g = tl.load(gu_ptr + rows[:, None] * (2 * K) + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + rows[:, None] * (2 * K) + K + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] * stride_out + offs_k[None, :], act, mask=m)
        for j in range(first, last + 1):  # the tile's lowest launch place to its highest (a prompt's tile: one)
            slot = tl.load(active_ptr + j)
            n_mask = offs_n < N
            if RANKED:
                n_mask = n_mask & (offs_n < own_rank(rank_ptr, slot, N))
            a = tl.load(a_ptr + slot.to(tl.int64) * stride_al + offs_n[None, :] * stride_an + offs_k[:, None],
                        mask=n_mask[None, :] & k_mask[:, None], other=0.0)
            aj = tl.where((place == j)[:, None], act, 0.0).to(out_ptr.dtype.element_ty)
            if UPCAST:
                acc += tl.dot(aj.to(tl.float32), a.to(tl.float32))
            else:
                acc += tl.dot(aj, a)

    dst = h_ptr + rows[:, None] * stride_hm + offs_n[None, :]
    h_mask = (place >= 0)[:, None] & (offs_n < N)[None, :]
    if ATOMIC:
        tl.atomic_add(dst, acc * scale, mask=h_mask)
    else:
        tl.store(dst, acc * scale, mask=h_mask)


def silu_mul_shrink(gate_up, lora_a, h, meta: LoRAMeta, launch_count, scale, rank, out=None,
                    config: PromptShrinkConfig | None = None):
    """``base_ops.silu_mul(gate_up, out=out)`` -> act [T, I], and h (+)= scale · act·A[slot]ᵀ (one
    slice) for the tokens of the first ``launch_count`` active slots (their rows of h only; zero on
    entry where K is split). gate_up [T, 2·I] contiguous; lora_a [L, rows, I] with rows <= rank
    (fewer: a fully sharded TP rank's); h float32 [T, >= rank]."""
    tokens, two_i = gate_up.shape
    k, n = two_i // 2, lora_a.shape[1]
    out = torch.empty(tokens, k, dtype=gate_up.dtype, device=gate_up.device) if out is None else out
    if n > MAX_ROWS or n > rank:
        raise ValueError(f"A of {n} rows for rank {rank}: SiLU·mul's shrink takes at most {MAX_ROWS}, one slice")
    for name, t in (("gate_up", gate_up), ("A", lora_a), ("h", h), ("the output", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"SiLU·mul's shrink needs {name}'s last axis contiguous")
    if h.shape[0] < tokens or h.shape[1] < rank or gate_up.stride(0) != two_i:
        raise ValueError(f"h {tuple(h.shape)} is smaller than [{tokens}, {rank}], or gate_up's rows are not contiguous")
    cfg = config or default_config(tokens, k)
    part_k = cdiv(cdiv(k, cfg.parts), cfg.chunk) * cfg.chunk
    parts = cdiv(k, part_k)
    ranked = meta.slot_rank is not None
    _silu_mul_shrink_kernel[(cdiv(tokens, cfg.block_t), parts)](
        gate_up, out, lora_a, h, meta.token_slot, meta.active_slots, meta.slot_rank if ranked else meta.active_slots,
        tokens, k, n, max(0, launch_count), part_k, scale,
        out.stride(0), lora_a.stride(0), lora_a.stride(1), h.stride(0),
        BLOCK_T=cfg.block_t, CHUNK=cfg.chunk, BLOCK_N=dot_width(n), LAUNCH_PAD=next_pow2(max(1, launch_count)),
        ATOMIC=parts > 1, RANKED=ranked, UPCAST=upcast(out.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
