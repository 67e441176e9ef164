"""Attention for a mixed step: decode tokens and prefill chunks side by side on one token axis.

Each piece of a step (``config.chunked.Piece``: a request's new tokens) sits at a run of the
step's token axis and owns a row of the KV cache, whose first ``context`` positions hold what the
request's earlier steps processed. Its new keys and values are written at positions
``context .. context + tokens``; its query i attends to the cache's first ``context + i + 1``
positions (its earlier context and its own chunk, causally). A decode token is a piece of one.

On a GPU a layer's mixed attention is two launches, as vLLM's is: ``base_ops.rope_and_cache``
(rotary q and k, k and v written into each token's cache row) and ``varlen_attention`` (every
piece's causal attention over its row), their index tensors made once per layout and copied in
without a sync (``index_of``, ``blocks_of``). Attention runs between a mixed step's PIECEWISE
graphs, eagerly, every layer, so its host cost is paid in every step.

``attend`` is the torch version (the CPU path, and the kernel's reference in the tests): pieces of
one token (decode) run as one ``scaled_dot_product_attention`` call over their rows' contexts
(keys padded to the longest, a mask each); each longer piece (a prompt chunk) runs as its own call
with a lower-right causal mask. (One padded call for all pieces, the first version, computed
pieces x longest chunk x longest context scores through a materialised mask.)
"""

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from lorabench.config.chunked import Step
from lorabench.kernels.varlen_attention import block_tokens, blocks


@dataclass(frozen=True)
class MixedLayout:
    """Where a step's pieces lie: on the step's token axis (``starts``, ``lengths``), in the cache
    (``rows``), and how much of their request the cache holds already (``contexts``)."""

    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    contexts: tuple[int, ...]
    rows: tuple[int, ...]

    @classmethod
    def of(cls, step: Step, row_of: dict[int, int]) -> "MixedLayout":
        """A step's layout, pieces in the step's order; ``row_of``: each request's cache row."""
        lengths = tuple(p.tokens for p in step.pieces)
        starts = tuple(sum(lengths[:i]) for i in range(len(lengths)))
        return cls(starts, lengths, tuple(p.context for p in step.pieces), tuple(row_of[p.request] for p in step.pieces))

    def __post_init__(self):
        if not len(self.starts) == len(self.lengths) == len(self.contexts) == len(self.rows):
            raise ValueError("a layout needs a start, a length, a context and a row for every piece")
        if list(self.starts) != [sum(self.lengths[:i]) for i in range(len(self.lengths))]:
            raise ValueError(f"pieces must lie side by side in order on the token axis: starts {self.starts}")
        if len(set(self.rows)) != len(self.rows):
            raise ValueError(f"two pieces share a cache row: {self.rows}")

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def positions(self, device=None) -> torch.Tensor:
        """Each token's position in its request (its RoPE position, its cache slot), int64 [T]."""
        return torch.cat([torch.arange(c, c + n, device=device) for c, n in zip(self.contexts, self.lengths)])


@dataclass(frozen=True)
class StepIndex:
    """A layout's per-token indices on one device, copied in at once from pinned memory without a
    sync (a blocking copy would stall the host until the GPU drained, every new layout)."""

    host: torch.Tensor  # what they were copied from: kept until the copy is done
    token_rows: torch.Tensor  # [T] each token's cache row
    positions: torch.Tensor  # [T] each token's position in its request
    last: torch.Tensor  # [P] each piece's last token on the step's token axis (the tokens a step samples)


