"""vLLM's expert LoRA (``vllm.lora.ops.triton_ops.fused_moe_lora``) as the ``vllm`` backend's MoE op.

Called as vLLM 0.33's ``PunicaWrapperGPU.add_lora_w13`` / ``add_lora_w2`` call it: the kernel
configs from ``try_get_optimal_moe_lora_config`` (vLLM's default, no tuned LoRA configs), the
per-token ("naive") path when ``tokens · top_k · 8 <= experts · max_loras``, else the sorted path
over ``moe_lora_align_block_size``'s layout, then ``fused_moe_lora`` itself, which picks among its
small-batch persistent, one-shot and shrink/expand kernels by vLLM's own rule. Its grid's adapter
axis is the count in vLLM's metadata (``meta_args``), which includes the base id -1.

vLLM's config helpers live beside its config package, whose import needs pydantic and a dozen
serving dependencies a GPU image without a package index lacks; ``vllm_configs`` reproduces
them (the tuned fused-MoE file for the device when vLLM ships one, else ``get_default_config``'s
bf16/fp16 branch, then the LoRA adjustments) and a GPU test compares them with vLLM's own.

The alignment op is compiled in vLLM and the Python-files bundle lacks it: lorabench's own
one-launch Triton equivalent (``moe_align.align_blocks``, tested equal to the layout) stands in.
vLLM folds the LoRA scale into B when it loads an adapter, so its op takes none: only scale 1 runs.
"""

import functools
import json
import os

import torch

from .moe_align import align_blocks, uses_per_token_path
from .moe_lora import PER_ENTRY, SORTED

_OPS = None


def _load(load_ops):
    """vLLM's MoE LoRA op; ``load_ops``: ``vllm_lora.load_ops``, which imports vLLM with the
    interpreter's and torch's flags handled."""
    global _OPS
    if _OPS is None:
        load_ops()
        from vllm.lora.ops.triton_ops import fused_moe_lora_op

        # Its one-shot kernel asks the device's opt-in shared memory per block through a compiled
        # vLLM op the bundle lacks; torch reads the same attribute.
        fused_moe_lora_op.get_max_shared_memory_bytes = _max_shared_memory_bytes
        _OPS = fused_moe_lora_op.fused_moe_lora
    return _OPS


def _max_shared_memory_bytes(gpu: int = 0) -> int:
    """vLLM's ``get_max_shared_memory_bytes``: cudaDevAttrMaxSharedMemoryPerBlockOptin."""
    return int(torch.cuda.get_device_properties(gpu).shared_memory_per_block_optin)


def _next_power_of_2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


