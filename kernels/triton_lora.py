"""Triton LoRA shrink and expand, grouped by adapter slot, grid sized by the launch count.

Both kernels launch a grid whose last axis is the *launch count*: program ``i`` on that axis
serves ``active_slots[i]`` and exits at once when that entry is -1 (fewer adapters active than
launched) or when its tile holds none of that adapter's tokens. Base-model tokens are masked
out, so they are never read or written.

shrink: scratch[t, :] (+)= scale · x[t] @ A[slot]ᵀ      split over K; fp32 atomics when split
expand: y[t, slice s] += scratch[t, s·R:(s+1)·R] @ B[slot][slice s]ᵀ

Decode kernels are latency-bound: a launch is a chain of dependent memory round trips, so the
kernels keep that chain short (``adapter_tile``) and, on sm90+, launch with programmatic dependent
launch (PDL, ``pdl_enabled``): a kernel starts while its predecessor finishes, loads its weights,
and waits (``gdc_wait``) only before it touches what the predecessor writes. The shrink lets the
expand launch at once; the expand's B tile is then loaded while the shrink still runs. The
expand in turn lets its consumer (a base op, PDL-launched, that waits before anything) launch.
"""

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import MAX_SLICES
from .meta import LoRAMeta

# Triton's CPU interpreter returns garbage from tl.dot on bf16 operands (exact on fp16 and fp32),
# so under the interpreter bf16 tiles are upcast to fp32 before the dot. GPU code is unaffected.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# The shrink splits K with fp32 atomics, so its output buffer must start at zero.
NEEDS_ZEROED_SCRATCH = True
# The expand lets its dependents launch at once, so the model PDL-launches the base op after it.
# Contract: the kernel after a LoRA kernel must wait (gdc_wait) before it reads anything; the
# shrink and the fused kernel read x before they wait, so x must not be written by a kernel that
# lets its dependents launch early (e.g. no lora_apply whose x is the previous lora_apply's y).
LETS_CONSUMER_LAUNCH = True


