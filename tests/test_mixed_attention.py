"""Attention of a mixed step (decode tokens and prefill chunks with context) against a plain
per-token softmax, and the cache writes."""

import math

import pytest
import torch
from conftest import DEVICE, HAS_CUDA
from lorabench.config.chunked import Piece, Step
from lorabench.kernels.base_ops import rope_and_cache, rotate
from lorabench.kernels.varlen_attention import block_tokens, blocks, varlen_attention
from lorabench.runtime.mixed_attention import MixedLayout, attend, blocks_of, index_of


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
    ours = [cache_k.clone(), cache_v.clone()]
    out = attend(q, k, v, cache_k, cache_v, layout)
    assert out.dtype == dtype and out.device.type == torch.device(DEVICE).type
    ref = reference(q.cpu(), cache_k.cpu(), cache_v.cpu(), layout)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=2e-2, atol=2e-2)
    if dtype == torch.bfloat16 and not HAS_CUDA:
        return  # Triton's CPU interpreter returns garbage from bf16 dots: the kernel's bf16 runs on the GPU
    # the GPU path's kernel, its caches written as attend wrote them
    index = index_of(layout, q.device)
    ours[0][index.token_rows, :, index.positions], ours[1][index.token_rows, :, index.positions] = k, v
    table = blocks_of(layout, q.device, heads // kv_heads)[1]
    kernel = varlen_attention(q, *ours, table)
    assert kernel.dtype == dtype
    torch.testing.assert_close(kernel.cpu().double(), ref, rtol=2e-2, atol=2e-2)


def test_layouts_that_cannot_run_get_one_line():
    with pytest.raises(ValueError, match="share a cache row"):
        MixedLayout((0, 1), (1, 1), (0, 0), (3, 3))
    with pytest.raises(ValueError, match="side by side"):
        MixedLayout((0, 2), (1, 1), (0, 0), (0, 1))
    layout = MixedLayout.of(step_of((4, 22, True)), {0: 0})
    with pytest.raises(ValueError, match="past the cache's 24"):
        attend(torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), torch.zeros(1, 2, 24, 8),
               torch.zeros(1, 2, 24, 8), layout)


@pytest.mark.parametrize("heads,kv_heads,d", [(4, 4, 16), (8, 2, 32), (6, 1, 16), (7, 1, 32)],
                         ids=["mha", "gqa4", "gqa6", "gqa7"])
@pytest.mark.parametrize("pieces", [
    ((1, 5, False), (1, 0, False), (1, 9, False)),  # decode only
    ((70, 0, True),),  # one prompt from the start, longer than a block
    ((1, 12, False), (37, 8, True), (1, 3, False), (4, 0, True), (1, 0, False)),  # decodes, chunks with and without context
], ids=["decode", "prompt", "mixed"])
def test_the_varlen_kernel_matches_the_torch_attention(heads, kv_heads, d, pieces):
    """The GPU path (rotary and cache writes by ``rope_and_cache`` with rows, then one
    ``varlen_attention`` launch) against the torch path: the same caches, the same output."""
    g = torch.Generator().manual_seed(heads + len(pieces))
    rows, ctx_len = 6, 96
    layout = MixedLayout.of(step_of(*pieces), dict(enumerate((4, 0, 5, 2, 1))))
    t = layout.tokens
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(DEVICE)
    angles = (torch.rand(ctx_len, d // 2, generator=g) * 6).to(DEVICE)
    caches = [torch.randn(rows, kv_heads, ctx_len, d, generator=g).to(DEVICE) for _ in range(2)]
    ours = [c.clone() for c in caches]
    index = index_of(layout, qkv.device)
    q = rope_and_cache(qkv, angles.cos(), angles.sin(), index.positions, *ours, heads, kv_heads, fused=True,
                       rows=index.token_rows)
    table = blocks_of(layout, qkv.device, heads // kv_heads)[1]
    out = varlen_attention(q, *ours, table)
    qt, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    cos, sin = angles.cos()[index.positions], angles.sin()[index.positions]
    expected = attend(rotate(qt.reshape(t, heads, d), cos, sin), rotate(k.reshape(t, kv_heads, d), cos, sin),
                      v.reshape(t, kv_heads, d), *caches, layout)
    torch.testing.assert_close(ours[0], caches[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(ours[1], caches[1])
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_blocks_cut_each_piece_at_the_block_size():
    assert blocks((0, 1, 6), (1, 5, 3), (9, 2, 0), (3, 0, 1), per_block=2) == [
        (0, 1, 9, 3), (1, 2, 2, 0), (3, 2, 4, 0), (5, 1, 6, 0), (6, 2, 0, 1), (8, 1, 2, 1)]
    assert block_tokens(1) == 64 and block_tokens(4) == 32 and block_tokens(7) == 16 and block_tokens(256) == 1


def test_a_layouts_index_is_each_tokens_row_position_and_each_pieces_last_token():
    layout = MixedLayout.of(step_of((1, 4, False), (3, 2, True)), {0: 5, 1: 2})
    index = index_of(layout, torch.device("cpu"))
    assert index.token_rows.tolist() == [5, 2, 2, 2]
    assert index.positions.tolist() == [4, 2, 3, 4] == layout.positions().tolist()
    assert index.last.tolist() == [0, 3]
