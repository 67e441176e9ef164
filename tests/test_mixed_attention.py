"""Attention of a mixed step (decode tokens and prefill chunks with context) against a plain
per-token softmax, and the cache writes."""

import math

import pytest
import torch
from conftest import DEVICE
from lorabench.config.chunked import Piece, Step
from lorabench.runtime.mixed_attention import MixedLayout, attend


def reference(q, cache_k, cache_v, layout):
    """Token by token in float64: softmax over the positions its request's cache holds up to it."""
    out = torch.empty_like(q, dtype=torch.float64)
    heads, kv_heads, d = q.shape[1], cache_k.shape[1], q.shape[2]
    for start, n, ctx, row in zip(layout.starts, layout.lengths, layout.contexts, layout.rows):
        for i in range(n):
            seen = ctx + i + 1
            for h in range(heads):
                g = h // (heads // kv_heads)
                keys, vals = cache_k[row, g, :seen].double(), cache_v[row, g, :seen].double()
                w = torch.softmax(keys @ q[start + i, h].double() / math.sqrt(d), dim=0)
                out[start + i, h] = w @ vals
    return out


def step_of(*pieces):
    """A step of (tokens, context, prefill) pieces, requests 0, 1, ..."""
    return Step(tuple(Piece(i, -1, n, c, pre, True) for i, (n, c, pre) in enumerate(pieces)))


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("pieces", [
    ((1, 5, False), (1, 0, False), (1, 9, False)),  # decode only
    ((7, 0, True),),  # one prompt from the start
    ((1, 12, False), (5, 8, True), (1, 3, False), (4, 0, True)),  # decodes, a chunk with context, a new prompt
], ids=["decode", "prompt", "mixed"])
def test_attention_with_context_matches_a_plain_softmax(heads, kv_heads, pieces):
    g = torch.Generator().manual_seed(len(pieces) + heads)
    d, rows, ctx_len = 16, 6, 24
    step = step_of(*pieces)
    layout = MixedLayout.of(step, dict(enumerate((4, 0, 5, 2))))  # cache rows out of order
    t = layout.tokens
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
    cache_k, cache_v = (torch.randn(rows, kv_heads, ctx_len, d, generator=g) for _ in range(2))
    before = cache_k.clone()
    out = attend(q, k, v, cache_k, cache_v, layout)
    pos = layout.positions()
    assert pos.tolist() == [c + i for n, c, _ in pieces for i in range(n)]
    for tok, (row, p) in enumerate(zip(torch.repeat_interleave(torch.tensor(layout.rows), torch.tensor(layout.lengths)), pos)):
        assert torch.equal(cache_k[row, :, p], k[tok]) and torch.equal(cache_v[row, :, p], v[tok])
    written = torch.zeros_like(cache_k, dtype=torch.bool)
    for row, c, n in zip(layout.rows, layout.contexts, layout.lengths):
        written[row, :, c:c + n] = True
    assert torch.equal(cache_k[~written], before[~written])  # nothing else changed
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), reference(q, cache_k, cache_v, layout), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_in_16_bit_on_the_device(dtype):
    """The kernels torch picks for 16-bit inputs on the device (on a GPU: flash attention for the
    chunks' lower-right causal calls) against the float64 softmax: Llama-3.1-8B's heads (32 over 8
    KV heads of 128), a 300-token chunk with 200 cached beside decode tokens and a fresh prompt."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d, rows, ctx_len = 32, 8, 128, 6, 640
    step = step_of((1, 12, False), (300, 200, True), (1, 511, False), (37, 0, True), (1, 0, False))
    layout = MixedLayout.of(step, dict(enumerate((4, 0, 5, 2, 1))))
    t = layout.tokens
    q, k, v = (torch.randn(t, h, d, generator=g).to(DEVICE, dtype) for h in (heads, kv_heads, kv_heads))
    cache_k, cache_v = (torch.randn(rows, kv_heads, ctx_len, d, generator=g).to(DEVICE, dtype) for _ in range(2))
    out = attend(q, k, v, cache_k, cache_v, layout)
    assert out.dtype == dtype and out.device.type == torch.device(DEVICE).type
    ref = reference(q.cpu(), cache_k.cpu(), cache_v.cpu(), layout)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=2e-2, atol=2e-2)


def test_layouts_that_cannot_run_get_one_line():
    with pytest.raises(ValueError, match="share a cache row"):
        MixedLayout((0, 1), (1, 1), (0, 0), (3, 3))
    with pytest.raises(ValueError, match="side by side"):
        MixedLayout((0, 2), (1, 1), (0, 0), (0, 1))
    layout = MixedLayout.of(step_of((4, 22, True)), {0: 0})
    with pytest.raises(ValueError, match="past the cache's 24"):
        attend(torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), torch.zeros(1, 2, 24, 8),
               torch.zeros(1, 2, 24, 8), layout)
