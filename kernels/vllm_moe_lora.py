"""vLLM's expert LoRA (``vllm.lora.ops.triton_ops.fused_moe_lora``) as the ``vllm`` backend's MoE op.

Called as vLLM 0.33's ``PunicaWrapperGPU.add_lora_w13`` / ``add_lora_w2`` call it: the kernel
configs from ``try_get_optimal_moe_lora_config`` (vLLM's default, no tuned LoRA configs), the
per-token ("naive") path when ``tokens · top_k · 8 <= experts · max_loras``, else the sorted path
over ``moe_lora_align_block_size``'s layout, then ``fused_moe_lora`` itself, which picks among its
small-batch persistent, one-shot and shrink/expand kernels by vLLM's own rule. Its grid's adapter
axis is the count in vLLM's metadata (``meta_args``), which includes the base id -1.

The alignment op is compiled in vLLM and the Python-files bundle lacks it: lorabench's own
one-launch Triton equivalent (``moe_align.align_blocks``, tested equal to the layout) stands in.
vLLM folds the LoRA scale into B when it loads an adapter, so its op takes none: only scale 1 runs.
"""

import torch

from .moe_align import align_blocks, uses_per_token_path
from .moe_lora import PER_ENTRY, SORTED

_OPS = None


def _load(load_ops):
    """vLLM's MoE LoRA op and config helpers; ``load_ops``: ``vllm_lora.load_ops``, which imports
    vLLM with the interpreter's and torch's flags handled."""
    global _OPS
    if _OPS is None:
        load_ops()
        from vllm.lora.layers.utils import try_get_optimal_moe_lora_config
        from vllm.lora.ops.triton_ops.fused_moe_lora_op import fused_moe_lora
        from vllm.lora.ops.triton_ops.utils import _normalize_lora_config_keys

        _OPS = fused_moe_lora, try_get_optimal_moe_lora_config, _normalize_lora_config_keys
    return _OPS


def moe_path(tokens: int, top_k: int, experts: int, max_loras: int) -> str:
    """vLLM's choice (``moe_align.uses_per_token_path``)."""
    return PER_ENTRY if uses_per_token_path(tokens, top_k, experts, max_loras) else SORTED


def _config(get_config, normalize, op_type, w1_shape, w2_shape, rank, top_k, dtype, tokens):
    try:
        config = get_config(op_type=op_type, w1_shape=w1_shape, w2_shape=w2_shape, rank=rank, top_k=top_k,
                            dtype=None if dtype in (torch.float16, torch.bfloat16) else "float32", M=tokens)
    except NotImplementedError:  # Triton's interpreter on a CPU: vLLM's platform has no device name to look up
        rank_block = max(16, 1 << (rank - 1).bit_length())
        config = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32 if op_type.endswith("expand") else min(32, rank_block),
                  "BLOCK_SIZE_K": min(32, rank_block) if op_type.endswith("expand") else 32, "GROUP_SIZE_M": 1}
    return normalize(config)


def moe_lora_apply(call, meta, launch_count: int, scale: float, load_ops) -> None:
    """``call.y += expert LoRA`` with vLLM's kernels and metadata (``meta``: a ``VllmMeta``)."""
    if launch_count <= 0:
        return
    if scale != 1.0:
        raise ValueError("vLLM's fused_moe_lora takes no LoRA scale (vLLM folds it into B): run it at scale 1")
    fused_moe_lora, get_config, normalize = _load(load_ops)
    tokens, top_k = call.topk_ids.shape
    slices, max_loras, experts, rank, _ = call.lora_a.shape
    w13 = call.routed is None
    hidden = call.lora_a.shape[-1] if w13 else call.lora_b.shape[3]
    inter = call.lora_b.shape[3] if w13 else call.lora_a.shape[-1]
    w1_shape, w2_shape = (experts, 2 * inter, hidden), (experts, hidden, inter)
    op = "fused_moe_lora_w13" if w13 else "fused_moe_lora_w2"
    shrink, expand = (_config(get_config, normalize, f"{op}_{part}", w1_shape, w2_shape, rank, top_k, call.x.dtype, tokens)
                      for part in ("shrink", "expand"))
    mapping, _, _, _, lora_ids, no_lora, active = meta.kernel_meta.meta_args(tokens, meta.specialize)
    if meta.frozen_grid is not None:
        active = meta.frozen_grid
    if bool(no_lora.item()):
        return
    enabled = call.enabled
    if moe_path(tokens, top_k, experts, max_loras) == PER_ENTRY:
        sorted_ids, expert_ids, post_pad = None, call.topk_ids.reshape(-1), None
    else:
        sorted_ids, expert_ids, post_pad = align_blocks(call.topk_ids, experts, int(shrink.get("BLOCK_SIZE_M") or 64),
                                                        max_loras, mapping, lora_ids, enabled)
    weights = call.routed if call.routed is not None else torch.ones_like(call.topk_ids, dtype=torch.float32)
    y = call.y.view(tokens, top_k, call.y.shape[-1])
    a = [call.lora_a[i] for i in range(slices)]
    b = [call.lora_b[i] for i in range(slices)]
    fused_moe_lora(
        y, call.x, a, b, weights, sorted_ids, expert_ids, post_pad, mapping, rank, top_k, lora_ids, active, enabled,
        shrink.get("BLOCK_SIZE_M", 64), shrink.get("BLOCK_SIZE_N", 64), shrink.get("BLOCK_SIZE_K", 32),
        shrink.get("GROUP_SIZE_M", 8), shrink.get("NUM_WARPS", 4), shrink.get("NUM_STAGES", 3), shrink.get("SPLIT_K", 1),
        expand.get("BLOCK_SIZE_M", 64), expand.get("BLOCK_SIZE_N", 64), expand.get("BLOCK_SIZE_K", 32),
        expand.get("GROUP_SIZE_M", 8), expand.get("NUM_WARPS", 4), expand.get("NUM_STAGES", 3), expand.get("SPLIT_K", 1),
        call.routed is not None, False, 0, True,
    )
