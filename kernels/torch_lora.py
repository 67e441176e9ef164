"""LoRA in plain torch ops with the kernels' grid semantics: a graph-safe backend for machines
without Triton's GPU path, and a second implementation of what the launch count means.

Per-token gather (BGMV style): each token multiplies by its own slot's weights. A token is
served only if its slot is among ``active_slots[:launch_count]``, exactly like the Triton grid.
"""

import torch

from .meta import LoRAMeta

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
