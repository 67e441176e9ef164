"""Plain-torch LoRA reference: the ground truth every kernel and every graph is tested against.

It reads only each token's slot, never the launch count or the sorted metadata, so it computes
what the batch *should* get whatever graph serves it. Math in float32.
"""

import weakref
from functools import partial
from types import SimpleNamespace

import torch

from . import REFERENCE_SIDE_BY_SIDE_FLOATS, reference_side_by_side_floats
from .meta import LoRAMeta

NEEDS_ZEROED_SCRATCH = False


class _ActiveSlots:
    """The sorted slots a batch's tokens hold, read from the device once per batch: a step calls
    ``lora_delta`` once per LoRA linear and layer (128 times in Llama's 32 layers) with the same
    ``token_slot``, and each read is a host sync that stalls a GPU's queue. Kept for the last
    tensor object seen, while its version counter (bumped by every in-place torch write) is
    unchanged: a write that bypasses it (``.data``, numpy, a kernel or a graph replay writing the
    buffer) must not happen between two calls on the same tensor; lorabench's ``MetaBuffer.load``
    writes with ``copy_``. Inference-mode tensors have no version counter: not cached."""

    def __init__(self):
        self.entry = None  # (weak reference to the tensor, its version, tokens, slots): one value, so threads never mix two

    def __call__(self, token_slot: torch.Tensor, tokens: int) -> torch.Tensor:
        if token_slot.is_inference():
            return _slots_in(token_slot, tokens)
        entry = self.entry
        if entry is not None and entry[0]() is token_slot and entry[1:3] == (token_slot._version, tokens):
            return entry[3]
        slots = _slots_in(token_slot, tokens)
        self.entry = (weakref.ref(token_slot), token_slot._version, tokens, slots)
        return slots


def _slots_in(token_slot: torch.Tensor, tokens: int) -> torch.Tensor:
    """The distinct slots >= 0 of the first ``tokens`` entries, sorted (a host sync)."""
    slot = token_slot[:tokens]
    return torch.unique(slot[slot >= 0].long())


_active_slots = _ActiveSlots()


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
    token (-1 = base model); scale: LoRA scaling (alpha / rank); h_dtype: round the shrink's
    output to this dtype (None: keep float32).

    The batch's n active slots' A and B side by side, every token through all of them, each
    keeping its own slot's part: a few large matmuls instead of a few per slot (a per-token gather
    of A and B would take T·(S·R·K + N·R) floats: 30 GB for a gate_up of 8192 prefill tokens;
    this takes n·(S·R·K + N·R) + T·n·(S·R + R), the other slots' products being exact zeros in
    the expand). Past ``REFERENCE_SIDE_BY_SIDE_FLOATS`` of those (many slots at a high rank and
    many tokens) it goes slot by slot. Adapters must be finite: side by side, a NaN in one slot's
    B reaches every token (0 · NaN). token_slot must hold at least T entries.
    """
    tokens = x.shape[0]
    rank = lora_a.shape[1] // (len(slice_starts) - 1)  # A's rows per slice: R, or R / TP
    delta = torch.zeros(tokens, lora_b.shape[1], dtype=torch.float32, device=x.device)
    active = _active_slots(token_slot, tokens)
    n = active.numel()
    if n == 0:
        return delta
    slot = token_slot[:tokens].long()
    floats = reference_side_by_side_floats(tokens, x.shape[1], lora_b.shape[1], lora_a.shape[1], rank, n)
    if floats > REFERENCE_SIDE_BY_SIDE_FLOATS:
        return _slot_by_slot(delta, x, lora_a, lora_b, slice_starts, slot, active, rank, scale, h_dtype)
    served = slot >= 0
    # each token's slot's place among the active ones (base tokens: 0, masked below)
    where = torch.searchsorted(active, slot.clamp(min=0)).clamp(max=n - 1)
    a = lora_a[active].float()  # [n, S·R, K]
    h_all = (x.float() @ a.reshape(-1, a.shape[-1]).T).view(tokens, n, -1)  # [T, n, S·R]
    h = h_all.gather(1, where.view(tokens, 1, 1).expand(tokens, 1, h_all.shape[-1])).squeeze(1)
    h = scale * h * served[:, None]
    if h_dtype is not None:
        h = h.to(h_dtype).float()
    b = lora_b[active].float()  # [n, N, R]
    for i in range(len(slice_starts) - 1):
        n0, n1 = slice_starts[i], slice_starts[i + 1]
        spread = torch.zeros(tokens, n, rank, dtype=torch.float32, device=x.device)
        spread.scatter_(1, where.view(tokens, 1, 1).expand(tokens, 1, rank), h[:, None, i * rank : (i + 1) * rank])
        delta[:, n0:n1] = spread.view(tokens, n * rank) @ b[:, n0:n1, :rank].permute(0, 2, 1).reshape(n * rank, n1 - n0)
    return delta


def _slot_by_slot(delta, x, lora_a, lora_b, slice_starts, slot, active, rank, scale, h_dtype):
    """``lora_delta`` one active slot at a time (memory bounded by one slot's tokens and weights)."""
    for s in active.tolist():
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
    ``call``: a ``kernels.expert_call.ExpertCall``; ``h_dtype`` as in ``lora_delta``."""
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
