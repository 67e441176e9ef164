"""Fused Triton LoRA: shrink and expand in one launch per LoRA linear, all its slices at once.

A program owns (a tile of one active slot's tokens, one slice, one output tile of that slice,
one of ``SPLIT_K`` parts of the input features). It computes its part of the rank-R
intermediate and expands that part straight onto its output tile:

    h_j[BLOCK_M, R] = scale · x[rows, K_j] @ A[slot][slice s][:, K_j]ᵀ     (kept in registers)
    y[rows, tile] += h_j @ B[slot][slice s][tile]ᵀ                          (fp atomics when split)

which sums to the LoRA update because the expand is linear in h. With ``SPLIT_K`` > 1 each part
is rounded to y's dtype before its atomic add, in no fixed order: replays agree to within that
rounding, not bit for bit (the check's tolerance is far wider). There is no scratch buffer,
no memset and no second launch, and every program's chain is short: one pass over its K part,
one B tile, one update. Why not one program per output tile that reduces all of K itself? It
streams its slot's whole A slice before it can expand (tens of dependent loads): measured on an
H200 that design took 9 µs per launch at K = 4096 and 18 µs at 11008. The price here is that
each A part is read once per output tile and each B tile once per K part (from L2), and
``SPLIT_K`` atomic adds per output element; ``lorabench tune`` picks the balance per shape.

The grid is ``(m tiles · K parts · output tiles, slices, launch count)``; as in the unfused
kernels, program ``i`` on the last axis serves ``active_slots[i]`` and exits at once when that
entry is -1 or its tile holds none of that slot's tokens. Base-model tokens are masked out.

A decode launch is a chain of dependent memory round trips, so the chain is kept to two: the
slot and the token tile (batch order, ``adapter_tile``) load together; then x, the A part and the
B tile load together (B is issued before the K loop). On sm90+ the kernel is launched with PDL
(see ``triton_lora``): it starts while the base GEMM before it finishes and waits only before it
updates y, the GEMM's output; it lets its consumer launch at once.

Measured on an H200 (BENCHMARKS.md) the shrink + expand pair with PDL beats it at every
point, one adapter included: what this kernel pays is the A re-reads and the atomics, not latency.
"""

from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from . import MAX_SLICES
from .meta import LoRAMeta
from .triton_lora import (  # noqa: F401 (pdl_enabled: the worker's pdl column)
    INTERPRET,
    adapter_tile,
    pdl_enabled,
    pdl_launch,
    pdl_wait,
    slice_bounds,
    sorted_tiles,
)

NEEDS_ZEROED_SCRATCH = False
LETS_CONSUMER_LAUNCH = True  # see triton_lora


