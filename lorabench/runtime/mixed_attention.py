"""Attention for a mixed step: decode tokens and prefill chunks side by side on one token axis.

Each piece of a step (``config.chunked.Piece``: a request's new tokens) sits at a run of the
step's token axis and owns a row of the KV cache, whose first ``context`` positions hold what the
request's earlier steps processed. Its new keys and values are written at positions
``context .. context + tokens``; its query i attends to the cache's first ``context + i + 1``
positions (its earlier context and its own chunk, causally). A decode token is a piece of one.

The pieces run as one padded ``scaled_dot_product_attention`` call: queries padded to the longest
piece, keys to the longest context, a mask per piece. (vLLM runs a varlen flash-attention kernel;
torch has none that runs on the CPU too, and attention lies outside the captured graphs of a mixed
step, as vLLM splits its PIECEWISE graphs at attention.)
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
    dev = q.device
    rows = torch.tensor(layout.rows, device=dev)
    token_rows = torch.repeat_interleave(rows, torch.tensor(layout.lengths, device=dev))
    pos = layout.positions(dev)
    cache_k[token_rows, :, pos] = k
    cache_v[token_rows, :, pos] = v

    pieces, longest = len(layout.lengths), max(layout.lengths)
    offs = torch.arange(longest, device=dev)
    lengths = torch.tensor(layout.lengths, device=dev)
    valid = offs[None, :] < lengths[:, None]  # [P, L]: a real query, not padding
    index = (torch.tensor(layout.starts, device=dev)[:, None] + offs[None, :]).clamp(max=t - 1)
    qp = q[index].permute(0, 2, 1, 3)  # [P, H, L, D]
    keys = torch.arange(need, device=dev)
    limit = torch.tensor(layout.contexts, device=dev)[:, None] + offs[None, :] + 1  # [P, L]: keys each query sees
    mask = keys[None, None, :] < limit[:, :, None]  # [P, L, C]
    mask = mask & valid[:, :, None] | (~valid[:, :, None] & (keys == 0))  # padding sees one key: no empty softmax
    out = F.scaled_dot_product_attention(qp, cache_k[rows, :, :need], cache_v[rows, :, :need], attn_mask=mask[:, None],
                                         enable_gqa=heads != cache_k.shape[1])
    return out.permute(0, 2, 1, 3)[valid]  # [T, H, D], in the step's token order