def _to_device(values: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    host = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return host, host.to(device)
    host = host.pin_memory()
    return host, host.to(device, non_blocking=True)


@lru_cache(maxsize=64)
def index_of(layout: "MixedLayout", device: torch.device) -> StepIndex:
    """The layout's ``StepIndex`` on ``device`` (cached: a layout's steps and layers share it)."""
    t = layout.tokens
    rows = [r for r, n in zip(layout.rows, layout.lengths) for _ in range(n)]
    positions = [c + i for c, n in zip(layout.contexts, layout.lengths) for i in range(n)]
    last = [s + n - 1 for s, n in zip(layout.starts, layout.lengths)]
    host, dev = _to_device(rows + positions + last, device)
    return StepIndex(host, dev[:t], dev[t : 2 * t], dev[2 * t :])


@lru_cache(maxsize=64)
def blocks_of(layout: "MixedLayout", device: torch.device, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pinned host copy, [NB, 4] on ``device``): ``varlen_attention``'s blocks of this layout for a
    model with ``group`` query heads per KV head (the kernel's block size follows it)."""
    table = blocks(layout.starts, layout.lengths, layout.contexts, layout.rows, block_tokens(group))
    host, dev = _to_device([v for b in table for v in b], device)
    return host, dev.view(-1, 4)


@dataclass(frozen=True)
class _Plan:
    """The torch path's own index tensors of a layout on one device (beside its ``StepIndex``),
    made once per layout (attention runs every layer)."""

    decode_tokens: torch.Tensor  # [P1] where the one-token pieces lie on the token axis
    decode_rows: torch.Tensor  # [P1] their cache rows
    decode_mask: torch.Tensor  # [P1, 1, 1, C]: the keys each sees (its context and itself)
    chunks: tuple[tuple[int, int, int, int], ...]  # (start, tokens, context, row) of each longer piece


@lru_cache(maxsize=16)
def _plan(layout: "MixedLayout", device: torch.device) -> _Plan:
    ones = [i for i, n in enumerate(layout.lengths) if n == 1]
    seen = [layout.contexts[i] + 1 for i in ones]
    keys = torch.arange(max(seen, default=1), device=device)
    mask = keys[None, :] < torch.tensor(seen, device=device, dtype=torch.long)[:, None]
    return _Plan(
        decode_tokens=torch.tensor([layout.starts[i] for i in ones], device=device, dtype=torch.long),
        decode_rows=torch.tensor([layout.rows[i] for i in ones], device=device, dtype=torch.long),
        decode_mask=mask[:, None, None, :],
        chunks=tuple((s, n, c, r) for s, n, c, r in zip(layout.starts, layout.lengths, layout.contexts, layout.rows)
                     if n > 1),
    )


def check_layout(layout: MixedLayout, tokens: int, cache_shape) -> None:
    """One line for a step whose pieces its tokens or the caches [rows, KVH, context, D] cannot hold."""
    if tokens != layout.tokens:
        raise ValueError(f"{tokens} queries for a layout of {layout.tokens} tokens")
    if max(layout.rows) >= cache_shape[0]:
        raise ValueError(f"a piece in cache row {max(layout.rows)}, past the cache's {cache_shape[0]} rows")
    need = max(c + n for c, n in zip(layout.contexts, layout.lengths))
    if need > cache_shape[2]:
        raise ValueError(f"a piece reaches position {need}, past the cache's {cache_shape[2]}")


def attend(q, k, v, cache_k, cache_v, layout: MixedLayout) -> torch.Tensor:
    """Write each piece's k, v [T, KVH, D] into its cache row, then attention of q [T, H, D] over
    each piece's context and causal chunk: [T, H, D]. Caches [rows, KVH, context_len, D]."""
    t, heads, d = q.shape
    if k.shape[0] != t or v.shape[0] != t:
        raise ValueError(f"{t} queries, {k.shape[0]} keys for a layout of {layout.tokens} tokens")
    check_layout(layout, t, cache_k.shape)
    index, plan = index_of(layout, q.device), _plan(layout, q.device)
    cache_k[index.token_rows, :, index.positions] = k
    cache_v[index.token_rows, :, index.positions] = v
    out = torch.empty_like(q)
    group = heads // cache_k.shape[1]
    if len(plan.decode_tokens):
        seen = plan.decode_mask.shape[-1]
        rows = plan.decode_rows
        out[plan.decode_tokens] = F.scaled_dot_product_attention(
            q[plan.decode_tokens].unsqueeze(2), cache_k[rows, :, :seen], cache_v[rows, :, :seen],
            attn_mask=plan.decode_mask, enable_gqa=group > 1).squeeze(2)
    for start, n, ctx, row in plan.chunks:
        # K and V repeated per query head: the lower-right causal call's non-flash paths take no grouped heads
        kc = cache_k[row, :, : ctx + n].repeat_interleave(group, dim=0)
        vc = cache_v[row, :, : ctx + n].repeat_interleave(group, dim=0)
        qc = q[start : start + n].transpose(0, 1)  # [H, n, D]
        o = F.scaled_dot_product_attention(qc[None], kc[None], vc[None], attn_mask=causal_lower_right(n, ctx + n))
        out[start : start + n] = o[0].transpose(0, 1)
    return out
