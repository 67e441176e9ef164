"""Fused Triton LoRA: shrink and expand in one launch per LoRA linear, all its slices at once.

A program owns (a tile of one active slot's tokens, one slice, a group of ``N_TILES`` output
tiles of that slice). It computes the tile's rank-R intermediate itself,

    h[BLOCK_M, R] = scale · x[rows, :] @ A[slot][slice s]ᵀ            (fp32, kept in registers)

then, for each of its output tiles, ``y[rows, tile] += h @ B[slot][slice s][tile]ᵀ``. Every
output element has exactly one writer, so there are no atomics and no scratch buffer to zero,
and the intermediate never leaves the chip. The price is that each program re-reads its slot's
A slice (R·K values, mostly from L2): ``N_TILES`` trades that redundancy against parallelism,
and ``lorabench tune`` picks it per shape.

The grid is ``(m tiles · output-tile groups, slices, launch count)``; as in the unfused
kernels, program ``i`` on the last axis serves ``active_slots[i]`` and exits at once when that
entry is -1 or its tile lies past that slot's tokens. Base-model tokens are never read or
written.
"""

import os
from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from . import MAX_SLICES, LoRAMeta

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # bf16 dots upcast there (see triton_lora)

NEEDS_ZEROED_SCRATCH = False


@triton.jit
def _fused_kernel(
    x_ptr,  # [T, K] input activations
    a_ptr,  # [L, S·R, K] stacked A weights
    b_ptr,  # [L, N, R] stacked B weights
    y_ptr,  # [T, N] output, updated in place
    sorted_ptr,  # [T] adapter-token indices grouped by active slot
    active_ptr,  # [>= launch count] active slot ids, -1 past the batch's active count
    start_ptr,  # [launch count + 1] offsets of each active slot's tokens in sorted_ptr
    K,  # input features
    R,  # rank
    n1, n2, n3,  # slice boundaries: slice s covers [n_s, n_{s+1}) with n0 = 0
    stride_xm, stride_xk,
    stride_al, stride_an, stride_ak,
    stride_bl, stride_bn, stride_br,
    stride_ym, stride_yn,
    scale,  # LoRA scaling, applied to the intermediate
    BLOCK_M: tl.constexpr,  # tokens per tile (>= 16, tl.dot's minimum)
    BLOCK_N: tl.constexpr,  # output columns per tile
    BLOCK_K: tl.constexpr,  # reduction step of the shrink
    BLOCK_R: tl.constexpr,  # >= R, at least 16
    N_TILES: tl.constexpr,  # output tiles per program (each program recomputes h once)
    UPCAST: tl.constexpr,  # dots in fp32 (interpreter + bf16 only)
):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    lora_idx = tl.program_id(2)
    slot = tl.load(active_ptr + lora_idx)
    if slot < 0:
        return
    start = tl.load(start_ptr + lora_idx)
    count = tl.load(start_ptr + lora_idx + 1) - start
    n_lo = tl.where(s == 0, 0, tl.where(s == 1, n1, n2))
    n_hi = tl.where(s == 0, n1, tl.where(s == 1, n2, n3))
    max_slice = tl.maximum(n1, tl.maximum(n2 - n1, n3 - n2))
    num_groups = tl.cdiv(max_slice, BLOCK_N * N_TILES)
    pid_m = pid // num_groups
    pid_g = pid % num_groups
    if pid_m * BLOCK_M >= count:
        return
    if pid_g * BLOCK_N * N_TILES >= n_hi - n_lo:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    rows = tl.load(sorted_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    slot64 = slot.to(tl.int64)

    # shrink: h = x[rows] @ A[slot][s·R : s·R + R]ᵀ
    a_base = a_ptr + slot64 * stride_al + (s * R + offs_r)[None, :] * stride_an
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_base + offs_k[:, None] * stride_ak, mask=r_mask[None, :] & k_mask[:, None], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        h += tl.dot(x, a)
    h *= scale
    if not UPCAST:
        h = h.to(b_ptr.dtype.element_ty)  # as the unfused expand rounds its fp32 input

    # expand: y[rows, tile] += h @ B[slot][tile]ᵀ, for each of this program's output tiles
    b_base = b_ptr + slot64 * stride_bl + offs_r[:, None] * stride_br
    y_rows = y_ptr + rows[:, None] * stride_ym
    for t in range(N_TILES):
        offs_n = n_lo + (pid_g * N_TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_hi
        b = tl.load(b_base + offs_n[None, :] * stride_bn, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            b = b.to(tl.float32)
        delta = tl.dot(h, b)
        mask = m_mask[:, None] & n_mask[None, :]
        y_ptrs = y_rows + offs_n[None, :] * stride_yn
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class FusedConfig:
    """The fused kernel's tunables (``lorabench tune`` searches them)."""

    block_m: int = 16
    block_n: int = 128
    block_k: int = 256
    n_tiles: int = 4
    num_warps: int = 4
    num_stages: int = 3


SEARCH_SPACE = {  # what `lorabench tune` tries for this kernel
    "block_m": [16, 32, 64],
    "block_n": [32, 64, 128, 256],
    "block_k": [64, 128, 256, 512],
    "n_tiles": [1, 2, 4, 8, 16],
    "num_warps": [2, 4, 8],
    "num_stages": [2, 3, 4],
}

# Tuned configs, keyed by shape: filled by ``load_tuned`` (sweeps given ``--tuned DIR``).
TUNED: dict[tuple, FusedConfig] = {}


def shape_key(tokens: int, k: int, widest: int, rank: int, slices: int, launch: int) -> tuple:
    """What a tuned config is chosen by: (token bucket, K, widest slice, rank, slices, launch count)."""
    return (tokens, k, widest, rank, slices, launch)


def default_config(tokens: int, k: int, widest: int, rank: int, slices: int, launch: int) -> FusedConfig:
    """Untuned: one token tile for decode batches, long K steps (each program streams its slot's
    whole A slice, so fewer, larger loads in flight), groups of 4 × 128 output columns."""
    block_m = 16 if tokens <= 16 else 32 if tokens <= 32 else 64
    return FusedConfig(block_m=block_m, block_k=512 if block_m <= 16 else 256 if block_m <= 32 else 64)


def config_for(tokens: int, k: int, widest: int, rank: int, slices: int, launch: int) -> FusedConfig:
    """The tuned config of the nearest tuned shape with the same K, width, rank and slices
    (nearest token bucket, then nearest launch count), else the default."""
    same = [key for key in TUNED if key[1:5] == (k, widest, rank, slices)]
    if not same:
        return default_config(tokens, k, widest, rank, slices, launch)
    best = min(same, key=lambda key: (abs(key[0] - tokens), abs(key[5] - launch)))
    return TUNED[best]


def load_tuned(entries: list[dict]) -> None:
    """Install tuned entries (``{"shape": [...], "config": {...}}``, as ``lorabench tune`` writes)."""
    TUNED.clear()
    for e in entries:
        TUNED[tuple(e["shape"])] = FusedConfig(**e["config"])


def config_dict(cfg: FusedConfig) -> dict:
    return asdict(cfg)


def lora_apply(y, x, lora_a, lora_b, slice_starts, meta: LoRAMeta, launch_count, scale, scratch=None, config=None):
    """y[t, slice s] += scale · (x[t] @ A[slot]ᵀ)[s·R:(s+1)·R] @ B[slot][slice s]ᵀ, in place, for
    adapter tokens of the first ``launch_count`` active slots; one launch. ``scratch`` is unused."""
    del scratch
    if launch_count <= 0:
        return
    num_slices = len(slice_starts) - 1
    if not 1 <= num_slices <= MAX_SLICES:
        raise ValueError(f"{num_slices} slices; the fused kernel takes 1 to {MAX_SLICES}")
    bounds = list(slice_starts[1:]) + [slice_starts[-1]] * (MAX_SLICES - num_slices)
    widest = max(b - a for a, b in zip(slice_starts, slice_starts[1:]))
    tokens, k = x.shape
    rank = lora_b.shape[2]
    cfg = config or config_for(tokens, k, widest, rank, num_slices, launch_count)
    grid = (triton.cdiv(tokens, cfg.block_m) * triton.cdiv(widest, cfg.block_n * cfg.n_tiles), num_slices, launch_count)
    _fused_kernel[grid](
        x, lora_a, lora_b, y, meta.sorted_tokens, meta.active_slots, meta.slot_start,
        k, rank, *bounds,
        x.stride(0), x.stride(1),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        y.stride(0), y.stride(1),
        scale,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_R=max(16, triton.next_power_of_2(rank)), N_TILES=cfg.n_tiles,
        UPCAST=_INTERPRET and y.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
