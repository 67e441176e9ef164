"""The base mixture-of-experts ops of a decode step, each a Triton kernel with a plain-torch twin.

A MoE layer's MLP, as vLLM's Triton ``fused_experts`` runs it: the router's top-k over a softmax
(``route``), the routed entries grouped per expert in blocks (``moe_align.align_blocks``), a
grouped GEMM per projection (``expert_gemm``: w13 then, after SiLU·mul, w2 with the routing
weights multiplied in), and the sum over each token's top-k entries. Entry ``i`` is token
``i // top_k``'s ``i % top_k``-th expert; the intermediates are per entry (``[T·top_k, N]``), the
layout vLLM's expert LoRA updates in place. Every shape is static, so a step is graph-capturable.

``fused=False`` picks the torch twins (the CPU path and the tests' reference).
"""

import torch
import triton
import triton.language as tl

from .launch import INTERPRET, cdiv, next_pow2, pdl_enabled, upcast

BLOCK_M = 16  # entries per block of the grouped GEMM (and of lorabench's sorted-path expert LoRA)


@triton.jit
def gathered_dot(x_ptr, rows, row_mask, stride_xm, w_base, offs_n, n_mask, stride_wn, K,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """``x[rows] @ w[offs_n]ᵀ`` over K, in fp32: the K loop of a block of gathered entries, for the
    expert GEMM and the expert LoRA's shrink. ``w_base``: an [N, K] row-major matrix, rows
    ``stride_wn`` apart; rows outside ``row_mask`` and columns outside ``n_mask`` read zeros;
    ``UPCAST``: the dot in fp32 (the interpreter's bf16)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None],
                    other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, w)
    return acc


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E] router logits
    ids_ptr,  # [T, TOP_K] int64 out: the chosen experts, best first
    weights_ptr,  # [T, TOP_K] float32 out: their routing weights
    E,  # experts
    stride_l,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,  # next power of two >= TOP_K
    E_P2: tl.constexpr,  # next power of two >= E
    RENORMALIZE: tl.constexpr,  # divide the chosen weights by their sum
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_P2)
    valid = offs < E
    logit = tl.load(logits_ptr + t * stride_l + offs, mask=valid, other=-float("inf")).to(tl.float32)
    p = tl.exp(logit - tl.max(logit, axis=0))
    p = tl.where(valid, p / tl.sum(p, axis=0), -1.0)
    slots = tl.arange(0, K_P2)
    chosen_w = tl.zeros([K_P2], dtype=tl.float32)
    chosen_id = tl.zeros([K_P2], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs, E_P2), axis=0)  # ties: the lowest expert id
        chosen_w = tl.where(slots == j, best, chosen_w)
        chosen_id = tl.where(slots == j, idx.to(tl.int64), chosen_id)
        p = tl.where(offs == idx, -1.0, p)
    if RENORMALIZE:
        chosen_w = chosen_w / tl.sum(chosen_w, axis=0)
    keep = slots < TOP_K
    tl.store(ids_ptr + t * TOP_K + slots, chosen_id, mask=keep)
    tl.store(weights_ptr + t * TOP_K + slots, chosen_w, mask=keep)


def route(logits: torch.Tensor, top_k: int, renormalize: bool, ids: torch.Tensor, weights: torch.Tensor,
          fused: bool = True) -> None:
    """Top-k of the softmax over each token's router logits (float32), renormalised if asked,
    written into ``ids`` ([T, top_k] int64) and ``weights`` ([T, top_k] float32), best first.
    Ties go to the lower expert id in the kernel; torch's topk may break them either way."""
    if not fused:
        probs = torch.softmax(logits.float(), dim=-1)
        torch.topk(probs, top_k, dim=-1, out=(weights, ids))
        if renormalize:
            weights.div_(weights.sum(dim=-1, keepdim=True))
        return
    t, experts = logits.shape
    _route_kernel[(t,)](logits, ids, weights, experts, logits.stride(0), TOP_K=top_k,
                        K_P2=next_pow2(top_k), E_P2=next_pow2(experts),
                        RENORMALIZE=renormalize, num_warps=1)


@triton.jit
def block_entries(pid_m, sorted_ptr, expert_ids_ptr, numel, top_k, X_PER_ENTRY: tl.constexpr, BLOCK_M: tl.constexpr):
    """Block ``pid_m`` of the grouped layout: its expert, its entries (padding = numel), which are
    real, and the rows of x they read (the entry's own with ``X_PER_ENTRY``, else its token's)."""
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    entry = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = entry < numel
    rows = entry if X_PER_ENTRY else entry // top_k
    return expert, entry, valid, rows


@triton.jit
def store_entries(acc, y_ptr, entry, valid, offs_n, n_mask, routed_ptr, stride_ym, MUL_WEIGHT: tl.constexpr):
    """Write the block's output tile ``acc`` to its entries' rows of y, times each entry's routing
    weight with ``MUL_WEIGHT``."""
    if MUL_WEIGHT:
        acc *= tl.load(routed_ptr + entry, mask=valid, other=0.0)[:, None]
    tl.store(y_ptr + entry[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _expert_gemm_kernel(
    x_ptr,  # [T, K] tokens, or [T·top_k, K] entries (X_PER_ENTRY)
    w_ptr,  # [E, N, K] the experts' weights
    y_ptr,  # [T·top_k, N] out, one row per entry
    sorted_ptr,  # [P] entries grouped per expert in blocks of BLOCK_M, pad value numel
    expert_ids_ptr,  # [P / BLOCK_M] each block's expert
    post_pad_ptr,  # [1] padded entries: blocks past it are idle
    routed_ptr,  # [T·top_k] routing weights (MUL_WEIGHT only)
    N, K, numel, top_k,
    stride_xm, stride_we, stride_wn, stride_ym,
    X_PER_ENTRY: tl.constexpr,  # x has a row per entry (w2's input), not per token (w13's)
    MUL_WEIGHT: tl.constexpr,  # multiply each row by its routing weight (w2)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # dot in fp32 (interpreter + bf16 only)
    # sm90+: a PDL-launched successor may launch as soon as every program has started, so any
    # successor launched with PDL must pdl_wait before it reads y and before it exits (ordinary
    # launches still wait for the whole grid). The per-entry expert LoRA is the one that uses it, and
    # reads x before it waits: safe while this GEMM is itself launched without PDL (it then starts
    # only once every kernel before it, x's producer included, is done).
    LAUNCH_DEPENDENTS: tl.constexpr,
):
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(post_pad_ptr):
        return
    expert, entry, valid, rows = block_entries(pid_m, sorted_ptr, expert_ids_ptr, numel, top_k, X_PER_ENTRY, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_base = w_ptr + expert * stride_we
    acc = gathered_dot(x_ptr, rows, valid, stride_xm, w_base, offs_n, n_mask, stride_wn, K, BLOCK_M, BLOCK_N, BLOCK_K,
                       UPCAST)
    store_entries(acc, y_ptr, entry, valid, offs_n, n_mask, routed_ptr, stride_ym, MUL_WEIGHT)


def expert_gemm(x: torch.Tensor, w: torch.Tensor, topk_ids: torch.Tensor, layout, routed: torch.Tensor | None = None,
                x_per_entry: bool = False, fused: bool = True) -> torch.Tensor:
    """Each routed entry's row times its expert's weight: ``y[i] = x[row(i)] @ w[expert(i)]ᵀ``
    (row(i) = i // top_k, or i with ``x_per_entry``), times its routing weight when ``routed``
    ([T, top_k]) is given. w: [E, N, K]; layout: ``align_blocks``' base layout (sorted ids,
    expert ids, padded count), block size ``BLOCK_M``. Returns y [T·top_k, N] in x's dtype.
    On sm90+ it lets a PDL-launched successor launch at once, whatever follows (the per-entry
    expert LoRA under ``PER_ENTRY_PDL``, which computes h meanwhile and waits before it touches y);
    successors launched without PDL wait for the whole grid as usual."""
    tokens, top_k = topk_ids.shape
    numel, n, k = tokens * top_k, w.shape[1], w.shape[2]
    if not fused:
        rows = torch.arange(numel, device=x.device) if x_per_entry else torch.arange(numel, device=x.device) // top_k
        y = torch.einsum("ik,ink->in", x[rows].float(), w[topk_ids.reshape(-1)].float())
        if routed is not None:
            y = y * routed.reshape(-1, 1).float()
        return y.to(x.dtype)
    sorted_ids, expert_ids, post_pad = layout
    y = torch.empty((numel, n), dtype=x.dtype, device=x.device)
    block_n, block_k = (32, 32) if INTERPRET else (64, 128)
    grid = (sorted_ids.shape[-1] // BLOCK_M + (sorted_ids.shape[-1] % BLOCK_M > 0), cdiv(n, block_n))
    _expert_gemm_kernel[grid](
        x, w, y, sorted_ids, expert_ids, post_pad, routed if routed is not None else y,
        n, k, numel, top_k, x.stride(0), w.stride(0), w.stride(1), y.stride(0),
        X_PER_ENTRY=x_per_entry, MUL_WEIGHT=routed is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=upcast(x.dtype), LAUNCH_DEPENDENTS=pdl_enabled(x.device), num_warps=4, num_stages=3,
    )
    return y
