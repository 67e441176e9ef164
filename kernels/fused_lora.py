"""Fused Triton LoRA: shrink and expand in one launch per LoRA linear, all its slices at once.

A program owns (a tile of one active slot's tokens, one slice, one output tile of that slice,
one of ``SPLIT_K`` parts of the input features) and computes its part of the rank-R
intermediate in fp32 registers:

    h_j[BLOCK_M, R] = scale · x[rows, K_j] @ A[slot][slice s][:, K_j]ᵀ
    y[rows, tile] += (Σ_j h_j) @ B[slot][slice s][tile]ᵀ

With ``SPLIT_K`` = 1, h_0 is all of h and the program expands it itself. Split, the tile's
programs add their h_j into the tile's fp32 sum in a workspace (relaxed fp32 atomics) and count
themselves in on its arrival count (an acq_rel atomic); the last to arrive reads the sum, sets
sum and count back to zero (so the next launch or graph replay needs no memset), and expands.
Either way y is read and rounded once, and h enters the expand with about 16 bits
(``tiles.expand_tile``): in bf16 the kernel is at least as accurate as the shrink + expand pair, which
rounds h to bf16. (Expanding each part and adding it into y with atomics in y's dtype, as this
kernel once did, rounded y ``SPLIT_K`` times: about 4x the pair's worst bf16 error at large K on
an H200.) The fp32 sum's order varies, so replays agree to fp32 rounding, not bit for bit.

The workspace is the kernel's own (``_workspace``: per device, zeroed when allocated, grown only
outside graph capture, left zero by every launch): a row of BLOCK_R floats per (token, slice,
output tile) for the sums and an int32 count per (first token of a tile, slice, output tile).
That is more than the model's per-linear ``scratch`` ([max tokens, 3·rank] floats), which this
kernel does not use. Launches on a device must not overlap; lorabench's run on one stream.

Why not one program per output tile that reduces all of K itself? It streams its slot's whole A
slice before it can expand (tens of dependent loads): measured on an H200 that design took 9 µs
per launch at K = 4096 and 18 µs at 11008. The price here is that each A part is read once per
output tile and each B tile once per K part (from L2), plus the split's two round trips below;
``lorabench tune`` picks the balance per shape.

The grid is ``(m tiles · K parts · output tiles, slices, launch count)``; as in the unfused
kernels, program ``i`` on the last axis serves ``active_slots[i]`` and exits at once when that
entry is -1 or its tile holds none of that slot's tokens. Base-model tokens are masked out.

A decode launch is a chain of dependent memory round trips, so the chain is kept short: the slot
and the token tile (batch order, ``adapter_tile``) load together; then x, the A part and the B
tile load together (B is issued before the K loop). Split, a tile's last program adds two: the
count (its y tile loads meanwhile), then the sum. On sm90+ the kernel is launched with PDL (see
``launch``): it starts while the base GEMM before it finishes and waits before it writes
anything (sums, counts, y); it lets its consumer launch at once.

Measured on an H200 (BENCHMARKS.md, with the earlier atomics into y) the shrink + expand pair
with PDL beat it at every point, one adapter included: what this kernel pays is the A re-reads
and the split-K reduction, not launch latency.
"""

from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from .launch import INTERPRET, cdiv, dot_width, next_pow2, pdl_enabled, pdl_launch, pdl_wait, upcast  # noqa: F401 (pdl_enabled: the worker's pdl column)
from .meta import LoRAMeta
from .moe_lora import moe_lora_apply, moe_path  # noqa: F401 (expert LoRA: lorabench's kernels, its path rule)
from .tiles import expand_tile, own_rank, slice_bounds, slice_ends, slot_tile, token_grid

NEEDS_ZEROED_SCRATCH = False
LETS_CONSUMER_LAUNCH = True  # see triton_lora


