"""Loading an adapter into a slot as vLLM activates one (``LoRAModelManager.activate_adapter``):
for every LoRA linear of every layer and every slice of it, the slot's A and B are zeroed
(``reset_lora``) and the adapter's copied in from pinned host memory (``set_lora``:
``copy_(..., non_blocking=True)``), on the step's own stream, so the step that needs the adapter
waits for the copies. Host time of issuing them counts too: a step's CUDA events enclose both.
A MoE layer's expert LoRA loads as vLLM's ``FusedMoEWithLoRA.set_lora`` loads it: per slice of
w13 and for w2, the slot's A ``[E, R, K]`` and B ``[E, N, R]`` of every expert zeroed and copied
whole (vLLM also writes each layer's enabled flag for the slot, 2 small writes per layer; lorabench
keeps the same flags, per layer and slot, and writes a slot's column of them, one copy, only where
the adapters differ in them).

The host holds a small bank of adapters in pinned memory, each with one slot's shapes (the
adapter at the slots' rank, as the model pads it), copied from the model's own slots; adapter
``a`` is copied from ``bank[a % BANK]``. Each bank entry's tensors are views of one contiguous
host buffer (``flat``), so that the one-copy path (``lorabench.runtime.load_paths``) copies the
very bytes the per-slice path copies, with no second pinned copy. A copy's time does not depend on which pinned buffer it
reads, and the bank keeps a residency run over 200 adapters from pinning 200 adapters of host
memory. With the user's adapters (``--adapters DIR``) the bank holds every one of them, as
vLLM's CPU cache would, each padded to the slots' shapes; where their ranks differ, a load also
writes the slot's rank (read by the ``+unpadded`` kernels), and where only some have expert
LoRA (in some layers), the slot's enabled flags. Loads overwrite slots, so they run after the check: what a slot
holds then is another slot's adapter, the same sizes and distribution.
"""

import time

import numpy as np
import torch

from lorabench.runtime.dispatch import Dispatcher
from lorabench.config.peft import PeftAdapter
from lorabench.runtime.model import LlamaLoRA, LoRALinear
from lorabench.runtime.moe import MoEMLP
from lorabench.runtime.peft_slots import expert_flags, fill_slot
from lorabench.runtime.timing import Events, time_steps

BANK = 2  # adapters held in pinned host memory
LOADS = 30  # timed loads per worker, each way (its load cost: the ``load_*`` columns)
WARMUP = 3


