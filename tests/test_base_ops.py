"""The fused base-model ops against their plain-torch twins."""

import pytest
import torch
from conftest import DEVICE, HAS_CUDA

from lorabench.kernels.base_ops import add_rmsnorm, rope_and_cache, silu_mul

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if HAS_CUDA else [])
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}


def close(a, b, dtype):
    return ((a.float() - b.float()).norm() / b.float().norm()).item() < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("hidden", [96, 128])
def test_add_rmsnorm(dtype, with_delta, hidden):
    x = torch.randn(5, hidden, device=DEVICE).to(dtype)
    d = torch.randn(5, hidden, device=DEVICE).to(dtype) if with_delta else None
    w = torch.rand(hidden, device=DEVICE).to(dtype) + 0.5
    out, res = add_rmsnorm(x, d, w, 1e-5, fused=True)
    ref_out, ref_res = add_rmsnorm(x, d, w, 1e-5, fused=False)
    assert close(out, ref_out, dtype) and torch.allclose(res.float(), ref_res.float(), atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_rope_and_cache(dtype, heads, kv_heads):
    t, d, ctx = 3, 32, 16
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, device=DEVICE).to(dtype)
    angles = torch.rand(ctx, d // 2, device=DEVICE) * 6
    pos = torch.tensor([15, 3, 7], device=DEVICE)
    k, v = (torch.randn(4, kv_heads, ctx, d, device=DEVICE).to(dtype) for _ in range(2))
    caches = [k, v, k.clone(), v.clone()]
    q = rope_and_cache(qkv, angles.cos(), angles.sin(), pos, caches[0], caches[1], heads, kv_heads, fused=True)
    q_ref = rope_and_cache(qkv, angles.cos(), angles.sin(), pos, caches[2], caches[3], heads, kv_heads, fused=False)
    assert close(q, q_ref, dtype)
    assert close(caches[0], caches[2], dtype) and torch.equal(caches[1], caches[3])
    written = (torch.arange(3, device=DEVICE), slice(None), pos)
    assert torch.equal(caches[3][written], qkv.view(t, -1, d)[:, heads + kv_heads :])  # v stored as is


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [256, 1100])
def test_silu_mul(dtype, inter):
    gu = torch.randn(4, 2 * inter, device=DEVICE).to(dtype)
    assert close(silu_mul(gu, fused=True), silu_mul(gu, fused=False), dtype)