@triton.jit
def _fused_kernel(
    x_ptr,  # [T, K] input activations
    a_ptr,  # [L, S·R, K] stacked A weights
    b_ptr,  # [L, N, R] stacked B weights
    y_ptr,  # [T, N] output, updated in place
    sum_ptr,  # [T·S·output tiles·BLOCK_R] float32: h per (token, slice, output tile); zero, left zero
    count_ptr,  # [T·S·output tiles] int32 arrivals per (tile's first token, slice, output tile); zero, left zero
    token_slot_ptr,  # [T] slot of every token, -1 for base-model tokens
    sorted_ptr,  # [T] adapter-token indices grouped by active slot
    active_ptr,  # [>= launch count] active slot ids, -1 past the batch's active count
    start_ptr,  # [launch count + 1] offsets of each active slot's tokens in sorted_ptr
    rank_ptr,  # [max_loras] each slot's own rank (RANKED only)
    T,  # tokens in the batch
    LAUNCH,  # launch count (PACKED: whose tiles the grid walks)
    K,  # input features
    R,  # rank
    n1, n2, n3,  # slice boundaries: slice s covers [n_s, n_{s+1}) with n0 = 0
    stride_xm, stride_xk,  # x's strides
    stride_al, stride_an, stride_ak,  # lora_a's strides
    stride_bl, stride_bn, stride_br,  # lora_b's strides
    stride_ym, stride_yn,  # y's strides
    scale,  # LoRA scaling, applied to the intermediate
    BLOCK_M: tl.constexpr,  # tokens per tile (>= 16, tl.dot's minimum)
    BLOCK_N: tl.constexpr,  # output columns per tile
    BLOCK_K: tl.constexpr,  # reduction step of the shrink
    BLOCK_R: tl.constexpr,  # >= R, at least 16
    SPLIT_K: tl.constexpr,  # K parts: programs per output tile, each over a strided part of K
    SORTED: tl.constexpr,  # token tiles from the slot-sorted order (see adapter_tile)
    PACKED: tl.constexpr,  # SORTED over the launched slots' tiles laid end to end (see packed_tile), one grid column
    LAUNCH_PAD: tl.constexpr,  # PACKED: the launch count's next power of two
    USE_PDL: tl.constexpr,  # PDL-launched: wait for the GEMM before writing anything
    UPCAST: tl.constexpr,  # dots in fp32 (interpreter + bf16 only)
    RANKED: tl.constexpr,  # read only each slot's own rank of A and B (the rest is padding)
):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    lora_idx = tl.program_id(2)
    n_lo, n_hi, max_slice = slice_bounds(s, n1, n2, n3)
    num_n = tl.cdiv(max_slice, BLOCK_N)
    pid_sk = pid % SPLIT_K
    pid_n = (pid // SPLIT_K) % num_n
    pid_m = (pid // SPLIT_K) // num_n
    slot, rows, m_mask, idle = slot_tile(pid_m, lora_idx, LAUNCH, T, token_slot_ptr, sorted_ptr, active_ptr, start_ptr,
                                         BLOCK_M, SORTED, PACKED, LAUNCH_PAD, USE_PDL)
    if idle | (pid_n * BLOCK_N >= n_hi - n_lo):
        pdl_wait(USE_PDL)
        return

    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < (own_rank(rank_ptr, slot, R) if RANKED else R)
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

    pdl_wait(USE_PDL)
    mask = m_mask[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn
    y = tl.load(y_ptrs, mask=mask, other=0.0)  # in flight during the count below (only the last writes y)
    if SPLIT_K > 1:
        # Add this part into the tile's fp32 h and count it in; the tile's last program to arrive
        # takes the sum and goes on alone, leaving the sum and the count zero again.
        sums = sum_ptr + ((rows * tl.num_programs(1) + s) * num_n + pid_n)[:, None] * BLOCK_R + offs_r[None, :]
        hr_mask = m_mask[:, None] & r_mask[None, :]
        tl.atomic_add(sums, h, mask=hr_mask, sem="relaxed", scope="gpu")
        tl.debug_barrier()  # all of this program's adds are made before its arrival is counted
        first = tl.min(tl.where(m_mask, rows, T), axis=0)  # the tile's first token names its count
        count = count_ptr + (first * tl.num_programs(1) + s) * num_n + pid_n
        if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") < SPLIT_K - 1:
            return
        h = tl.load(sums, mask=hr_mask, other=0.0, cache_modifier=".cg")
        tl.store(sums, tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32), mask=hr_mask)
        tl.store(count, 0)  # both left zero for the next launch: a graph replay needs no memset

    # expand onto this program's output tile: y is rounded once
    delta = expand_tile(h, b, UPCAST)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


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


A_TILE = 16384  # elements of an A tile (BLOCK_K x BLOCK_R) and, twice that, of a B tile: 32 and 64 KiB in 16 bits


def default_config(tokens: int, k: int, widest: int, rank: int, slices: int, launch: int) -> FusedConfig:
    """Untuned: one token tile for decode batches; K in parts of about 1024 features (at most
    16), so each program makes a few loads before its expand. Above rank 64 the K step and the
    output tile shrink so that the A and B tiles stay within ``A_TILE`` and twice that, and 8
    warps hold them. The whole rank-R intermediate stays in each program, so above rank 64 the
    kernel spills registers (about 1.3 KB per thread at rank 512 on sm_90): the shrink + expand
    pair, whose expand loops over the rank, is the one to use at large ranks."""
    block_m = 16 if tokens <= 16 else 32 if tokens <= 32 else 64
    block_r = dot_width(rank)
    block_k = min(256 if block_m <= 32 else 64, A_TILE // block_r)
    block_n = min(128, 2 * A_TILE // block_r)
    split_k = 1 if tokens > 64 else max(1, min(16, next_pow2(k // 1024)))
    return FusedConfig(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k,
                       num_warps=4 if block_r <= 64 else 8)


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


# The kernel's workspace: a float32 sums buffer and an int32 counts buffer per device, shared by
# every launch there (lorabench runs its launches one after another on one stream, and a
# PDL-launched kernel writes nothing before its predecessor has finished). Every launch leaves
# them zero, so a buffer that served a graph's capture serves it at every replay. A buffer only
# grows, never during a capture; an outgrown one stays alive for the graphs that use it.
_WORKSPACE: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}


def _workspace(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The device's zeroed workspace buffer of ``dtype`` with at least ``numel`` elements."""
    bufs = _WORKSPACE.setdefault((str(device), dtype), [])
    if not bufs or bufs[-1].numel() < numel:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fused_lora: a launch larger than any before it is being captured; "
                               "run it once outside the capture first (that allocates its workspace)")
        bufs.append(torch.zeros(next_pow2(numel), dtype=dtype, device=device))
    return bufs[-1]


def lora_apply(y, x, lora_a, lora_b, slice_starts, meta: LoRAMeta, launch_count, scale, scratch=None, config=None):
    """y[t, slice s] += scale · (x[t] @ A[slot]ᵀ)[s·R:(s+1)·R] @ B[slot][slice s]ᵀ, in place, for
    adapter tokens of the first ``launch_count`` active slots; one launch. ``scratch`` is unused:
    split over K, the kernel uses its own workspace (``_workspace``), larger than that buffer."""
    del scratch
    if launch_count <= 0:
        return
    num_slices = len(slice_starts) - 1
    bounds, widest = slice_ends(slice_starts, "fused")
    tokens, k = x.shape
    rank = lora_b.shape[2]
    if lora_a.shape[1] != num_slices * rank:
        raise ValueError("fully sharded LoRA needs an all-gather between the shrink and the expand; "
                         "the fused kernel has none (use the triton kernels)")
    cfg = config or config_for(tokens, k, widest, rank, num_slices, launch_count)
    n_tiles = cdiv(widest, cfg.block_n)
    split = cfg.split_k > 1
    block_r = dot_width(rank)
    sums = _workspace(y.device, torch.float32, tokens * num_slices * n_tiles * block_r if split else 1)
    counts = _workspace(y.device, torch.int32, tokens * num_slices * n_tiles if split else 1)
    tg = token_grid(tokens, cfg.block_m, launch_count)
    grid = (tg.tiles * cfg.split_k * n_tiles, num_slices, tg.columns)
    pdl = pdl_enabled(y.device)
    _fused_kernel[grid](
        x, lora_a, lora_b, y, sums, counts, *meta.tile_args(), tokens, launch_count, k, rank, *bounds,
        x.stride(0), x.stride(1),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        y.stride(0), y.stride(1),
        scale,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_R=block_r, SPLIT_K=cfg.split_k,
        **tg.flags(), USE_PDL=pdl,
        UPCAST=upcast(y.dtype),  # bf16 dots upcast in the interpreter (see launch.INTERPRET)
        RANKED=meta.slot_rank is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(pdl),
    )
