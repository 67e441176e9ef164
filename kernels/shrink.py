"""The shrink: scratch[t, :] (+)= scale · x[t] @ A[slot]ᵀ, split over K, fp32 atomics when split.

Its grid's last axis is the launch count (see ``triton_lora``) where one token tile holds the
batch (decode); above, its first axis walks the launched slots' packed token tiles
(``tiles.packed_tile``), cdiv(T, BLOCK_M) + launch - 1 of them. It lets the expand launch at once
under PDL and waits before it writes.
"""

import torch
import triton
import triton.language as tl

from .launch import cdiv, pdl_enabled, pdl_launch, pdl_wait, upcast
from .lora_configs import config_for
from .meta import LoRAMeta
from .tiles import own_rank, slot_tile, token_grid


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
    LAUNCH,  # launch count (PACKED: whose tiles the grid walks)
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
    PACKED: tl.constexpr,  # SORTED over the launched slots' tiles laid end to end (see packed_tile), one grid column
    LAUNCH_PAD: tl.constexpr,  # PACKED: the launch count's next power of two
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
    slot, rows, m_mask, idle = slot_tile(pid_m, lora_idx, LAUNCH, T, token_slot_ptr, sorted_ptr, active_ptr, start_ptr,
                                         BLOCK_M, SORTED, PACKED, LAUNCH_PAD, USE_PDL)
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


def lora_shrink(x, lora_a, out, meta: LoRAMeta, launch_count: int, scale: float, config=None, rank=None,
                slices=1, pdl: bool | None = None):
    """out[t] (+)= scale · x[t] @ lora_a[slot(t)]ᵀ for adapter tokens of the first
    ``launch_count`` active slots. ``out`` is float32 [T, S·R]; zero it first when split.
    ``rank``: R, h's columns per slice (default: lora_a's rows per slice). lora_a holds
    ``slices`` slices of R rows, or of R / TP (fully sharded LoRA: the rest of each slice of h
    is other ranks', left as it is). ``pdl``: PDL-launch it (None: where ``pdl_enabled`` says)."""
    tokens, k = x.shape
    n = lora_a.shape[1]
    rows_per_slice = n // slices
    rank = rank or rows_per_slice
    cfg = config or config_for("shrink", tokens, k, n, 0, launch_count)
    tg = token_grid(tokens, cfg.block_m, launch_count)
    grid = (cfg.split_k * tg.tiles * cdiv(n, cfg.block_n), 1, tg.columns)
    pdl = pdl_enabled(x.device) if pdl is None else pdl and pdl_enabled(x.device)
    ranked = meta.slot_rank is not None
    _shrink_kernel[grid](
        x, lora_a, out, *meta.tile_args(), tokens, launch_count, k, n, rows_per_slice, rank,
        x.stride(0), x.stride(1),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        out.stride(0), out.stride(1),
        scale,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        **tg.flags(), USE_PDL=pdl,
        UPCAST=upcast(x.dtype), RANKED=ranked,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(pdl),
    )


def shrink_into(x, lora_a, meta: LoRAMeta, launch_count: int, scale: float, slices: int, rank: int, scratch=None,
                pdl: bool | None = None):
    """``lora_shrink`` into the first [T, S·R] of ``scratch`` (float32, zero on entry: the shrink
    splits K with atomics; a zeroed one is allocated when None, which graph capture forbids); h."""
    tokens = x.shape[0]
    if scratch is None:
        scratch = torch.zeros(tokens, slices * rank, dtype=torch.float32, device=x.device)
    if scratch.shape[0] < tokens or scratch.shape[1] < slices * rank:
        raise ValueError(f"scratch {tuple(scratch.shape)} is smaller than [{tokens}, {slices * rank}] (tokens, slices x rank)")
    h = scratch[:tokens, :slices * rank]
    lora_shrink(x, lora_a, h, meta, launch_count, scale, rank=rank, slices=slices, pdl=pdl)
    return h