class AdapterLoader:
    """Copies adapters from the pinned host bank into the model's slots."""

    def __init__(self, model: LlamaLoRA, bank: int = BANK, adapters: tuple[PeftAdapter, ...] = ()):
        self.cuda = model.embed.is_cuda
        self.max_loras = model.slot_rank.shape[0]
        self.parts: list[tuple[torch.Tensor, slice, torch.Tensor, slice]] = []  # A, its rows; B, its rows: one per slice
        for m in model.modules():
            if isinstance(m, LoRALinear):
                slices = len(m.slice_starts) - 1
                rows = m.lora_a.shape[1] // slices
                for s in range(slices):
                    self.parts.append((m.lora_a, slice(s * rows, (s + 1) * rows),
                                       m.lora_b, slice(m.slice_starts[s], m.slice_starts[s + 1])))
            elif isinstance(m, MoEMLP):  # [S, L, E, ...]: each slice's slot is one contiguous block
                every = slice(None)
                for a, b in ((m.w13_a, m.w13_b), (m.w2_a, m.w2_b)):
                    self.parts.extend((a[s], every, b[s], every) for s in range(a.shape[0]))
        self.slot_rank, self.enabled = model.slot_rank, model.expert_lora_enabled
        self.ranks = self.expert_lora = None  # per bank entry, where a load must write them
        self.held: list[int] | None = None  # the user's adapters: which one each slot holds (fill_slots' order first)
        self.flat: list[torch.Tensor] = []  # each bank entry's bytes, one host buffer (pinned on a GPU machine)
        self.bank: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per entry, per part: its A and B, views of flat
        if not adapters:
            for k in range(bank):
                self._keep(k % self.max_loras)
            return
        for adapter in adapters:  # each padded to the slots' shapes by way of slot 0, which then gets its own back
            fill_slot(model, 0, adapter)
            self._keep(0)
        fill_slot(model, 0, adapters[0])
        self.held = [s % len(adapters) for s in range(self.max_loras)]
        if len({a.rank for a in adapters}) > 1:
            self.ranks = [a.rank for a in adapters]
        if self.enabled is not None and len({a.expert_layers for a in adapters}) > 1:
            layers = self.enabled.shape[0]
            self.expert_lora = [expert_flags(a, layers).to(self.enabled.device) for a in adapters]

    def _keep(self, slot: int) -> None:
        """A new bank entry: ``slot``'s A and B of every part, copied into one host buffer."""
        tensors = [t for a, ar, b, br in self.parts for t in (a[slot, ar], b[slot, br])]
        buf = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, pin_memory=self.cuda)
        views = [v.view(t.shape) for v, t in zip(torch.split(buf, [t.numel() for t in tensors]), tensors)]
        for v, t in zip(views, tensors):
            v.copy_(t)
        self.flat.append(buf)
        self.bank.append(list(zip(views[0::2], views[1::2])))

    @property
    def slot_ops(self) -> int:
        """Device operations of a load beside its copies: the slot's rank and expert-LoRA flag,
        where the adapters differ in them (``begin``)."""
        return (self.ranks is not None) + (self.expert_lora is not None)

    @property
    def ops(self) -> int:
        """Device operations of one load: a zeroing and a copy for A and for B of every slice
        (and ``slot_ops``)."""
        return 4 * len(self.parts) + self.slot_ops

    def begin(self, slot: int, k: int) -> None:
        """Before bank entry ``k``'s copies into ``slot`` (any load path): the slot is unknown
        until they are queued (a failed load is reloaded by ``place``); its rank and flag written."""
        if self.held is not None:
            self.held[slot] = -1
        if self.ranks is not None:
            self.slot_rank[slot] = self.ranks[k]
        if self.expert_lora is not None:
            self.enabled[:, slot].copy_(self.expert_lora[k], non_blocking=True)

    def done(self, slot: int, k: int) -> None:
        """After them: ``slot`` holds bank entry ``k``."""
        if self.held is not None:
            self.held[slot] = k

    def load(self, slot: int, adapter: int) -> None:
        """Adapter ``adapter`` into ``slot``, queued on the current stream."""
        k = adapter % len(self.bank)
        self.begin(slot, k)
        for (a, ar, b, br), (ha, hb) in zip(self.parts, self.bank[k]):
            a[slot, ar].zero_()
            b[slot, br].zero_()
            a[slot, ar].copy_(ha, non_blocking=True)
            b[slot, br].copy_(hb, non_blocking=True)
        self.done(slot, k)

    def place(self, adapters: list[int]) -> None:
        """The user's adapters: load ``adapters[s]`` into every slot s that holds another (-1: any),
        so that a residency run's steps start from the slots its schedule says (untimed). With
        random adapters every slot holds one of the same sizes: nothing to do."""
        if self.held is None:
            return
        for slot, adapter in enumerate(adapters):
            if adapter >= 0 and self.held[slot] != adapter % len(self.bank):
                self.load(slot, adapter)

    def restore(self) -> None:
        """Slot s holds the user's adapter s again (modulo their count), as the rows say."""
        self.place([s % len(self.bank) for s in range(self.max_loras)])


def time_loads(loader: AdapterLoader, d: Dispatcher, loads: int = LOADS, warmup: int = WARMUP,
               in_step: bool = True) -> dict[str, np.ndarray]:
    """What loading one adapter costs, ``loads`` times each way (ms, and host us):

    - ``load_ms``: what it adds to the step that waits for it, as a residency step makes it: decode
      steps of one adapter token, every other one loading an adapter (into slots 0, 1, ...) before
      its replay (``time_steps``); each loading step less the mean of the steps either side of it;
    - ``alone_ms``: the load by itself, CUDA events around its copies, waited for (on the CPU, wall
      time), with ``host_us``, the host's time of queueing them.

    ``in_step`` False: alone only (``load_ms`` all NaN)."""
    load_ms = np.full(loads, np.nan)
    if in_step:
        k = 2 * loads  # steps: load, none, load, none, ...
        steps = [[(i // 2 % loader.max_loras, i // 2)] if i % 2 == 0 else [] for i in range(k)]
        s = time_steps(d, [[0]] * k, k, warmup, loads=steps, loader=loader)
        with_load, plain = s.step_ms[0::2], s.step_ms[1::2]
        neighbours = (plain + np.concatenate([plain[:1], plain[:-1]])) / 2  # the steps after and before each loading one
        load_ms = with_load - neighbours
    for i in range(warmup):
        loader.load(i % loader.max_loras, i)
    if loader.cuda:
        torch.cuda.synchronize()
        events = Events(loads)
    alone, host = np.empty(loads), np.empty(loads)
    for i in range(loads):
        t0 = time.perf_counter_ns()
        if loader.cuda:
            events.start(i)
        loader.load(i % loader.max_loras, i)
        if loader.cuda:
            events.stop(i)
        host[i] = (time.perf_counter_ns() - t0) / 1e3
        if loader.cuda:
            events.wait(i)
        else:
            alone[i] = host[i] / 1e3
    if loader.cuda:
        alone[:] = events.ms()
    return {"load_ms": load_ms, "alone_ms": alone, "host_us": host}