@functools.cache
def _tuned_moe_configs(experts: int, inter: int, device_name: str) -> dict[int, dict] | None:
    """vLLM's shipped fused-MoE configs for (E, N = the expert intermediate size, device), by M."""
    import vllm  # the package's folder only: importing vllm.model_executor.layers.fused_moe needs pydantic

    name = device_name.replace(" ", "_")
    if "H200" in name.split("_"):
        name = "NVIDIA_H200"
    folder = os.path.join(os.path.dirname(vllm.__file__), "model_executor", "layers", "fused_moe", "configs")
    path = os.path.join(folder, f"E={experts},N={inter},device_name={name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return {int(m): config for m, config in json.load(f).items()}


def _default_moe_config(m: int, experts: int) -> dict:
    """vLLM 0.33 ``get_default_config``'s branch for bf16/fp16 weights (CUDA)."""
    return {"BLOCK_SIZE_M": 16 if m <= 32 else 32 if m <= 96 else 64 if m <= 512 else 128,
            "BLOCK_SIZE_N": 64 if m <= 64 else 128, "BLOCK_SIZE_K": 128 if m <= 64 else 64,
            "GROUP_SIZE_M": 16 if m // max(experts, 1) > 128 else 1, "SPLIT_K": 1,
            "num_warps": 4 if m <= 128 else 8, "num_stages": 4 if m <= 32 else 3}


def vllm_configs(experts: int, inter: int, rank: int, tokens: int, device: torch.device) -> tuple[dict, dict]:
    """(shrink, expand) kernel configs as vLLM 0.33's ``try_get_optimal_moe_lora_config`` makes
    them (no tuned LoRA folder): the base MoE's config for M = tokens, the shrink's BLOCK_SIZE_N
    capped at the rank, the expand's BLOCK_SIZE_K clamped to [16, rank]; keys upper-cased as
    ``_normalize_lora_config_keys`` does."""
    tuned = _tuned_moe_configs(experts, inter, torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    base = dict(tuned[min(tuned, key=lambda x: abs(x - tokens))]) if tuned else _default_moe_config(tokens, experts)
    base = {(k.upper() if k.islower() and not k.startswith("block_") else k): v for k, v in base.items()}
    shrink, expand = dict(base), dict(base)
    shrink["BLOCK_SIZE_N"] = min(base.get("BLOCK_SIZE_N") or 64, _next_power_of_2(rank))
    expand["BLOCK_SIZE_K"] = max(16, min(base.get("BLOCK_SIZE_K") or 32, _next_power_of_2(rank)))
    return shrink, expand


def moe_path(tokens: int, top_k: int, experts: int, max_loras: int, launch_count: int) -> str:
    """vLLM's choice (``moe_align.uses_per_token_path``): the launch count does not enter it."""
    del launch_count
    return PER_ENTRY if uses_per_token_path(tokens, top_k, experts, max_loras) else SORTED


def moe_lora_apply(call, meta, launch_count: int, scale: float, load_ops) -> None:
    """``call.y += expert LoRA`` with vLLM's kernels and metadata (``meta``: a ``VllmMeta``)."""
    if launch_count <= 0:
        return
    if scale != 1.0:
        raise ValueError("vLLM's fused_moe_lora takes no LoRA scale (vLLM folds it into B): run it at scale 1")
    fused_moe_lora = _load(load_ops)
    tokens, top_k = call.topk_ids.shape
    slices, max_loras, experts, rank, _ = call.lora_a.shape
    inter = call.lora_a.shape[-1] if call.mul_weight else call.lora_b.shape[3]
    shrink, expand = vllm_configs(experts, inter, rank, tokens, call.x.device)
    mapping, _, _, _, lora_ids, no_lora, active = meta.kernel_meta.meta_args(tokens, meta.specialize)
    if meta.frozen_grid is not None:
        active = meta.frozen_grid
    if bool(no_lora.item()):
        return
    enabled = call.enabled
    if moe_path(tokens, top_k, experts, max_loras, launch_count) == PER_ENTRY:
        sorted_ids, expert_ids, post_pad = None, call.topk_ids.reshape(-1), None
    else:
        sorted_ids, expert_ids, post_pad = align_blocks(call.topk_ids, experts, int(shrink.get("BLOCK_SIZE_M") or 64),
                                                        max_loras, mapping, lora_ids, enabled)
    y = call.y.view(tokens, top_k, call.y.shape[-1])
    a = [call.lora_a[i] for i in range(slices)]
    b = [call.lora_b[i] for i in range(slices)]
    fused_moe_lora(
        y, call.x, a, b, call.topk_weights, sorted_ids, expert_ids, post_pad, mapping, rank, top_k, lora_ids, active, enabled,
        shrink.get("BLOCK_SIZE_M", 64), shrink.get("BLOCK_SIZE_N", 64), shrink.get("BLOCK_SIZE_K", 32),
        shrink.get("GROUP_SIZE_M", 8), shrink.get("NUM_WARPS", 4), shrink.get("NUM_STAGES", 3), shrink.get("SPLIT_K", 1),
        expand.get("BLOCK_SIZE_M", 64), expand.get("BLOCK_SIZE_N", 64), expand.get("BLOCK_SIZE_K", 32),
        expand.get("GROUP_SIZE_M", 8), expand.get("NUM_WARPS", 4), expand.get("NUM_STAGES", 3), expand.get("SPLIT_K", 1),
        call.mul_weight, False, 0, True,
    )
