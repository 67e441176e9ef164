"""The expand: y[t, slice s] += scratch[t, s·R:(s+1)·R] @ B[slot][slice s]ᵀ, in place.

Its grid's last axis is the launch count (see ``triton_lora``). Under PDL its B tile is loaded
while the shrink still runs; it waits before it reads h, and lets its consumer launch at once.
"""

import torch
import triton
import triton.language as tl

from .launch import cdiv, next_pow2, pdl_enabled, pdl_launch, pdl_wait, upcast
from .lora_configs import config_for
from .meta import LoRAMeta
from .tiles import own_rank, slice_bounds, slice_ends, slot_tile, token_grid


@triton.jit
def _expand_kernel(
    h_ptr,  # [T, S·R] float32 shrink output
    b_ptr,  # [L, N, R] stacked B weights
    y_ptr,  # [T, N] output, updated in place
    token_slot_ptr, sorted_ptr, active_ptr, start_ptr, rank_ptr, T, LAUNCH,  # as in the shrink
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
    PACKED: tl.constexpr,  # as in the shrink
    LAUNCH_PAD: tl.constexpr,
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
    slot, rows, m_mask, idle = slot_tile(pid_m, lora_idx, LAUNCH, T, token_slot_ptr, sorted_ptr, active_ptr, start_ptr,
                                         BLOCK_M, SORTED, PACKED, LAUNCH_PAD, USE_PDL)
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


RANK_STEP = 64  # the expand's widest rank tile: larger ranks loop over it (a 512 x 128 B tile would not fit)


def rank_block(rank: int) -> int:
    """The expand's rank tile: the rank rounded up to a power of two, 16 at least, 64 at most."""
    return min(RANK_STEP, max(16, next_pow2(rank)))


def lora_expand(h, lora_b, y, slice_starts, meta: LoRAMeta, launch_count: int, config=None):
    """y[t, slice s] += h[t, s·R:(s+1)·R] @ lora_b[slot(t)][slice s]ᵀ, in place."""
    num_slices = len(slice_starts) - 1
    bounds, widest = slice_ends(slice_starts, "expand")
    tokens = y.shape[0]
    rank = lora_b.shape[2]
    cfg = config or config_for("expand", tokens, rank, widest, num_slices, launch_count)
    tg = token_grid(tokens, cfg.block_m, launch_count)
    grid = (tg.tiles * cdiv(widest, cfg.block_n), num_slices, tg.columns)
    pdl = pdl_enabled(y.device)
    ranked = meta.slot_rank is not None
    _expand_kernel[grid](
        h, lora_b, y, *meta.tile_args(), tokens, launch_count, rank, *bounds,
        h.stride(0), h.stride(1),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        y.stride(0), y.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=rank_block(rank), R_STEPS=cdiv(rank, rank_block(rank)),
        **tg.flags(), USE_PDL=pdl,
        UPCAST=upcast(y.dtype), RANKED=ranked,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(pdl),
    )
