"""The fused base-model ops against their plain-torch twins."""

import inspect

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


@pytest.mark.parametrize("backend, pdl", [("triton", True), ("fused", True), ("torch", False), (None, False)])
def test_model_pdl_launches_base_ops_only_after_lorabench_kernels(monkeypatch, backend, pdl):
    """The base ops are PDL-launched only in steps whose LoRA kernels let their consumer launch
    early (lorabench's); never in the n = 0 step nor after other backends' kernels, whose steps
    PDL-launched base ops slowed on the H200. (This checks the flag the model passes; what PDL
    does is tested on the GPU, by tests/test_graphs.py's captured graphs against the reference.)"""
    from lorabench.kernels import get_backend

    from lorabench.config.models import resolve
    from lorabench.runtime import model as model_mod
    from lorabench.runtime.lora_meta import MetaBuffer

    seen = []

    def recording(real):
        def call(*a, **kw):
            seen.append(inspect.signature(real).bind(*a, **kw).arguments.get("pdl", False))
            return real(*a, **kw)
        return call

    for name in ("add_rmsnorm", "rope_and_cache", "silu_mul"):
        monkeypatch.setattr(model_mod, name, recording(getattr(model_mod, name)))
    m = model_mod.LlamaLoRA(resolve("tiny"), max_loras=2, rank=8, max_tokens=2, context_len=8,
                            dtype=torch.float32, device=DEVICE)
    buf = MetaBuffer(2, 2, DEVICE)
    buf.load(buf.pack([0, -1])[0])
    step = model_mod.LoRAStep(get_backend(backend), buf.meta, 1, 0.5) if backend else None
    m(torch.tensor([1, 2], device=DEVICE), torch.tensor([3, 4], device=DEVICE), step)
    assert len(seen) == 2 * 4 + 1
    assert seen[0] is False, "the first norm follows the embedding gather, not a LoRA kernel"
    assert set(seen[1:]) == {pdl}


def test_the_gemm_backend_launches_without_pdl_from_32_tokens(monkeypatch):
    """``gemm_lora.PDL_MAX_TOKENS``: below it the gemm backend's shrink and GEMM and the base ops
    around them PDL-launch (where the GPU allows), from it up to ``GEMM_MAX_TOKENS`` none of them
    do, above (the pair's sizes) the base ops do again, and so they do over more launched slots
    than ``EPILOGUE_MAX_LAUNCH`` (the pair's too); other backends keep PDL at any size."""
    from lorabench.kernels import get_backend, gemm_lora
    from lorabench.runtime.model import LlamaLoRA, LoRAStep

    monkeypatch.setattr(gemm_lora, "pdl_enabled", lambda device: True)
    below, at = torch.zeros(gemm_lora.PDL_MAX_TOKENS - 1, 8), torch.zeros(gemm_lora.PDL_MAX_TOKENS, 8)
    assert gemm_lora.uses_pdl(below) and not gemm_lora.uses_pdl(at)
    many = LoRAStep(get_backend("gemm"), None, gemm_lora.EPILOGUE_MAX_LAUNCH + 1, 0.5)
    assert LlamaLoRA._pdl(many, gemm_lora.PDL_MAX_TOKENS)  # the pair's step
    gemm = LoRAStep(get_backend("gemm"), None, 1, 0.5)
    assert LlamaLoRA._pdl(gemm, gemm_lora.PDL_MAX_TOKENS - 1) and not LlamaLoRA._pdl(gemm, gemm_lora.PDL_MAX_TOKENS)
    assert not LlamaLoRA._pdl(gemm, gemm_lora.GEMM_MAX_TOKENS) and LlamaLoRA._pdl(gemm, gemm_lora.GEMM_MAX_TOKENS + 1)
    assert LlamaLoRA._pdl(LoRAStep(get_backend("triton"), None, 1, 0.5), 512)
    assert not LlamaLoRA._pdl(None, 1)
