"""The sorted path's metadata for expert LoRA: tokens grouped per (slot, expert), padded to blocks.

vLLM's ``fused_moe_lora`` reads, on its sorted path, the layout that its compiled
``moe_lora_align_block_size`` op writes (vLLM 0.33, ``csrc/moe/moe_align_sum_kernels.cu``). The
Python-files bundle has no compiled ops, so this module builds the same layout in torch, with
static shapes and no host synchronisation, so that it can be captured in a CUDA graph. It is also
the metadata of lorabench's own sorted-path MoE LoRA kernels.

The layout, for ``numel = tokens · top_k`` routed entries (entry ``i`` = token ``i // top_k``'s
``i % top_k``-th expert) and ``L = max_loras`` slots, each slot's rows indexed by the slot id::

    sorted_token_ids [L, P]   for each expert in turn, the entries routed to it whose token is
                              the slot's, then the pad value ``numel`` up to a multiple of
                              ``block_size``; ``numel`` after the last expert's block
    expert_ids       [L, M]   the expert of each block of ``block_size`` entries, -1 past them
    num_tokens_post_padded [L]  the padded entries of the slot (a multiple of ``block_size``)

with ``P = max_num_tokens_padded(numel, experts, block_size)`` and ``M = ceil(P / block_size)``.
A slot is filled when it is among ``lora_ids`` (the active ids; -1 entries, the base model's,
are skipped) and ``adapter_enabled[slot]`` is non-zero. vLLM's op leaves the other slots' rows
unwritten (``torch.empty``, and ``expert_ids`` pre-filled with -1); here they read as empty (pad
value, -1, 0), which no kernel reads since its grid skips those slots. Routed expert ids
outside ``[0, experts)`` are dropped, as the CUDA op drops ids past ``experts``.

Within one expert's range the entries are in ascending order here; vLLM's op places them with
atomics, so its order there may be any permutation of the same entries (the grouped GEMM that
reads them does not depend on it). ``expert_map`` (expert parallelism) is not supported.

Two implementations of one layout: ``moe_lora_align_block_size`` in torch ops (the CPU's, and the
tests' second opinion; some thirty small kernels on a GPU) and ``align_blocks``, one Triton launch
that a decode step can afford per MoE layer, as vLLM's compiled op is one launch. The base MoE's own
layout (every entry's expert, no slots) is the same with one slot that holds every token.
"""

import torch
import triton
import triton.language as tl

from .launch import INTERPRET, next_pow2


