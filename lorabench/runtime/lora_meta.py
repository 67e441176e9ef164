"""LoRA batch metadata: the token→slot mapping, tokens sorted by slot, the active slots and
their offsets, built on the host and copied into one static device buffer per step.

Building it in plain Python and sending it with a single host-to-device copy keeps the
per-step host cost to a few microseconds at decode batch sizes; the graphs read the buffer's
views, so its contents can change between replays while its address stays fixed.
"""

import torch

from lorabench.kernels.meta import LoRAMeta


def pack_slots(slots: list[int], max_tokens: int, max_loras: int) -> tuple[list[int], int]:
    """Return (packed int32 layout, active count n) for one batch.

    slots: the slot of every token (-1 = base model), at most ``max_tokens`` of them.
    Layout: token_slot[max_tokens] | sorted_tokens[max_tokens] | active_slots[max_loras] |
    slot_start[max_loras+1]. Padding tokens are base tokens (-1); unused active entries are -1.
    """
    if len(slots) > max_tokens:
        raise ValueError(f"{len(slots)} tokens exceed the buffer's {max_tokens}")
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(slots):
        if s >= 0:
            g = groups.get(s)
            if g is None:
                groups[s] = [i]
            else:
                g.append(i)
    active = sorted(groups)
    if active and active[-1] >= max_loras:
        raise ValueError(f"slot {active[-1]} out of range for max_loras={max_loras}")
    order: list[int] = []
    starts = [0]
    for s in active:
        order += groups[s]
        starts.append(len(order))
    n = len(active)
    packed = list(slots)
    packed += [-1] * (max_tokens - len(slots))
    packed += order
    packed += [0] * (max_tokens - len(order))
    packed += active
    packed += [-1] * (max_loras - n)
    packed += starts
    packed += [starts[-1]] * (max_loras + 1 - len(starts))
    return packed, n


class MetaBuffer:
    """The static device buffer a step's metadata lives in, and its ``LoRAMeta`` views."""

    def __init__(self, max_tokens: int, max_loras: int, device: torch.device | str):
        self.max_tokens = max_tokens
        self.max_loras = max_loras
        size = 2 * max_tokens + 2 * max_loras + 1
        self.buffer = torch.full((size,), -1, dtype=torch.int32, device=device)
        b, t, m = self.buffer, max_tokens, max_loras
        self.meta = LoRAMeta(
            token_slot=b[:t],
            sorted_tokens=b[t : 2 * t],
            active_slots=b[2 * t : 2 * t + m],
            slot_start=b[2 * t + m :],
        )
        self.cuda = self.buffer.is_cuda
        if self.cuda:
            # Pinned staging: an asynchronous copy that does not wait for the stream. The event
            # keeps the host from overwriting the staging buffer before its last copy has run.
            self.staging = torch.empty(size, dtype=torch.int32, pin_memory=True)
            self.staging_np = self.staging.numpy()
            self.copied = torch.cuda.Event()
        self.load(pack_slots([], max_tokens, max_loras)[0])

    def pack(self, slots: list[int]) -> tuple[list[int], int]:
        return pack_slots(slots, self.max_tokens, self.max_loras)

    def load(self, packed: list[int]) -> None:
        """Copy a packed batch in: one host-to-device copy, ordered on the current stream."""
        if self.cuda:
            self.copied.synchronize()
            self.staging_np[:] = packed
            self.buffer.copy_(self.staging, non_blocking=True)
            self.copied.record()
        else:
            self.buffer.copy_(torch.tensor(packed, dtype=torch.int32))
