"""The user's adapters in the slots: each slot zeroed, then its adapter's modules
(``lorabench.config.peft``) copied in from their safetensors files, B times the module's scale.

Every module lands as the leading block of its slice: A's first r rows (the slot holds --rank,
the rest stays zero: vLLM's padding) and its first K columns, B's first N rows. At one TP rank's
shapes that block is rank 0's shard, cut as vLLM cuts it (column-parallel linears split B's
outputs, row-parallel ones A's inputs, fully sharded LoRA A's rank or B's outputs): the step
lorabench times is one rank's, and rank 0's weights are real ones.
"""

from collections.abc import Sequence

import torch

from lorabench.config.peft import FUSED_EXPERTS, PeftAdapter, PeftModule
from lorabench.runtime.model import LlamaLoRA, LoRALinear


def read_tensors(adapter: PeftAdapter) -> dict[str, torch.Tensor]:
    """The adapter's A and B tensors, on the host."""
    from safetensors.torch import load_file

    return load_file(adapter.weights, device="cpu")


def _dense(model: LlamaLoRA, m: PeftModule) -> LoRALinear:
    layer = model.layers[m.layer]
    if layer.moe is not None and m.linear in ("gate_up", "down"):  # a MoE layer's dense pair is its shared expert
        return layer.moe.shared_gate_up if m.linear == "gate_up" else layer.moe.shared_down
    return getattr(layer, m.linear)


def fill_slot(model: LlamaLoRA, slot: int, adapter: PeftAdapter, tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Slot ``slot`` holds ``adapter``: every LoRA linear's and expert's A and B of the slot
    zeroed, then the adapter's modules written in; its expert LoRA flagged on or off."""
    tensors = read_tensors(adapter) if tensors is None else tensors
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, LoRALinear):
                mod.lora_a[slot].zero_()
                mod.lora_b[slot].zero_()
        for layer in model.layers:
            if layer.moe is not None:
                for name in ("w13_a", "w13_b", "w2_a", "w2_b"):
                    getattr(layer.moe, name)[:, slot].zero_()
        for m in adapter.modules:
            a, b = tensors[m.a_key], tensors[m.b_key].float() * m.scale  # scaled once, then rounded to the slot's dtype
            if m.expert == FUSED_EXPERTS:
                _fused(model.layers[m.layer].moe, slot, m.linear, a, b)
                continue
            if m.expert >= 0:
                moe = model.layers[m.layer].moe
                slot_a = getattr(moe, f"{m.linear}_a")[m.slice, slot, m.expert]  # [R, K]
                slot_b = getattr(moe, f"{m.linear}_b")[m.slice, slot, m.expert]  # [N, R]
                _lead(slot_a, a)
                _lead(slot_b, b)
                continue
            lin = _dense(model, m)
            rows = lin.lora_a.shape[1] // (len(lin.slice_starts) - 1)  # the slot's rows per slice
            _lead(lin.lora_a[slot, m.slice * rows:(m.slice + 1) * rows], a)
            start, end = lin.slice_starts[m.slice], lin.slice_starts[m.slice + 1]
            _lead(lin.lora_b[slot, start:end], b)
        if model.expert_lora_enabled is not None:
            model.expert_lora_enabled[:, slot] = expert_flags(adapter, model.expert_lora_enabled.shape[0])


def expert_flags(adapter: PeftAdapter, layers: int) -> torch.Tensor:
    """Per layer, 1 where the adapter has LoRA on that layer's experts (a dense layer's flag is unread)."""
    return torch.tensor([int(i in adapter.expert_layers) for i in range(layers)], dtype=torch.int32)


def _fused(moe, slot: int, linear: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """Every expert's LoRA from a fused-experts module, as vLLM's model manager splits it: A
    ``[E·r, K]`` -> ``[E, r, K]``, B ``[N, r·E]`` -> ``[N, r, E]`` -> ``[E, N, r]``; gate_up's one
    A serves both slices of w13, its B's first half the gate's outputs, its second the up's."""
    experts = moe.w13_a.shape[2]
    a3 = a.reshape(experts, -1, a.shape[-1])
    b3 = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)
    if linear == "w13":
        half = b3.shape[1] // 2
        for s, part in enumerate((b3[:, :half], b3[:, half:])):
            _lead(moe.w13_a[s, slot], a3)
            _lead(moe.w13_b[s, slot], part)
    else:
        _lead(moe.w2_a[0, slot], a3)
        _lead(moe.w2_b[0, slot], b3)


def _lead(dest: torch.Tensor, src: torch.Tensor) -> None:
    """``src``'s leading block of its last two axes into ``dest``'s (any leading axes equal)."""
    rows, cols = min(dest.shape[-2], src.shape[-2]), min(dest.shape[-1], src.shape[-1])
    dest[..., :rows, :cols].copy_(src[..., :rows, :cols])


def fill_slots(model: LlamaLoRA, adapters: Sequence[PeftAdapter]) -> None:
    """Slot i holds adapter i (i modulo their count, when there are fewer adapters than slots)."""
    cache: dict[int, dict[str, torch.Tensor]] = {}
    for slot in range(model.slot_rank.shape[0]):
        i = slot % len(adapters)
        if i not in cache:
            cache[i] = read_tensors(adapters[i])
        fill_slot(model, slot, adapters[i], cache[i])

