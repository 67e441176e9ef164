"""LoRA in plain torch ops with the kernels' grid semantics: a graph-safe backend for machines
without Triton's GPU path, and a second implementation of what the launch count means.

Per-token gather (BGMV style): each token multiplies by its own slot's weights. A token is
served only if its slot is among ``active_slots[:launch_count]``, exactly like the Triton grid.
"""

import torch

from . import moe_lora as _moe_lora
from .meta import LoRAMeta
from .moe_lora import moe_path  # noqa: F401 (the grid semantics follow lorabench's Triton paths)

NEEDS_ZEROED_SCRATCH = False


def lora_apply(y, x, lora_a, lora_b, slice_starts, meta: LoRAMeta, launch_count, scale, scratch=None):
    """y += LoRA update, in place; arguments as in ``kernels.triton_lora.lora_apply``."""
    del scratch
    if launch_count <= 0:
        return
    tokens = x.shape[0]
    rank = lora_a.shape[1] // (len(slice_starts) - 1)  # A's rows per slice: R, or R / TP (fully sharded)
    slot = meta.token_slot[:tokens].long()
    launched = meta.active_slots[:launch_count].long()
    served = (slot >= 0) & (slot[:, None] == launched[None, :]).any(dim=1)
    idx = slot.clamp(min=0)
    h = torch.bmm(lora_a[idx], x.unsqueeze(2)).squeeze(2)  # [T, S·R]
    h = h * (served.to(h.dtype) * scale)[:, None]
    for s in range(len(slice_starts) - 1):
        n0, n1 = slice_starts[s], slice_starts[s + 1]
        part = h[:, s * rank : (s + 1) * rank].unsqueeze(2)
        y[:, n0:n1] += torch.bmm(lora_b[idx, n0:n1, :rank], part).squeeze(2)


def moe_lora_apply(call, meta: LoRAMeta, launch_count, scale) -> None:
    """Expert LoRA in torch ops with the Triton paths' semantics: on the sorted path an entry is
    served only if its slot is among ``active_slots[:launch_count]``; on the per-entry path every
    adapter entry is, whatever the count."""
    if launch_count <= 0:
        return
    tokens, top_k = call.topk_ids.shape
    slices, max_loras, experts = call.lora_a.shape[:3]
    slot = meta.token_slot[:tokens].long().repeat_interleave(top_k)
    served = slot >= 0
    if moe_path(tokens, top_k, experts, max_loras, launch_count) == _moe_lora.SORTED:
        launched = meta.active_slots[:launch_count].long()
        served &= (slot[:, None] == launched[None, :]).any(dim=1)
    s, e = slot.clamp(min=0), call.topk_ids.reshape(-1).long().clamp(0, experts - 1)
    served &= call.enabled.long()[s] != 0
    x = call.x if call.x_per_entry else call.x.repeat_interleave(top_k, dim=0)
    weight = served.to(x.dtype) * scale
    if call.mul_weight:
        weight = weight * call.topk_weights.reshape(-1).to(x.dtype)
    ns = call.lora_b.shape[3]
    for i in range(slices):
        h = torch.bmm(call.lora_a[i, s, e], x.unsqueeze(2))  # [numel, R, 1]
        call.y[:, i * ns:(i + 1) * ns] += torch.bmm(call.lora_b[i, s, e], h).squeeze(2) * weight[:, None]
