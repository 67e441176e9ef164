"""LoRA kernels: Punica-style shrink (h = s·x·Aᵀ) then expand (y += h·Bᵀ), grouped by adapter slot.

Installed as ``lorabench.kernels``. Every backend computes, for a LoRA linear with slices
``slice_starts = (0, n0, n0+n1, ...)`` over a fused output ``y[T, N]``::

    for each token t whose slot is one of active_slots[:launch_count]:
        h = scale · A[slot] @ x[t]                     # [S·R]: the rank-R piece of every slice
        y[t, slice s] += B[slot][slice s] @ h[s·R:(s+1)·R]

Tokens of slot -1 (base model) are never touched. A token whose slot lies past the launch count
is not updated either: that is what a grid with too small an adapter dimension does, and the
graph dispatcher must never let it happen (tests prove it does not).

Weight layout (one tensor each, per LoRA linear):
    lora_a: [max_loras, S·R, K]   the slices' A matrices stacked along the rank axis
    lora_b: [max_loras, N, R]     the slices' B matrices stacked along the output axis
"""

import importlib
from typing import NamedTuple

import torch


class LoRAMeta(NamedTuple):
    """Per-step batch metadata, as device tensors (views of one packed int32 buffer).

    token_slot:   [T]           slot of every token, -1 for base-model tokens
    sorted_tokens:[T]           indices of adapter tokens grouped by active slot
    active_slots: [max_loras]   distinct slots of the batch's adapter tokens, padded with -1
    slot_start:   [max_loras+1] where each active slot's tokens begin in sorted_tokens
    """

    token_slot: torch.Tensor
    sorted_tokens: torch.Tensor
    active_slots: torch.Tensor
    slot_start: torch.Tensor


SUPPORTED_RANKS = (8, 16, 32, 64)
SUPPORTED_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
MAX_SLICES = 3


def get_backend(name: str):
    """A kernel backend: one module with ``lora_apply(y, x, lora_a, lora_b, slice_starts, meta,
    launch_count, scale, scratch)`` and ``NEEDS_ZEROED_SCRATCH`` (optionally ``LETS_CONSUMER_LAUNCH``:
    its kernels let the next kernel launch early, so the model PDL-launches the base ops). ``reference`` is the ground
    truth (it ignores the launch count), the others are what sweeps measure: ``triton`` (shrink
    + expand), ``fused`` (one launch per LoRA linear), ``torch``, and ``vllm``, which wraps
    vLLM's own ops and takes vLLM's metadata (``lorabench.vllm_rules``) instead of ``LoRAMeta``."""
    if name not in BACKENDS + ("reference",):
        raise ValueError(f"unknown kernel backend {name!r} (choose from {', '.join(BACKENDS)})")
    return importlib.import_module(f".{name}_lora" if name != "reference" else ".reference", __name__)


BACKENDS = ("triton", "fused", "torch", "vllm")
TUNABLE = ("triton", "fused", "vllm")  # backends `lorabench tune` writes configs for
TUNED = "+tuned"  # "fused+tuned": a backend run with the configs of a sweep's --tuned DIR


def backend_of(kernels: str) -> str:
    """The backend a kernels label runs: ``fused+tuned`` -> ``fused``."""
    return kernels.removesuffix(TUNED)
TRITON_BACKENDS = ("triton", "fused", "vllm")  # compiled on the GPU, run by Triton's interpreter on the CPU
