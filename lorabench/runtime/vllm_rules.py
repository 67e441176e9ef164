"""vLLM 0.33's multi-LoRA CUDA-graph rules, for its own kernels (``--kernels vllm``).

What vLLM's runner does, reproduced so that a sweep with this backend runs what ``vllm serve``
runs (``max`` = vLLM's default, ``pow2`` = ``--specialize-active-lora``):

- capture keys: ``get_captured_lora_counts(max_loras, specialize)`` = ``[max_loras + 1]``, or
  the powers of two <= max_loras plus ``max_loras + 1``; key 0 (no LoRA) always; every key for
  every capture size (``CudagraphDispatcher.initialize_cudagraph_keys``).
- capture: each key is captured over a dummy batch of ``key`` distinct adapters, cycling over
  the requests, no base requests (``maybe_select_dummy_loras``); ``LoRAKernelMeta.prepare_tensors``
  turns it into the grid the graph bakes in: the number of distinct ids in the mapping, rounded
  up in the keys when specialising, else ``max_loras + 1`` (``meta_args``).
- dispatch: the key is the number of distinct adapters among the batch's LoRA requests (base
  requests do not count), rounded up in the keys (``CudagraphDispatcher.dispatch``).
- metadata per step: the token->slot mapping goes to the device and ``prepare_tensors`` builds
  the sorted indices and per-adapter counts there; its count includes the base id -1.

So with ``pow2``, a batch of 2 adapters plus base requests takes the key-2 graph, captured with
grid 2, while its metadata lists 3 ids (-1 first): the last adapter gets no update. Whether
that happens is for ``lorabench check`` to show, not for this module to assume.

The other strategies (``dense``, explicit lists) are what vLLM would do with those keys
(plus ``max_loras + 1``, which it always captures) in place of its powers of two.
"""

import bisect

import torch

from lorabench.config.strategies import Strategy, Vllm
from lorabench.kernels.vllm_lora import VllmMeta, load_ops
from lorabench.runtime.dispatch import Route


def captured_lora_counts(max_loras: int, specialize: bool) -> list[int]:
    """vLLM 0.33's ``vllm.lora.utils.get_captured_lora_counts`` (tests compare the two)."""
    if not specialize:
        return [max_loras + 1]
    return [n for n in range(1, max_loras + 2) if (n & (n - 1)) == 0 or n == max_loras + 1]


def vllm_counts(strategy: Strategy, max_loras: int) -> list[int]:
    """vLLM's capture keys for a strategy: its default (``max``) -> no specialisation,
    ``--specialize-active-lora`` (``pow2``) -> vLLM's own list, anything else -> that strategy's
    counts plus ``max_loras + 1``."""
    if strategy.vllm is Vllm.DEFAULT:
        return captured_lora_counts(max_loras, False)
    if strategy.vllm is Vllm.SPECIALISE:
        return captured_lora_counts(max_loras, True)
    return sorted(set(strategy.counts(max_loras)) | {max_loras + 1})


def dummy_mapping(tokens: int, key: int, max_loras: int) -> list[int]:
    """The slots of vLLM's capture batch for a key (``maybe_select_dummy_loras``): one token per
    request, adapters assigned cyclically; key 0 -> all base; a key past max_loras cycles over
    every slot (vLLM's comment promises base tokens there too, its code adds none)."""
    if key == 0:
        return [-1] * tokens
    distinct = min(key, max_loras)
    return [i % distinct for i in range(tokens)]


class VllmRules:
    """Dispatcher rules with vLLM's metadata (``LoRAKernelMeta``), keys and capture batches."""

    def __init__(self, strategy: Strategy, max_loras: int, max_tokens: int, device):
        _, _, kernel_meta_cls, _ = load_ops()
        self.max_loras, self.device = max_loras, torch.device(device)
        self.specialize = strategy.vllm is not Vllm.DEFAULT
        self.counts = vllm_counts(strategy, max_loras)
        self.kernel_meta = kernel_meta_cls.make(max_loras, max_tokens, self.device, captured_lora_counts=self.counts)
        self.meta = VllmMeta(self.kernel_meta, self.specialize)
        self.mapping = torch.full((max_tokens,), -1, dtype=torch.int32, device=self.device)
        self.pin = self.device.type == "cuda"

    def keys(self, bucket: int) -> list[int]:
        """vLLM captures every key for every capture size, reachable or not."""
        return sorted({0} | set(self.counts), reverse=True)

    def key(self, n_active: int, bucket: int | None = None) -> int:
        if n_active == 0:
            return 0
        if not self.specialize:
            return self.max_loras + 1
        i = bisect.bisect_left(self.counts, n_active)
        return self.counts[i] if i < len(self.counts) else n_active

    def eager_key(self, n_active: int) -> int:
        return self.key(n_active)

    def pack(self, slots: list[int]) -> tuple[list[int], int]:
        """Host part: the slots themselves and the dispatch count (distinct adapters)."""
        return slots, len({s for s in slots if s >= 0})

    def load(self, slots: list[int]) -> None:
        """vLLM's per-step metadata: the mapping copied to the device, then ``prepare_tensors``
        there (sort, unique, cumsum; it synchronises with the device, as it does in vLLM)."""
        t = len(slots)
        host = torch.tensor(slots, dtype=torch.int32, pin_memory=self.pin)
        self.mapping[:t].copy_(host, non_blocking=self.pin)
        self.kernel_meta.prepare_tensors(self.mapping[:t])

    def grid(self, tokens: int) -> int:
        """The adapter dimension vLLM's ops launch with for the metadata now loaded."""
        if bool(self.kernel_meta.no_lora_flag_cpu[0]):
            return 0
        return int(self.kernel_meta.meta_args(tokens, self.specialize)[-1].item())

    def arm(self, tokens: int, key: int) -> int:
        """Load vLLM's capture batch for ``key``; returns the grid the graph will bake in."""
        self.load(dummy_mapping(tokens, key, self.max_loras))
        return self.grid(tokens) if key else 0

    def captured_meta(self, grid: int) -> VllmMeta:
        """For eager stand-ins of graphs (CPU): the ops get the grid capture saw, as a replayed
        graph does, instead of recomputing it from each batch's metadata."""
        return VllmMeta(self.kernel_meta, self.specialize, torch.tensor([grid], dtype=torch.int32))

    def eager_grid(self, route: Route) -> int:
        return self.grid(route.tokens) if route.launch else 0
