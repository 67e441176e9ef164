"""What a MoE layer hands an expert-LoRA backend for one projection (w13 or w2): ``ExpertCall``.

Weights as vLLM lays them out (``vllm/lora/layers/fused_moe.py``), slices stacked in front:
``A [S, L, E, R, K]``, ``B [S, L, E, N_s, R]``; the entries are the routed (token, expert) pairs,
``T · top_k`` of them, in the base MoE's layout of expert blocks.
"""

from typing import NamedTuple

import torch


class ExpertCall(NamedTuple):
    """One projection's expert LoRA in one MoE layer, as the model hands it to a backend."""

    y: torch.Tensor | None  # [T·top_k, S·N_s] per-entry output, updated in place (None: expert_gemm_lora makes it)
    x: torch.Tensor  # [T, K] (w13: per token) or [T·top_k, K] (w2: per entry)
    lora_a: torch.Tensor  # [S, L, E, R, K]
    lora_b: torch.Tensor  # [S, L, E, N_s, R]
    topk_ids: torch.Tensor  # [T, top_k] experts per token
    topk_weights: torch.Tensor  # [T, top_k] float32 routing weights
    mul_weight: bool  # w2: multiply each entry's update by its routing weight; w13: not
    layout: tuple  # the base MoE's (sorted ids [1, P], expert ids [1, M], padded count [1]), blocks of BLOCK_M
    enabled: torch.Tensor  # [L] int32, non-zero where the slot's adapter has expert LoRA

    @property
    def x_per_entry(self) -> bool:
        return self.mul_weight  # w2: its input is the per-entry SiLU·mul output

    def shrink_strides(self) -> tuple[int, ...]:
        """What a shrink reads, as the kernels take it: x's row stride, A's first four strides."""
        if self.x.stride(-1) != 1 or self.lora_a.stride(-1) != 1:
            raise ValueError("expert LoRA needs x and A contiguous in their last dimension")
        return (self.x.stride(0), *self.lora_a.stride()[:4])

    def expand_strides(self) -> tuple[int, ...]:
        """What an expand reads and writes: B's first four strides, y's row stride."""
        if self.lora_b.stride(-1) != 1 or self.y.stride(-1) != 1:
            raise ValueError("expert LoRA needs B and y contiguous in their last dimension")
        return (*self.lora_b.stride()[:4], self.y.stride(0))