@functools.cache
def _sm90_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether lorabench's Triton kernels launch with programmatic dependent launch on ``device``:
    CUDA sm90 or newer, not the interpreter, and not switched off with ``LORABENCH_PDL=0``."""
    if INTERPRET or device.type != "cuda" or os.environ.get("LORABENCH_PDL", "1") == "0":
        return False
    return _sm90_or_newer(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(use: bool) -> dict:
    """Launch options for a kernel that takes ``USE_PDL``: ``launch_pdl`` only when used (the
    interpreter and older Triton launchers do not know it)."""
    return {"launch_pdl": True} if use else {}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the kernel this one was PDL-launched after has finished and its writes are
    visible. Every program of a PDL-launched kernel calls it before it writes and before it
    exits, so a grid's completion still implies its predecessors' (stream order stays transitive)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def adapter_tile(pid_m, lora_idx, tokens, token_slot_ptr, sorted_ptr, active_ptr, start_ptr,
                 BLOCK_M: tl.constexpr, SORTED: tl.constexpr, USE_PDL: tl.constexpr):
    """What program (pid_m, adapter lora_idx) serves: its slot (``active_ptr[lora_idx]``), the rows
    (int64) and mask of its token tile ``pid_m``, and whether it is idle (slot -1, or none of the
    slot's tokens in the tile). Under PDL it also lets the next kernel launch now, so every caller
    must ``pdl_wait`` before it writes and before it exits.

    SORTED: the tile is entries [pid_m·BLOCK_M, +BLOCK_M) of the slot's range of ``sorted_ptr``,
    which takes two dependent loads after the slot's (the range, then the rows). Otherwise the tile
    is tokens [pid_m·BLOCK_M, +BLOCK_M) in batch order with the mask ``token_slot == slot``: one load,
    issued alongside the slot's. Launchers use it when one tile holds the whole batch (decode),
    where it saves a round trip; for many tiles every adapter would scan them all."""
    slot = tl.load(active_ptr + lora_idx)
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if SORTED:
        start = tl.load(start_ptr + lora_idx)
        count = tl.load(start_ptr + lora_idx + 1) - start
        mask = offs < count
        rows = tl.load(sorted_ptr + start + offs, mask=mask, other=0)
    else:  # padding and base tokens are -1, as is an unused slot: `idle` keeps those apart
        mask = tl.load(token_slot_ptr + offs, mask=offs < tokens, other=-1) == slot
        rows = offs
    if USE_PDL:  # the next kernel (the expand, or the base op that consumes y) may launch now
        tl.extra.cuda.gdc_launch_dependents()
    idle = (slot < 0) | (tl.max(mask.to(tl.int32), axis=0) == 0)
    return slot, rows.to(tl.int64), mask, idle


def sorted_tiles(tokens: int, block_m: int) -> bool:
    """Whether a launch needs the slot-sorted token tiles (more than one tile of tokens)."""
    return tokens > block_m


@triton.jit
def _shrink_kernel(
    x_ptr,  # [T, K] input activations
    a_ptr,  # [L, N, K] stacked A weights, N = slices · rank
    out_ptr,  # [T, N] float32 scratch; must be zero when SPLIT_K > 1
    token_slot_ptr,  # [T] slot of every token, -1 for base-model tokens
    sorted_ptr,  # [T] adapter-token indices grouped by active slot
    active_ptr,  # [>= launch count] active slot ids, -1 past the batch's active count
    start_ptr,  # [launch count + 1] offsets of each active slot's tokens in sorted_ptr
    rank_ptr,  # [max_loras] each slot's own rank (RANKED only)
    T,  # tokens in the batch
    K,  # input features
    N,  # slices · rank
    RA,  # A's rows per slice: the rank R (every adapter padded to it), or R / TP under fully sharded LoRA
    R,  # h's columns per slice: the rank R (A's row n goes to column (n // RA)·R + n % RA)
    stride_xm, stride_xk,
    stride_al, stride_an, stride_ak,
    stride_om, stride_on,
    scale,  # LoRA scaling, folded into the shrink
    BLOCK_M: tl.constexpr,  # tokens per tile
    BLOCK_N: tl.constexpr,  # rank columns per tile
    BLOCK_K: tl.constexpr,  # reduction step
    SPLIT_K: tl.constexpr,  # programs sharing one output tile, each over a strided part of K
    SORTED: tl.constexpr,  # token tiles from the slot-sorted order (see adapter_tile)
    USE_PDL: tl.constexpr,  # PDL-launched: let the expand launch now, wait before writing
    UPCAST: tl.constexpr,  # dot in fp32 (interpreter + bf16 only)
    RANKED: tl.constexpr,  # skip each slot's padding: only its own rank's columns of every slice
):
    pid = tl.program_id(0)
    lora_idx = tl.program_id(2)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_sk = pid % SPLIT_K
    pid_m = (pid // SPLIT_K) // num_n
    pid_n = (pid // SPLIT_K) % num_n
    slot, rows, m_mask, idle = adapter_tile(pid_m, lora_idx, T, token_slot_ptr, sorted_ptr, active_ptr, start_ptr,
                                            BLOCK_M, SORTED, USE_PDL)
    if idle:
        pdl_wait(USE_PDL)
        return

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if RANKED:  # a tile wholly in the padding is not computed; its h stays zero
        n_mask = n_mask & (offs_n % RA < own_rank(rank_ptr, slot, RA))
        if tl.max(n_mask.to(tl.int32), axis=0) == 0:
            pdl_wait(USE_PDL)
            return
    a_base = a_ptr + slot.to(tl.int64) * stride_al

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_sk * BLOCK_K, K, SPLIT_K * BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        a = tl.load(
            a_base + offs_n[None, :] * stride_an + offs_k[:, None] * stride_ak,
            mask=n_mask[None, :] & k_mask[:, None],
            other=0.0,
        )
        if UPCAST:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(x, a)
    acc *= scale

    pdl_wait(USE_PDL)
    out_n = (offs_n // RA) * R + offs_n % RA  # offs_n itself unless A is a fully sharded rank's R / TP
    out = out_ptr + rows[:, None] * stride_om + out_n[None, :] * stride_on
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc, mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


@triton.jit
def own_rank(rank_ptr, slot, R):
    """A slot's own rank rounded up to a multiple of 16, at most R: what the ``RANKED`` kernels
    compute of it. The padding they then read is zero; a bound that is a multiple of 16 keeps
    their rank-wise loads vectorised (an arbitrary runtime bound makes them one element each)."""
    return tl.minimum((tl.load(rank_ptr + slot) + 15) // 16 * 16, R)


@triton.jit
def slice_bounds(s, n1, n2, n3):
    """Slice ``s``'s output columns [n_lo, n_hi) and the widest slice, from the boundaries n1..n3."""
    n_lo = tl.where(s == 0, 0, tl.where(s == 1, n1, n2))
    n_hi = tl.where(s == 0, n1, tl.where(s == 1, n2, n3))
    return n_lo, n_hi, tl.maximum(n1, tl.maximum(n2 - n1, n3 - n2))


@triton.jit
def _expand_kernel(
    h_ptr,  # [T, S·R] float32 shrink output
    b_ptr,  # [L, N, R] stacked B weights
    y_ptr,  # [T, N] output, updated in place
    token_slot_ptr, sorted_ptr, active_ptr, start_ptr, rank_ptr, T,  # as in the shrink
    R,  # rank
    n1, n2, n3,  # slice boundaries: slice s covers [n_s, n_{s+1}) with n0 = 0
    stride_hm, stride_hn,
    stride_bl, stride_bn, stride_br,
    stride_ym, stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rank step: >= R up to 64, at least 16 (tl.dot's minimum)
    R_STEPS: tl.constexpr,  # ceil(R / BLOCK_R): 1 up to rank 64 (then no loop is compiled)
    SORTED: tl.constexpr,  # token tiles from the slot-sorted order (see adapter_tile)
    USE_PDL: tl.constexpr,  # PDL-launched after the shrink: load B, then wait for h
    UPCAST: tl.constexpr,
    RANKED: tl.constexpr,  # read only each slot's own rank of B and h (the rest is padding)
):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    lora_idx = tl.program_id(2)
    n_lo, n_hi, max_slice = slice_bounds(s, n1, n2, n3)
    num_n = tl.cdiv(max_slice, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    slot, rows, m_mask, idle = adapter_tile(pid_m, lora_idx, T, token_slot_ptr, sorted_ptr, active_ptr, start_ptr,
                                            BLOCK_M, SORTED, USE_PDL)
    if idle | (pid_n * BLOCK_N >= n_hi - n_lo):
        pdl_wait(USE_PDL)
        return

    offs_n = n_lo + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_hi
    b_base = b_ptr + slot.to(tl.int64) * stride_bl + offs_n[None, :] * stride_bn
    h_base = h_ptr + rows[:, None] * stride_hm
    own = own_rank(rank_ptr, slot, R) if RANKED else R
    # The first rank step (all of it up to rank 64): B loaded while the shrink finishes, h after it.
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < own
    b = tl.load(b_base + offs_r[:, None] * stride_br, mask=n_mask[None, :] & r_mask[:, None], other=0.0)
    pdl_wait(USE_PDL)
    h = tl.load(h_base + (s * R + offs_r)[None, :] * stride_hn, mask=m_mask[:, None] & r_mask[None, :], other=0.0)
    if UPCAST:
        acc = tl.dot(h, b.to(tl.float32))
    else:
        acc = tl.dot(h.to(b.dtype), b)
    if R_STEPS > 1:  # larger ranks: the rest in 64-wide steps, a loop (not unrolled: its tiles would spill), up to the slot's own rank
        for r0 in range(BLOCK_R, own, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_mask = offs_r < own
            b = tl.load(b_base + offs_r[:, None] * stride_br, mask=n_mask[None, :] & r_mask[:, None], other=0.0)
            h = tl.load(h_base + (s * R + offs_r)[None, :] * stride_hn, mask=m_mask[:, None] & r_mask[None, :], other=0.0)
            if UPCAST:
                acc = tl.dot(h, b.to(tl.float32), acc)
            else:
                acc = tl.dot(h.to(b.dtype), b, acc)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class ShrinkConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class ExpandConfig:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


SEARCH_SPACE = {  # what `lorabench tune` tries, per op
    "shrink": {"block_m": [16, 32, 64], "block_n": [16, 32, 64], "block_k": [32, 64, 128, 256, 512],
               "split_k": [1, 2, 4, 8, 16, 32, 64], "num_warps": [2, 4, 8], "num_stages": [1, 2, 3, 4]},
    "expand": {"block_m": [16, 32, 64], "block_n": [32, 64, 128, 256], "num_warps": [2, 4, 8], "num_stages": [1, 2, 3]},
}
CONFIGS = {"shrink": ShrinkConfig, "expand": ExpandConfig}

# Tuned configs by shape key: filled by ``load_tuned`` (sweeps given ``--tuned DIR``, kernels triton+tuned).
TUNED_CONFIGS: dict[tuple, ShrinkConfig | ExpandConfig] = {}


def shape_key(op: str, tokens: int, k_in: int, n_out: int, slices: int, launch: int) -> tuple:
    """What a tuned config is chosen by. shrink: (K, slices·rank, 0); expand: (rank, widest
    slice, slices); both with the token bucket and the launch count."""
    return (op, tokens, k_in, n_out, slices, launch)


def default_config(op: str, tokens: int, k_in: int, n_out: int, slices: int, launch: int):
    return shrink_config(tokens, k_in, n_out, launch) if op == "shrink" else expand_config(tokens, n_out)


def config_for(op: str, tokens: int, k_in: int, n_out: int, slices: int, launch: int):
    """The tuned config of the nearest tuned shape with the same op and sizes (nearest token
    bucket, then nearest launch count; ties go to the larger), else the default."""
    same = [key for key in TUNED_CONFIGS if (key[0], *key[2:5]) == (op, k_in, n_out, slices)]
    if not same:
        return default_config(op, tokens, k_in, n_out, slices, launch)
    best = min(same, key=lambda key: (abs(key[1] - tokens), -key[1], abs(key[5] - launch), -key[5]))
    return TUNED_CONFIGS[best]


def load_tuned(entries: list[dict]) -> None:
    """Install the triton entries of a tune (``{"kernel": "triton", "shape": [...], "config": {...}}``)."""
    TUNED_CONFIGS.clear()
    for e in entries:
        if e.get("kernel") == "triton":
            TUNED_CONFIGS[tuple(e["shape"])] = CONFIGS[e["shape"][0]](**e["config"])


def _block_m(tokens: int) -> int:
    return 16 if tokens <= 16 else 32 if tokens <= 64 else 64


SHRINK_PROGRAMS = 512  # ~4 per SM on a 132-SM H200: enough programs in flight to stream the A tiles
FEW_TILES = 8  # launched slots x token tiles x output tiles up to which a shrink is split to SHRINK_PROGRAMS


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def shrink_config(tokens: int, k: int, n: int, launch: int = 1) -> ShrinkConfig:
    """Default shrink tiling. A decode-sized shrink is a GEMV over A: with few launched slots it
    is as fast as the A reads in flight, so K is split (64-wide blocks, 3 stages) until the launch
    has about ``SHRINK_PROGRAMS`` programs, at most 64 splits. With many launched slots a graph
    usually serves fewer active ones, whose programs then carry the step: there the tiling stays
    the earlier default (block_k 128, K in ~256-wide parts up to 32, 4 warps, 2 stages), which
    measured faster in the step at 32 slots than the tiling the isolated grid favoured (64 / 16 /
    2 warps / 3 stages). Both from an H200 (BENCHMARKS.md, "How the kernels got there";
    scripts/shrink_grid.py)."""
    block_m, block_n = _block_m(tokens), min(64, max(16, triton.next_power_of_2(n)))
    if tokens > 64:
        return ShrinkConfig(block_m, block_n, 128, min(4, _pow2_floor(k // 128)))
    tiles = launch * triton.cdiv(tokens, block_m) * triton.cdiv(n, block_n)
    if tiles > FEW_TILES:
        return ShrinkConfig(block_m, block_n, 128, min(32, triton.next_power_of_2(max(1, k // 256))))
    split_k = min(64, _pow2_floor(SHRINK_PROGRAMS // tiles), _pow2_floor(k // 64))
    return ShrinkConfig(block_m, block_n, 64, split_k, num_stages=3)


def expand_config(tokens: int, n_max_slice: int) -> ExpandConfig:
    return ExpandConfig(_block_m(tokens), min(128, max(16, triton.next_power_of_2(n_max_slice))))


RANK_STEP = 64  # the expand's widest rank tile: larger ranks loop over it (a 512 x 128 B tile would not fit)


def rank_block(rank: int) -> int:
    """The expand's rank tile: the rank rounded up to a power of two, 16 at least, 64 at most."""
    return min(RANK_STEP, max(16, triton.next_power_of_2(rank)))


def lora_shrink(x, lora_a, out, meta: LoRAMeta, launch_count: int, scale: float, config=None, rank=None,
                slices=1):
    """out[t] (+)= scale · x[t] @ lora_a[slot(t)]ᵀ for adapter tokens of the first
    ``launch_count`` active slots. ``out`` is float32 [T, S·R]; zero it first when split.
    ``rank``: R, h's columns per slice (default: lora_a's rows per slice). lora_a holds
    ``slices`` slices of R rows, or of R / TP (fully sharded LoRA: the rest of each slice of h
    is other ranks', left as it is)."""
    tokens, k = x.shape
    n = lora_a.shape[1]
    rows_per_slice = n // slices
    rank = rank or rows_per_slice
    cfg = config or config_for("shrink", tokens, k, n, 0, launch_count)
    grid = (cfg.split_k * triton.cdiv(tokens, cfg.block_m) * triton.cdiv(n, cfg.block_n), 1, launch_count)
    pdl = pdl_enabled(x.device)
    ranked = meta.slot_rank is not None
    _shrink_kernel[grid](
        x, lora_a, out, meta.token_slot, meta.sorted_tokens, meta.active_slots, meta.slot_start,
        meta.slot_rank if ranked else meta.active_slots, tokens, k, n, rows_per_slice, rank,
        x.stride(0), x.stride(1),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        out.stride(0), out.stride(1),
        scale,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        SORTED=sorted_tiles(tokens, cfg.block_m), USE_PDL=pdl,
        UPCAST=INTERPRET and x.dtype == torch.bfloat16, RANKED=ranked,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(pdl),
    )


def lora_expand(h, lora_b, y, slice_starts, meta: LoRAMeta, launch_count: int, config=None):
    """y[t, slice s] += h[t, s·R:(s+1)·R] @ lora_b[slot(t)][slice s]ᵀ, in place."""
    num_slices = len(slice_starts) - 1
    if not 1 <= num_slices <= MAX_SLICES:
        raise ValueError(f"{num_slices} slices; the expand kernel takes 1 to {MAX_SLICES}")
    bounds = list(slice_starts[1:]) + [slice_starts[-1]] * (MAX_SLICES - num_slices)
    widest = max(b - a for a, b in zip(slice_starts, slice_starts[1:]))
    tokens = y.shape[0]
    rank = lora_b.shape[2]
    cfg = config or config_for("expand", tokens, rank, widest, num_slices, launch_count)
    grid = (triton.cdiv(tokens, cfg.block_m) * triton.cdiv(widest, cfg.block_n), num_slices, launch_count)
    pdl = pdl_enabled(y.device)
    ranked = meta.slot_rank is not None
    _expand_kernel[grid](
        h, lora_b, y, meta.token_slot, meta.sorted_tokens, meta.active_slots, meta.slot_start,
        meta.slot_rank if ranked else meta.active_slots, tokens, rank, *bounds,
        h.stride(0), h.stride(1),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        y.stride(0), y.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=rank_block(rank), R_STEPS=triton.cdiv(rank, rank_block(rank)),
        SORTED=sorted_tiles(tokens, cfg.block_m), USE_PDL=pdl,
        UPCAST=INTERPRET and y.dtype == torch.bfloat16, RANKED=ranked,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(pdl),
    )


def lora_apply(y, x, lora_a, lora_b, slice_starts, meta: LoRAMeta, launch_count, scale, scratch=None):
    """Shrink then expand into ``y`` in place. ``scratch`` is a float32 [>=T, >=S·R] buffer;
    it must be zero on entry (the shrink splits K with atomics, and a fully sharded rank's A,
    R / TP rows per slice, leaves the rest of each slice to the all-gather; the model zeroes all
    its scratch once per step). Without one, a zeroed buffer is allocated (not allowed inside
    graph capture)."""
    if launch_count <= 0:
        return
    tokens = x.shape[0]
    if scratch is None:
        scratch = torch.zeros(tokens, (len(slice_starts) - 1) * lora_b.shape[2], dtype=torch.float32, device=x.device)
    rank, slices = lora_b.shape[2], len(slice_starts) - 1
    if scratch.shape[0] < tokens or scratch.shape[1] < slices * rank:
        raise ValueError(f"scratch {tuple(scratch.shape)} is smaller than [{tokens}, {slices * rank}] (tokens, slices x rank)")
    h = scratch[:tokens, :slices * rank]
    lora_shrink(x, lora_a, h, meta, launch_count, scale, rank=rank, slices=slices)
    lora_expand(h, lora_b, y, slice_starts, meta, launch_count)