@triton.jit
def _fused_kernel(
    x_ptr,  # [T, K] input activations
    a_ptr,  # [L, S·R, K] stacked A weights
    b_ptr,  # [L, N, R] stacked B weights
    y_ptr,  # [T, N] output, updated in place
    token_slot_ptr,  # [T] slot of every token, -1 for base-model tokens
    sorted_ptr,  # [T] adapter-token indices grouped by active slot
    active_ptr,  # [>= launch count] active slot ids, -1 past the batch's active count
    start_ptr,  # [launch count + 1] offsets of each active slot's tokens in sorted_ptr
    T,  # tokens in the batch
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
    SPLIT_K: tl.constexpr,  # K parts: programs per output tile, each over a strided part of K
    SORTED: tl.constexpr,  # token tiles from the slot-sorted order (see adapter_tile)
    USE_PDL: tl.constexpr,  # PDL-launched: wait for the GEMM before updating y
    UPCAST: tl.constexpr,  # dots in fp32 (interpreter + bf16 only)
):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    lora_idx = tl.program_id(2)
    n_lo, n_hi, max_slice = slice_bounds(s, n1, n2, n3)
    num_n = tl.cdiv(max_slice, BLOCK_N)
    pid_sk = pid % SPLIT_K
    pid_n = (pid // SPLIT_K) % num_n
    pid_m = (pid // SPLIT_K) // num_n
    slot, rows, m_mask, idle = adapter_tile(pid_m, lora_idx, T, token_slot_ptr, sorted_ptr, active_ptr, start_ptr,
                                            BLOCK_M, SORTED, USE_PDL)
    if idle | (pid_n * BLOCK_N >= n_hi - n_lo):
        pdl_wait(USE_PDL)
        return

    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    slot64 = slot.to(tl.int64)
    offs_n = n_lo + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_hi
    # B first: it needs only the slot, so it loads alongside the shrink's first tiles
    b = tl.load(b_ptr + slot64 * stride_bl + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                mask=r_mask[:, None] & n_mask[None, :], other=0.0)

    # shrink, this program's part of K: h = x[rows, K_j] @ A[slot][s·R : s·R + R, K_j]ᵀ
    a_base = a_ptr + slot64 * stride_al + (s * R + offs_r)[None, :] * stride_an
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(pid_sk * BLOCK_K, K, SPLIT_K * BLOCK_K):
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

    # expand that part onto this program's output tile
    if UPCAST:
        delta = tl.dot(h, b.to(tl.float32))
    else:
        delta = tl.dot(h.to(b.dtype), b)  # as the unfused expand rounds its fp32 input
    mask = m_mask[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn
    pdl_wait(USE_PDL)
    if SPLIT_K == 1:
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, delta.to(y_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class FusedConfig:
    """The fused kernel's tunables (``lorabench tune`` searches them)."""

    block_m: int = 16
    block_n: int = 128
    block_k: int = 256
    split_k: int = 4
    num_warps: int = 4
    num_stages: int = 2


SEARCH_SPACE = {  # what `lorabench tune` tries for this kernel
    "block_m": [16, 32, 64],
    "block_n": [64, 128, 256],
    "block_k": [64, 128, 256, 512],
    "split_k": [1, 2, 4, 8, 16],
    "num_warps": [2, 4, 8],
    "num_stages": [1, 2, 3],
}

# Tuned configs, keyed by shape: filled by ``load_tuned`` (sweeps given ``--tuned DIR``).
TUNED_CONFIGS: dict[tuple, FusedConfig] = {}


def shape_key(tokens: int, k: int, widest: int, rank: int, slices: int, launch: int) -> tuple:
    """What a tuned config is chosen by: (token bucket, K, widest slice, rank, slices, launch count)."""
    return (tokens, k, widest, rank, slices, launch)


def default_config(tokens: int, k: int, widest: int, rank: int, slices: int, launch: int) -> FusedConfig:
    """Untuned: one token tile for decode batches; K in parts of about 1024 features (at most
    16), so each program makes a few loads before its expand."""
    block_m = 16 if tokens <= 16 else 32 if tokens <= 32 else 64
    block_k = 256 if block_m <= 32 else 64
    split_k = 1 if tokens > 64 else max(1, min(16, triton.next_power_of_2(k // 1024)))
    return FusedConfig(block_m=block_m, block_k=block_k, split_k=split_k)


def config_for(tokens: int, k: int, widest: int, rank: int, slices: int, launch: int) -> FusedConfig:
    """The tuned config of the nearest tuned shape with the same K, width, rank and slices
    (nearest token bucket, then nearest launch count; ties go to the larger), else the default.
    The key is the launch count, not the active count: a graph's config is fixed at capture, so
    an agnostic graph of grid 8 runs the config tuned for 8 launched slots whatever n is."""
    same = [key for key in TUNED_CONFIGS if key[1:5] == (k, widest, rank, slices)]
    if not same:
        return default_config(tokens, k, widest, rank, slices, launch)
    best = min(same, key=lambda key: (abs(key[0] - tokens), -key[0], abs(key[5] - launch), -key[5]))  # ties: the larger
    return TUNED_CONFIGS[best]


def load_tuned(entries: list[dict]) -> None:
    """Install tuned entries (``{"shape": [...], "config": {...}}``, as ``lorabench tune`` writes)."""
    TUNED_CONFIGS.clear()
    for e in entries:
        if e.get("kernel", "fused") == "fused":
            TUNED_CONFIGS[tuple(e["shape"])] = FusedConfig(**e["config"])


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
    grid = (triton.cdiv(tokens, cfg.block_m) * cfg.split_k * triton.cdiv(widest, cfg.block_n), num_slices, launch_count)
    pdl = pdl_enabled(y.device)
    _fused_kernel[grid](
        x, lora_a, lora_b, y, meta.token_slot, meta.sorted_tokens, meta.active_slots, meta.slot_start, tokens,
        k, rank, *bounds,
        x.stride(0), x.stride(1),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        y.stride(0), y.stride(1),
        scale,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_R=max(16, triton.next_power_of_2(rank)), SPLIT_K=cfg.split_k,
        SORTED=sorted_tiles(tokens, cfg.block_m), USE_PDL=pdl,
        UPCAST=INTERPRET and y.dtype == torch.bfloat16,  # bf16 dots upcast in the interpreter (see triton_lora)
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(pdl),
    )
