"""Attention for a mixed step: decode tokens and prefill chunks side by side on one token axis.

Each piece of a step (``config.chunked.Piece``: a request's new tokens) sits at a run of the
step's token axis and owns a row of the KV cache, whose first ``context`` positions hold what the
request's earlier steps processed. Its new keys and values are written at positions
``context .. context + tokens``; its query i attends to the cache's first ``context + i + 1``
positions (its earlier context and its own chunk, causally). A decode token is a piece of one.

Pieces of one token (decode) run as one ``scaled_dot_product_attention`` call over their rows'
contexts (keys padded to the longest, a mask each); each longer piece (a prompt chunk) runs as its
own call with a lower-right causal mask, which torch serves with flash attention on a GPU in 16-bit
dtypes. (vLLM runs one varlen flash-attention kernel; torch has none that runs on the CPU too. One
padded call for all pieces, the first version, computed pieces x longest chunk x longest context
scores through a materialised mask: for a 2048-token chunk beside 15 decode tokens, 16x the
chunk's own.) Attention lies outside the captured graphs of a mixed step, as vLLM splits its
PIECEWISE graphs at attention.
"""

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from lorabench.config.chunked import Step


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
class _Plan:
    """A layout's index tensors on one device, made once per layout (attention runs every layer)."""

    token_rows: torch.Tensor  # [T] each token's cache row
    positions: torch.Tensor  # [T] each token's position in its request
    decode_tokens: torch.Tensor  # [P1] where the one-token pieces lie on the token axis
    decode_rows: torch.Tensor  # [P1] their cache rows
    decode_mask: torch.Tensor  # [P1, 1, 1, C]: the keys each sees (its context and itself)
    chunks: tuple[tuple[int, int, int, int], ...]  # (start, tokens, context, row) of each longer piece


@lru_cache(maxsize=16)
def _plan(layout: "MixedLayout", device: torch.device) -> _Plan:
    rows = torch.tensor(layout.rows, device=device)
    ones = [i for i, n in enumerate(layout.lengths) if n == 1]
    seen = [layout.contexts[i] + 1 for i in ones]
    keys = torch.arange(max(seen, default=1), device=device)
    mask = keys[None, :] < torch.tensor(seen, device=device, dtype=torch.long)[:, None]
    return _Plan(
        token_rows=torch.repeat_interleave(rows, torch.tensor(layout.lengths, device=device)),
        positions=layout.positions(device),
        decode_tokens=torch.tensor([layout.starts[i] for i in ones], device=device, dtype=torch.long),
        decode_rows=torch.tensor([layout.rows[i] for i in ones], device=device, dtype=torch.long),
        decode_mask=mask[:, None, None, :],
        chunks=tuple((s, n, c, r) for s, n, c, r in zip(layout.starts, layout.lengths, layout.contexts, layout.rows)
                     if n > 1),
    )


def attend(q, k, v, cache_k, cache_v, layout: MixedLayout) -> torch.Tensor:
    """Write each piece's k, v [T, KVH, D] into its cache row, then attention of q [T, H, D] over
    each piece's context and causal chunk: [T, H, D]. Caches [rows, KVH, context_len, D]."""
    t, heads, d = q.shape
    if t != layout.tokens or k.shape[0] != t or v.shape[0] != t:
        raise ValueError(f"{t} queries, {k.shape[0]} keys for a layout of {layout.tokens} tokens")
    if max(layout.rows) >= cache_k.shape[0]:
        raise ValueError(f"a piece in cache row {max(layout.rows)}, past the cache's {cache_k.shape[0]} rows")
    need = max(c + n for c, n in zip(layout.contexts, layout.lengths))
    if need > cache_k.shape[2]:
        raise ValueError(f"a piece reaches position {need}, past the cache's {cache_k.shape[2]}")
    plan = _plan(layout, q.device)
    cache_k[plan.token_rows, :, plan.positions] = k
    cache_v[plan.token_rows, :, plan.positions] = v
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
