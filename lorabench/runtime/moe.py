"""A mixture-of-experts MLP with expert LoRA, for the MoE layers of ``runtime.model``'s decoder.

One step, as vLLM's Triton MoE runs it (``kernels.moe_gemm``): router GEMM, softmax top-k
(renormalised as the config says), the entries grouped per expert in static blocks, the w13
grouped GEMM, SiLU·mul, the w2 grouped GEMM with the routing weights, the sum over each token's
top-k; a shared expert (Qwen2-MoE) runs beside it as a dense MLP with its own LoRA. Expert LoRA
updates the per-entry w13 and w2 outputs in place through the backend's ``moe_lora_apply``, or runs
inside the grouped GEMM where the backend has ``expert_gemm_lora`` (``gemm``), with vLLM's layout
(``moe_lora_shapes``).

The routing of the last step is kept in static buffers (``topk_ids``, ``topk_weights``): a graph
writes them, and ``reuse_routing`` replays it, so the check's reference runs each token through
the experts the tested graph chose. Otherwise a near-tie between two experts' router scores,
flipped by the rounding of another kernel's LoRA update upstream, would send one token to a
different expert and read as a wrong graph.
"""

import torch
import torch.nn.functional as F
from torch import nn

from lorabench.config.models import ModelConfig, moe_lora_shapes
from lorabench.kernels.base_ops import silu_mul
from lorabench.kernels.moe_align import align_blocks, moe_lora_align_block_size
from lorabench.kernels.moe_gemm import BLOCK_M, expert_gemm, route
from lorabench.kernels.expert_call import ExpertCall


def _randn(shape, std, dtype, device, gen):
    return (torch.randn(shape, device=device, dtype=torch.float32, generator=gen) * std).to(dtype)


def base_layout(topk_ids: torch.Tensor, experts: int, fused: bool):
    """The base MoE's blocks (``moe_align``'s layout with one slot holding every token)."""
    if fused:
        return align_blocks(topk_ids, experts, BLOCK_M)
    tokens = topk_ids.shape[0]
    one = torch.ones(1, dtype=torch.int32, device=topk_ids.device)
    return moe_lora_align_block_size(topk_ids, torch.zeros(tokens, dtype=torch.int32, device=topk_ids.device),
                                     one - 1, one, experts, BLOCK_M, 1)


def expert_weights(cfg: ModelConfig, dtype, device, gen) -> tuple[nn.Parameter, nn.Parameter]:
    """One MoE layer's routed-expert weights: w13 [E, 2·I, hidden] (gate and up), w2 [E, hidden, I]
    (``experts`` of ``MoEMLP``: one pair for every layer under ``MoE.shared_weights``)."""
    e, i, hidden = cfg.moe.experts, cfg.moe.intermediate, cfg.hidden
    return (nn.Parameter(_randn((e, 2 * i, hidden), hidden**-0.5, dtype, device, gen), False),
            nn.Parameter(_randn((e, hidden, i), i**-0.5, dtype, device, gen), False))


