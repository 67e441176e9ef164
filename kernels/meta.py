"""The per-step batch metadata every lorabench kernel reads (``LoRAMeta``)."""

from typing import NamedTuple

import torch


class LoRAMeta(NamedTuple):
    """Per-step batch metadata, as device tensors (views of one packed int32 buffer).

    token_slot:   [T]           slot of every token, -1 for base-model tokens
    sorted_tokens:[T]           indices of adapter tokens grouped by active slot
    active_slots: [max_loras]   distinct slots of the batch's adapter tokens, padded with -1
    slot_start:   [max_loras+1] where each active slot's tokens begin in sorted_tokens
    slot_rank:    [max_loras]   optional: each slot's adapter's own rank (<= the weights' rank R,
                                which the adapter is zero-padded to). Given, lorabench's Triton
                                kernels skip the padding past the own rank rounded up to 16 (the
                                zeros below it keep their loads vectorised); None, they compute
                                all R, as vLLM does.
    """

    token_slot: torch.Tensor
    sorted_tokens: torch.Tensor
    active_slots: torch.Tensor
    slot_start: torch.Tensor
    slot_rank: torch.Tensor | None = None

    def tile_args(self) -> tuple[torch.Tensor, ...]:
        """What the shrink, expand and fused kernels take of it, in their order: the four index
        tensors, then the slots' ranks (with RANKED = ``slot_rank is not None``; a placeholder
        pointer, never read, without)."""
        ranks = self.slot_rank if self.slot_rank is not None else self.active_slots
        return self.token_slot, self.sorted_tokens, self.active_slots, self.slot_start, ranks
