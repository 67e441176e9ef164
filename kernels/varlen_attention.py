"""Attention of a mixed step in one launch: decode tokens and prompt chunks, each over its own
cache row, causal within its chunk (a flash-attention forward over variable-length pieces).

A mixed step's attention runs between its PIECEWISE graphs, eagerly, every layer. Done with torch
ops it is one call per prompt chunk plus the decode tokens' call and their gathers: ~15 ops a
layer, whose launches (~1 ms a layer on the host) made a 128-token step on Llama-3.1-8B take
30-40 ms on an H100 where its kernels take ~7 ms. vLLM runs one varlen flash-attention kernel
there; this is lorabench's, one launch a layer, after ``base_ops.rope_and_cache`` (with ``rows``)
has written the step's keys and values into the caches.

The step is cut into blocks of ``block_tokens(group)`` consecutive tokens of one piece
(``blocks``); a program takes one block and one KV head, its rows the block's tokens times the
KV head's query heads (grouped-query heads share each key tile), and walks the keys of its
piece's cache row up to its last token's position with an online softmax.
"""

import torch
import triton
import triton.language as tl
from .launch import next_pow2

# Query rows a program takes (tokens x query heads per KV head): 128, or 64 without grouped heads,
# where 128 rows spilled registers in sm_90 compiles (the compile test checks each shape for spills).
ROWS, ROWS_MHA = 128, 64
BLOCK_N = 32  # keys per iteration: 64 spilled at 128 rows under 4 warps, and at 7 heads a KV head under 8


def block_tokens(group: int) -> int:
    """Tokens a block holds when each KV head serves ``group`` query heads (at least 1)."""
    g = next_pow2(group)
    return ROWS_MHA if g == 1 else max(1, ROWS // g)


def blocks(starts, lengths, contexts, rows, per_block: int) -> list[tuple[int, int, int, int]]:
    """The step's blocks, each (first token on the step's token axis, tokens, position of its
    first token in its request, cache row): a piece of n tokens is ceil(n / per_block) blocks."""
    out = []
    for start, n, ctx, row in zip(starts, lengths, contexts, rows):
        for j in range(0, n, per_block):
            out.append((start + j, min(per_block, n - j), ctx + j, row))
    return out


@triton.jit
def _varlen_attention_kernel(
    q_ptr,  # [T, HQ, D] rotated queries
    ck_ptr, cv_ptr,  # [rows, HKV, context, D] caches, holding this step's keys and values already
    out_ptr,  # [T, HQ, D] out
    blocks_ptr,  # [NB, 4] int64: (first token, tokens, position of the first token, cache row)
    stride_qt, stride_qh,  # q's token and head strides (D contiguous)
    stride_c0, stride_c1, stride_c2,  # the caches' row, head and position strides (D contiguous)
    stride_ot, stride_oh,  # out's token and head strides
    scale,  # softmax scale times log2(e): the softmax runs in base 2
    G: tl.constexpr,  # query heads per KV head
    G_PAD: tl.constexpr,  # G rounded up to a power of 2
    D: tl.constexpr,  # head size
    D_PAD: tl.constexpr,  # D rounded up to a power of 2
    BLOCK_T: tl.constexpr,  # tokens per block (BLOCK_T * G_PAD rows, at least 16)
    BLOCK_N: tl.constexpr,  # keys per iteration
    PRECISION: tl.constexpr,  # the dots' input precision: "ieee" for float32 (no TF32 rounding), "tf32" otherwise
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    first = tl.load(blocks_ptr + b * 4).to(tl.int64)
    n = tl.load(blocks_ptr + b * 4 + 1)
    pos0 = tl.load(blocks_ptr + b * 4 + 2)
    row = tl.load(blocks_ptr + b * 4 + 3).to(tl.int64)
    m = tl.arange(0, BLOCK_T * G_PAD)
    tok = m // G_PAD
    head = kvh * G + m % G_PAD
    valid = (tok < n) & (m % G_PAD < G)
    d = tl.arange(0, D_PAD)
    dmask = d < D
    q = tl.load(q_ptr + (first + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=valid[:, None] & dmask[None, :], other=0.0)
    qpos = pos0 + tok  # each row's position: it sees keys 0..qpos
    end = pos0 + n  # keys the block's last token sees
    cache = row * stride_c0 + kvh * stride_c1
    m_i = tl.full([BLOCK_T * G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_T * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_T * G_PAD, D_PAD], tl.float32)
    for k0 in range(0, end, BLOCK_N):
        kn = k0 + tl.arange(0, BLOCK_N)
        kv_mask = (kn < end)[:, None] & dmask[None, :]
        offs = cache + kn[:, None] * stride_c2 + d[None, :]
        k = tl.load(ck_ptr + offs, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(kn[None, :] <= qpos[:, None], s, float("-inf"))  # causal; key 0 is always seen
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(cv_ptr + offs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + (first + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & dmask[None, :])


def varlen_attention(q, cache_k, cache_v, block_table, out=None):
    """Attention of each of a step's tokens over its piece's cache row, causally: q [T, HQ, D]
    (rotated), caches [rows, HKV, context, D] (the step's keys and values written already),
    block_table [NB, 4] int64 on q's device (``blocks`` at ``block_tokens(HQ // HKV)`` tokens).
    Returns out [T, HQ, D] (written into ``out`` when given)."""
    t, heads, d = q.shape
    kv_heads = cache_k.shape[1]
    group = heads // kv_heads
    if d < 16 or q.stride(-1) != 1 or cache_k.stride(-1) != 1 or cache_v.stride() != cache_k.stride():
        raise ValueError(f"varlen_attention needs head size >= 16 (not {d}), each head contiguous, and caches alike")
    if out is None:
        out = torch.empty_like(q)
    if block_table.shape[0] == 0:
        return out
    per_block = block_tokens(group)
    _varlen_attention_kernel[(block_table.shape[0], kv_heads)](
        q, cache_k, cache_v, out, block_table,
        q.stride(0), q.stride(1), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        out.stride(0), out.stride(1), (d ** -0.5) * 1.4426950408889634,
        G=group, G_PAD=next_pow2(group), D=d, D_PAD=next_pow2(d),
        BLOCK_T=per_block, BLOCK_N=BLOCK_N, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=8 if per_block * next_pow2(group) >= 128 else 4,
    )
    return out