class MoEMLP(nn.Module):
    """Routed experts (and a shared expert where the config has one) with ``max_loras`` slots of
    expert LoRA. ``shared`` is a pair of the decoder's dense LoRA linears (gate_up, down) or None;
    ``experts`` the routed experts' (w13, w2) where the layers share one (else its own)."""

    def __init__(self, cfg: ModelConfig, max_loras: int, rank: int, max_tokens: int, dtype, device, gen, shared=None,
                 experts: tuple[nn.Parameter, nn.Parameter] | None = None):
        super().__init__()
        moe = cfg.moe
        self.cfg, self.moe = cfg, moe
        e, hidden = moe.experts, cfg.hidden
        self.router = nn.Parameter(_randn((e, hidden), hidden**-0.5, dtype, device, gen), False)
        self.w13, self.w2 = experts if experts is not None else expert_weights(cfg, dtype, device, gen)
        shapes = moe_lora_shapes(cfg, rank)
        for name, shape in shapes.items():  # [S, E, R, K] / [S, E, N, R] per slot -> [S, L, E, ...]
            s, rest = shape[0], shape[1:]
            std = rest[-1] ** -0.5 if name.endswith("_a") else rank**-0.5
            setattr(self, name, nn.Parameter(_randn((s, max_loras, *rest), std, dtype, device, gen), False))
        self.shared_gate_up, self.shared_down = shared if shared is not None else (None, None)
        self.shared_gate = (nn.Parameter(_randn((1, hidden), hidden**-0.5, dtype, device, gen), False)
                            if moe.shared_gate and shared is not None else None)
        self.register_buffer("topk_ids", torch.zeros((max_tokens, moe.top_k), dtype=torch.int64, device=device),
                             persistent=False)
        self.register_buffer("topk_weights", torch.zeros((max_tokens, moe.top_k), dtype=torch.float32, device=device),
                             persistent=False)

    def pad(self, slot_ranks: list[int], rank: int) -> None:
        """Zero every slot's rows of A and columns of B past its adapter's own rank."""
        for slot, r in enumerate(slot_ranks):
            if r < rank:
                self.w13_a.data[:, slot, :, r:] = 0
                self.w2_a.data[:, slot, :, r:] = 0
                self.w13_b.data[:, slot, ..., r:] = 0
                self.w2_b.data[:, slot, ..., r:] = 0

    def lora_bytes_per_slot(self) -> int:
        return sum(w[:, 0].nbytes for w in (self.w13_a, self.w13_b, self.w2_a, self.w2_b))

    @staticmethod
    def _project(x, w, lora_a, lora_b, ids, weights, w2: bool, layout, lora, enabled, fused: bool) -> torch.Tensor:
        """One grouped projection's per-entry output with its expert LoRA: w13 (x per token) or w2
        (x per entry, the routing weights multiplied in). A backend with ``expert_gemm_lora`` (``gemm``)
        runs both in one kernel; the others add ``moe_lora_apply``'s update to the GEMM's output."""
        call = ExpertCall(None, x, lora_a, lora_b, ids, weights, w2, layout, enabled)
        in_gemm = getattr(lora.backend, "expert_gemm_lora", None) if lora is not None else None
        if in_gemm is not None:
            return in_gemm(w, call, lora.meta, lora.launch_count, lora.scale)
        y = expert_gemm(x, w, ids, layout, routed=weights if w2 else None, x_per_entry=w2, fused=fused)
        if lora is not None:
            lora.backend.moe_lora_apply(call._replace(y=y), lora.meta, lora.launch_count, lora.scale)
        return y

    def forward(self, h, lora, scratch, enabled: torch.Tensor, reuse_routing: bool, fused: bool, pdl: bool):
        """h: the normed residual stream [T, hidden]; returns the MLP's output [T, hidden]."""
        t, moe = h.shape[0], self.moe
        ids, weights = self.topk_ids[:t], self.topk_weights[:t]
        if not reuse_routing:
            route(F.linear(h, self.router), moe.top_k, moe.renormalize, ids, weights, fused)
        layout = base_layout(ids, moe.experts, fused)
        gate_up = self._project(h, self.w13, self.w13_a, self.w13_b, ids, weights, False, layout, lora, enabled, fused)
        act = silu_mul(gate_up, fused)  # [T·top_k, I], per entry
        down = self._project(act, self.w2, self.w2_a, self.w2_b, ids, weights, True, layout, lora, enabled, fused)
        out = down.view(t, moe.top_k, -1).sum(dim=1)
        if self.shared_gate_up is not None:
            shared = self.shared_down(silu_mul(self.shared_gate_up(h, lora, scratch[2]), fused, pdl), lora, scratch[3])
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(F.linear(h, self.shared_gate))
            out = out + shared
        return out