def max_num_tokens_padded(numel: int, experts: int, block_size: int, pad_sorted_ids: bool = False) -> int:
    """The length of each slot's ``sorted_token_ids`` row, as vLLM 0.33's
    ``PunicaWrapperGPU.moe_lora_align_block_size`` sizes it: every expert may end in a partial
    block (``numel + experts · (block_size - 1)``), rounded up to a block with
    ``pad_sorted_ids``; with fewer entries than experts, one block per entry."""
    if numel < experts:
        return numel * block_size
    size = numel + experts * (block_size - 1)
    return -(-size // block_size) * block_size if pad_sorted_ids else size


def moe_lora_align_block_size(
    topk_ids: torch.Tensor,  # [T, top_k] the experts each token is routed to
    token_lora_mapping: torch.Tensor,  # [T] each token's slot, -1 for base-model tokens
    lora_ids: torch.Tensor,  # [A] the active slot ids the kernel's grid walks, -1 = none
    adapter_enabled: torch.Tensor,  # [max_loras] non-zero where a slot holds an adapter with expert LoRA
    experts: int,  # experts of the layer
    block_size: int,  # the grouped GEMM's BLOCK_SIZE_M
    max_loras: int,
    pad_sorted_ids: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_token_ids [L, P], expert_ids [L, M], num_tokens_post_padded [L])``, int32, on
    ``topk_ids``' device (the module's docstring describes them)."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    device = topk_ids.device
    tokens, top_k = topk_ids.shape
    numel = tokens * top_k
    width = max_num_tokens_padded(numel, experts, block_size, pad_sorted_ids)
    blocks = -(-width // block_size)

    # The slots the grid fills: listed in lora_ids (counted, so that repeats and -1 do not clash) and enabled.
    listed = (lora_ids >= 0) & (lora_ids < max_loras)
    hits = torch.zeros(max_loras, dtype=torch.int32, device=device)
    hits.index_add_(0, lora_ids.long().clamp(0, max_loras - 1), listed.to(torch.int32))
    filled = (hits > 0) & (adapter_enabled[:max_loras] != 0)

    expert = topk_ids.reshape(-1).long()
    slot = token_lora_mapping.long().repeat_interleave(top_k)
    kept = (expert >= 0) & (expert < experts) & (slot >= 0) & (slot < max_loras)
    kept &= filled[slot.clamp(0, max_loras - 1)]
    groups = max_loras * experts
    group = torch.where(kept, slot * experts + expert, torch.full_like(expert, groups))  # dropped: one group past the end

    counts = torch.zeros(groups + 1, dtype=torch.int64, device=device)
    counts.index_add_(0, group, torch.ones_like(group))
    padded = ((counts[:groups] + block_size - 1) // block_size * block_size).view(max_loras, experts)
    ends = padded.cumsum(1)  # [L, E] each expert's range ends here within its slot's row
    starts = ends - padded

    # Each kept entry's rank among the earlier entries of its group: a stable sort keeps entry order.
    order = torch.sort(group, stable=True).indices
    sorted_group = group[order]
    first = torch.searchsorted(sorted_group, sorted_group)  # where each entry's group begins
    rank = torch.empty_like(group)
    rank[order] = torch.arange(numel, device=device) - first

    row_start = starts.reshape(-1)[group.clamp(max=groups - 1)]
    target = torch.where(kept, slot * width + row_start + rank, torch.full_like(group, max_loras * width))
    flat = torch.full((max_loras * width + 1,), numel, dtype=torch.int32, device=device)  # + 1: where dropped entries land
    flat.scatter_(0, target, torch.arange(numel, dtype=torch.int32, device=device))
    sorted_token_ids = flat[:-1].view(max_loras, width)

    total = ends[:, -1] if experts else torch.zeros(max_loras, dtype=torch.int64, device=device)
    block_start = (torch.arange(blocks, device=device) * block_size).expand(max_loras, blocks).contiguous()
    owner = torch.searchsorted(ends, block_start, right=True)  # the first expert whose range ends past the block
    expert_ids = torch.where(block_start < total[:, None], owner, torch.full_like(owner, -1)).to(torch.int32)
    return sorted_token_ids, expert_ids, total.to(torch.int32)


def uses_per_token_path(tokens: int, top_k: int, experts: int, max_loras: int,
                        fully_sharded: bool = False, expert_parallel: bool = False) -> bool:
    """vLLM 0.33's choice of ``fused_moe_lora``'s per-token ("naive") path, whose grid has one
    program per routed entry and ignores the active count, over the sorted path above
    (``PunicaWrapperGPU``'s fused-MoE LoRA call: ``tokens · top_k · 8 <= experts · max_loras``, with
    the rank's own experts, never with fully sharded LoRA or an expert map)."""
    return not fully_sharded and not expert_parallel and tokens * top_k * 8 <= experts * max_loras


@triton.jit
def _align_kernel(
    topk_ptr,  # [numel] routed expert of every entry (token numel // top_k's numel % top_k-th)
    slot_ptr,  # [T] each token's slot, -1 = base model (HAS_SLOTS only)
    lora_ids_ptr,  # [n_lora_ids] the active slot ids, -1 = none (HAS_SLOTS only)
    enabled_ptr,  # [max_loras] non-zero where a slot has expert LoRA (HAS_SLOTS only)
    sorted_ptr,  # [L, width] out: entries per (slot, expert), pad value numel
    expert_ids_ptr,  # [L, blocks] out: the expert of each block, -1 past the slot's blocks
    post_pad_ptr,  # [L] out: padded entries per slot
    numel, top_k, n_lora_ids, width, blocks,
    E: tl.constexpr,  # experts
    E_P2: tl.constexpr,  # next power of two >= E
    BM: tl.constexpr,  # block size (the grouped GEMM's BLOCK_M)
    CHUNK: tl.constexpr,  # entries per step of the loops over the entries
    IDS_P2: tl.constexpr,  # next power of two >= n_lora_ids
    HAS_SLOTS: tl.constexpr,  # False: one slot holding every entry (the base MoE's layout)
):
    """Program (slot s, expert e) writes expert e's range of slot s's row (its entries in order,
    then pads to a block) and its blocks' expert ids; program (s, 0) also writes the row's tail
    and the slot's padded count. Every program counts all the slot's entries per expert first, so
    it knows where its range starts without waiting for the others."""
    s = tl.program_id(0)
    e = tl.program_id(1)
    filled = True
    if HAS_SLOTS:
        ids = tl.load(lora_ids_ptr + tl.arange(0, IDS_P2), mask=tl.arange(0, IDS_P2) < n_lora_ids, other=-1)
        filled = (tl.max((ids == s).to(tl.int32), axis=0) > 0) & (tl.load(enabled_ptr + s) != 0)
    experts = tl.arange(0, E_P2)
    counts = tl.zeros([E_P2], dtype=tl.int32)
    if filled:
        for c0 in range(0, numel, CHUNK):
            offs = c0 + tl.arange(0, CHUNK)
            valid = offs < numel
            ex = tl.load(topk_ptr + offs, mask=valid, other=-1).to(tl.int32)
            kept = valid & (ex >= 0) & (ex < E)
            if HAS_SLOTS:
                kept = kept & (tl.load(slot_ptr + offs // top_k, mask=valid, other=-1) == s)
            ex = tl.where(kept, ex, -1)
            counts += tl.sum((ex[None, :] == experts[:, None]).to(tl.int32), axis=1)
    padded = (counts + BM - 1) // BM * BM
    total = tl.sum(padded, axis=0)
    start = tl.sum(tl.where(experts < e, padded, 0), axis=0)
    count = tl.sum(tl.where(experts == e, counts, 0), axis=0)
    mine_padded = tl.sum(tl.where(experts == e, padded, 0), axis=0)
    row = sorted_ptr + s.to(tl.int64) * width
    block_row = expert_ids_ptr + s.to(tl.int64) * blocks
    if count > 0:
        seen = 0
        for c0 in range(0, numel, CHUNK):
            offs = c0 + tl.arange(0, CHUNK)
            valid = offs < numel
            ex = tl.load(topk_ptr + offs, mask=valid, other=-1).to(tl.int32)
            mine = valid & (ex == e)
            if HAS_SLOTS:
                mine = mine & (tl.load(slot_ptr + offs // top_k, mask=valid, other=-1) == s)
            flags = mine.to(tl.int32)
            at = start + seen + tl.cumsum(flags, axis=0) - 1
            tl.store(row + at, offs.to(tl.int32), mask=mine)
            seen += tl.sum(flags, axis=0)
        pads = tl.arange(0, BM)
        tl.store(row + start + count + pads, numel, mask=pads < mine_padded - count)
        for b0 in range(0, mine_padded // BM, CHUNK):
            b = b0 + tl.arange(0, CHUNK)
            tl.store(block_row + start // BM + b, e, mask=b < mine_padded // BM)
    if e == 0:
        for p0 in range(total, width, CHUNK):
            p = p0 + tl.arange(0, CHUNK)
            tl.store(row + p, numel, mask=p < width)
        for b0 in range(total // BM, blocks, CHUNK):
            b = b0 + tl.arange(0, CHUNK)
            tl.store(block_row + b, -1, mask=b < blocks)
        tl.store(post_pad_ptr + s, total)


def align_blocks(
    topk_ids: torch.Tensor,  # [T, top_k]
    experts: int,
    block_size: int,
    max_loras: int = 1,
    token_lora_mapping: torch.Tensor | None = None,  # [>= T]; None: the base layout (one slot, every token)
    lora_ids: torch.Tensor | None = None,  # [A] active slot ids, -1 = none
    adapter_enabled: torch.Tensor | None = None,  # [max_loras]
    pad_sorted_ids: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_lora_align_block_size``'s layout in one Triton launch (grid: slots x experts); without
    a mapping, the base MoE's layout (``[1, P]``, ``[1, M]``, ``[1]``). Graph-capturable."""
    tokens, top_k = topk_ids.shape
    numel = tokens * top_k
    width = max_num_tokens_padded(numel, experts, block_size, pad_sorted_ids)
    blocks = -(-width // block_size)
    device = topk_ids.device
    has_slots = token_lora_mapping is not None
    if not has_slots:
        max_loras = 1
    sorted_ids = torch.empty((max_loras, width), dtype=torch.int32, device=device)
    expert_ids = torch.empty((max_loras, blocks), dtype=torch.int32, device=device)
    post_pad = torch.empty((max_loras,), dtype=torch.int32, device=device)
    flat = topk_ids.reshape(-1)
    dummy = post_pad
    n_ids = lora_ids.numel() if has_slots else 1
    _align_kernel[(max_loras, max(experts, 1))](
        flat, token_lora_mapping if has_slots else dummy, lora_ids if has_slots else dummy,
        adapter_enabled if has_slots else dummy, sorted_ids, expert_ids, post_pad,
        numel, top_k, n_ids, width, blocks,
        E=experts, E_P2=next_pow2(max(experts, 1)), BM=block_size,
        CHUNK=16 if INTERPRET else 64, IDS_P2=next_pow2(n_ids), HAS_SLOTS=has_slots,
        num_warps=4,
    )
    return sorted_ids, expert_ids, post_pad
