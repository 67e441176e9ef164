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
"""

import torch


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
