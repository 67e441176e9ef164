"""Plain-torch LoRA reference: the ground truth every kernel and every graph is tested against.

It reads only each token's slot, never the launch count or the sorted metadata, so it computes
what the batch *should* get whatever graph serves it. Math in float32.
"""

from functools import partial
from types import SimpleNamespace

import torch

from .meta import LoRAMeta

NEEDS_ZEROED_SCRATCH = False


def lora_delta(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slice_starts: tuple[int, ...],
    token_slot: torch.Tensor,
    scale: float,
    h_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The LoRA update of every token, float32 [T, N]; zero rows for base-model tokens.

    x: [T, K] inputs; lora_a: [L, S·R, K], or [L, S·R/TP, K] for one rank of fully sharded LoRA
    (its share of each slice's rank; the other ranks' shares, all-gathered in a server, count as
    zero here); lora_b: [L, N, R]; slice_starts: (0, ..., N), S+1 ints; token_slot: [T] slot per
    token (-1 = base model); scale: LoRA scaling (alpha / rank).
    """
    rank = lora_a.shape[1] // (len(slice_starts) - 1)  # A's rows per slice: R, or R / TP
    slot = token_slot[: x.shape[0]].long()
    delta = torch.zeros(x.shape[0], lora_b.shape[1], dtype=torch.float32, device=x.device)
    # One slot at a time: its tokens' rows through its own A and B (a per-token gather of A and B
    # would take T·(S·R·K + N·R) floats: 30 GB for a gate_up of 8192 prefill tokens).
    for s in torch.unique(slot).tolist():
        if s < 0:
            continue
        rows = (slot == s).nonzero().squeeze(1)
        h = scale * (x[rows].float() @ lora_a[s].float().T)  # [t, S·R]
        if h_dtype is not None:
            h = h.to(h_dtype).float()
        for i in range(len(slice_starts) - 1):
            n0, n1 = slice_starts[i], slice_starts[i + 1]
            delta[rows, n0:n1] = h[:, i * rank : (i + 1) * rank] @ lora_b[s, n0:n1, :rank].float().T
    return delta


def lora_apply(y, x, lora_a, lora_b, slice_starts, meta: LoRAMeta, launch_count, scale, scratch=None, rounded=False):
    """In-place reference update ``y += delta``; same signature as the kernel backends (``rounded``:
    the shrink's output in y's dtype, ``ROUNDED``)."""
    del launch_count, scratch  # the reference serves every adapter token, whatever the grid
    h_dtype = y.dtype if rounded else None
    y[:, : slice_starts[-1]] += lora_delta(x, lora_a, lora_b, slice_starts, meta.token_slot, scale, h_dtype).to(y.dtype)


def expert_lora_delta(call, token_slot: torch.Tensor, scale: float, h_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The expert LoRA update of every routed entry, float32 [T·top_k, S·N_s]: each entry of an
    adapter token (whose slot has expert LoRA, ``call.enabled``) gets its slot's A and B of the
    entry's expert, times its routing weight for w2 (``call.mul_weight``); zero rows otherwise.
    ``call``: a ``kernels.moe_lora.ExpertCall``; ``h_dtype`` as in ``lora_delta``."""
    tokens, top_k = call.topk_ids.shape
    slices, max_loras, experts = call.lora_a.shape[:3]
    entry = torch.arange(tokens * top_k, device=call.y.device)
    slot = token_slot[:tokens].long()[entry // top_k]
    expert = call.topk_ids.reshape(-1).long()
    use = (slot >= 0) & (expert >= 0) & (expert < experts)
    use &= call.enabled.long()[slot.clamp(0, max_loras - 1)] != 0
    s, e = slot.clamp(0, max_loras - 1), expert.clamp(0, experts - 1)
    x = (call.x if call.x_per_entry else call.x[entry // top_k]).float()
    parts = []
    for i in range(slices):
        h = scale * torch.einsum("tk,trk->tr", x, call.lora_a[i, s, e].float())
        if h_dtype is not None:
            h = h.to(h_dtype).float()
        parts.append(torch.einsum("tnr,tr->tn", call.lora_b[i, s, e].float(), h))
    delta = torch.cat(parts, dim=1) * use.float()[:, None]
    if call.mul_weight:
        delta = delta * call.topk_weights.reshape(-1, 1).float()
    return delta


def moe_lora_apply(call, meta: LoRAMeta, launch_count, scale, rounded=False) -> None:
    """In-place reference expert LoRA: every adapter entry served, whatever the grid (``rounded`` as
    in ``lora_apply``)."""
    del launch_count
    delta = expert_lora_delta(call, meta.token_slot, scale, call.y.dtype if rounded else None)
    call.y[:, : call.lora_b.shape[0] * call.lora_b.shape[3]] += delta.to(call.y.dtype)


# The reference with its shrink's output rounded to the model's dtype, as a kernel in that dtype
# may round it. It differs from the reference by rounding alone, so the two answers' distance is
# the error a correct kernel may show: the check's rounding floor (``runtime.check``).
ROUNDED = SimpleNamespace(lora_apply=partial(lora_apply, rounded=True),
                          moe_lora_apply=partial(moe_lora_apply, rounded=True), NEEDS_ZEROED_SCRATCH=NEEDS_ZEROED_SCRATCH)
