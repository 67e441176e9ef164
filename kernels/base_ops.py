"""Fused base-model ops for the decode step, each a Triton kernel with a plain-torch twin.

Without fusion a Llama layer's norms, rotary embedding, cache writes and SwiGLU are ~40 tiny
kernels; in a 32-layer decode graph their launch gaps alone add ~2.5 ms to a ~4 ms step, which
would make every LoRA overhead look smaller than a real server's. Fused, they are three kernels
per layer (as in vLLM). ``fused=False`` picks the torch twins (the CPU path and the tests' reference).

With ``pdl=True`` (and on sm90+, see ``launch.pdl_enabled``) a kernel is launched with PDL
and waits for its predecessor before anything else (``pdl_wait`` first): no work overlaps, but
its launch does. The model asks for it only after lorabench's LoRA kernels, which let their
dependents launch at once (``LETS_CONSUMER_LAUNCH``), so the consumer's launch hides behind the
LoRA kernel's run. Not after vLLM's: measured on an H200, PDL-launched base ops made vLLM's LoRA
steps ~0.08 ms slower, and the baseline must not pay for lorabench's launch scheme.
"""

import torch
import triton
import triton.language as tl

from .launch import cdiv, next_pow2, pdl_enabled, pdl_launch, pdl_wait


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,  # [T, H] residual stream in
    d_ptr,  # [T, H] delta to add first (ignored unless HAS_DELTA)
    w_ptr,  # [H] norm weight
    res_ptr,  # [T, H] out: x + delta
    out_ptr,  # [T, H] out: rmsnorm(x + delta) * w, rows ``stride_out`` apart
    H,  # hidden size
    stride_out,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,  # >= H
    USE_PDL: tl.constexpr,  # PDL-launched: wait for the predecessor first
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    h = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        h += tl.load(d_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
        h = h.to(res_ptr.dtype.element_ty)  # the residual stream is kept in the model's dtype
        tl.store(res_ptr + row * H + offs, h, mask=mask)
    hf = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / H + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    normed = (hf * inv).to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * stride_out + offs, normed.to(out_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(x, delta, weight, eps, fused=True, pdl=False, out=None):
    """(rmsnorm(x + delta) * weight, x + delta); ``delta`` may be None. x: [T, H] contiguous.
    out: [T, H] with contiguous rows to write the norm into (a view of a wider buffer: the
    extended GEMM's input, ``extended_gemm``); a new tensor when None."""
    if not fused:
        h = x if delta is None else x + delta
        hf = h.float()
        normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype) * weight
        return (normed if out is None else out.copy_(normed)), h
    t, hidden = x.shape
    res = torch.empty_like(x) if delta is not None else x
    out = torch.empty_like(x) if out is None else out
    pdl = pdl and pdl_enabled(x.device)
    _add_rmsnorm_kernel[(t,)](
        x, delta if delta is not None else x, weight, res, out, hidden, out.stride(0), eps,
        HAS_DELTA=delta is not None, BLOCK=next_pow2(hidden), USE_PDL=pdl, num_warps=8, **pdl_launch(pdl),
    )
    return out, res


@triton.jit
def _rope_cache_kernel(
    qkv_ptr,  # [T, (Hq + 2·Hkv)·D] fused projection output
    cos_ptr, sin_ptr,  # [context, D/2] tables
    pos_ptr,  # [T] position of each token
    rows_ptr,  # [T] cache row of each token (read only if HAS_ROWS)
    q_ptr,  # [T, Hq, D] out: rotated queries
    ck_ptr, cv_ptr,  # [rows, Hkv, context, D] caches, written at (row, head, pos); row = t unless HAS_ROWS
    stride_qkv,
    stride_c0, stride_c1, stride_c2,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    HAS_ROWS: tl.constexpr,  # a mixed step: token t's cache row is rows[t], not t
    USE_PDL: tl.constexpr,  # PDL-launched: wait for the predecessor first
):
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = tl.arange(0, D // 2)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * (D // 2) + half)
    sin = tl.load(sin_ptr + pos * (D // 2) + half)
    src = qkv_ptr + t * stride_qkv + head * D
    x1 = tl.load(src + half).to(tl.float32)
    x2 = tl.load(src + D // 2 + half).to(tl.float32)
    r1 = (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty)
    r2 = (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty)
    if head < HQ:
        q_dst = q_ptr + (t * HQ + head) * D
        tl.store(q_dst + half, r1)
        tl.store(q_dst + D // 2 + half, r2)
    else:
        kv = head - HQ
        row = t
        if HAS_ROWS:
            row = tl.load(rows_ptr + t).to(tl.int64)
        c_off = row * stride_c0 + kv * stride_c1 + pos * stride_c2
        tl.store(ck_ptr + c_off + half, r1)
        tl.store(ck_ptr + c_off + D // 2 + half, r2)
        v_src = qkv_ptr + t * stride_qkv + (HQ + HKV + kv) * D
        tl.store(cv_ptr + c_off + half, tl.load(v_src + half))
        tl.store(cv_ptr + c_off + D // 2 + half, tl.load(v_src + D // 2 + half))


def rope_and_cache(qkv, cos_table, sin_table, positions, cache_k, cache_v, heads, kv_heads, fused=True, pdl=False,
                   rows=None):
    """Rotary embedding on q and k (rotate-half form) and the new k, v written into the caches at
    each token's position. qkv: [T, (heads + 2·kv_heads)·D]; returns q [T, heads, D].
    rows: each token's cache row [T] (a mixed step's pieces); None: token t's row is t."""
    t = qkv.shape[0]
    d = cache_k.shape[-1]
    if not fused:
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        cos, sin = cos_table[positions], sin_table[positions]
        rows = torch.arange(t, device=qkv.device) if rows is None else rows
        cache_k[rows, :, positions] = rotate(k.reshape(t, kv_heads, d), cos, sin)
        cache_v[rows, :, positions] = v.reshape(t, kv_heads, d)
        return rotate(q.reshape(t, heads, d), cos, sin)
    q = torch.empty(t, heads, d, dtype=qkv.dtype, device=qkv.device)
    pdl = pdl and pdl_enabled(qkv.device)
    _rope_cache_kernel[(t, heads + kv_heads)](
        qkv, cos_table, sin_table, positions, positions if rows is None else rows, q, cache_k, cache_v,
        qkv.stride(0), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        HQ=heads, HKV=kv_heads, D=d, HAS_ROWS=rows is not None, USE_PDL=pdl, num_warps=1, **pdl_launch(pdl),
    )
    return q


def qk_rmsnorm(qkv, q_weight, k_weight, heads, kv_heads, eps):
    """Qwen3's per-head RMSNorm over q and k (v untouched), before RoPE: torch ops on the GPU
    too (a few small kernels per layer; no fused kernel for it yet). Returns a new qkv."""
    t, d = qkv.shape[0], q_weight.shape[0]
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q = torch.nn.functional.rms_norm(q.reshape(t, heads, d), (d,), q_weight, eps).reshape(t, heads * d)
    k = torch.nn.functional.rms_norm(k.reshape(t, kv_heads, d), (d,), k_weight, eps).reshape(t, kv_heads * d)
    return torch.cat([q, k, v], dim=-1)


def rotate(x, cos, sin):
    """Rotary embedding (rotate-half form) of x [T, heads, D] at each token's cos, sin [T, D/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, stride_out, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(gu_ptr + t * 2 * inter + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * 2 * inter + inter + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + offs, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up, fused=True, pdl=False, out=None):
    """SwiGLU: silu(gate) * up for gate_up = [gate | up], [T, 2·I] -> [T, I] (into ``out`` when
    given: [T, I] with contiguous rows, as ``add_rmsnorm``'s)."""
    if not fused:
        gate, up = gate_up.chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
        return act if out is None else out.copy_(act)
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=gate_up.dtype, device=gate_up.device) if out is None else out
    block = 1024
    pdl = pdl and pdl_enabled(gate_up.device)
    _silu_mul_kernel[(t, cdiv(two_i // 2, block))](gate_up, out, two_i // 2, out.stride(0), BLOCK=block, USE_PDL=pdl,
                                                          num_warps=4, **pdl_launch(pdl))
    return out


def qk_rmsnorm_full(qkv, q_weight, k_weight, eps):
    """OLMoE's q and k norms: one RMSNorm over all of q's features, one over all of k's (v
    untouched), before RoPE; torch ops. Returns a new qkv."""
    nq, nk = q_weight.shape[0], k_weight.shape[0]
    q, k, v = qkv.split([nq, nk, qkv.shape[1] - nq - nk], dim=-1)
    q = torch.nn.functional.rms_norm(q, (nq,), q_weight, eps)
    k = torch.nn.functional.rms_norm(k, (nk,), k_weight, eps)
    return torch.cat([q, k, v], dim=-1)
