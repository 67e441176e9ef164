"""The shrink fused into the op that produces its input (``producer_shrink``): the norm's and
SiLU·mul's outputs as the base ops', h as the separate shrink's, on batches mixing base-model and
adapter tokens at launch counts below the active count; and a whole model with it against its
reference."""

import pytest
import torch
from conftest import DEVICE, HAS_CUDA
from lorabench.kernels import get_backend, producer_shrink
from lorabench.kernels.base_ops import add_rmsnorm, silu_mul

from lorabench.config.models import ModelConfig
from lorabench.runtime.lora_meta import MetaBuffer
from lorabench.runtime.model import LlamaLoRA, LoRAStep

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if HAS_CUDA else [])
TOL = {torch.float16: 3e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5 if not HAS_CUDA else 1e-4}
SLOTS = [0, -1, 2, 1, 0, -1, 2]  # three active slots: at a launch count of 2 one slot's tokens are not served


def meta_of(slots, max_loras, slot_rank=None):
    buf = MetaBuffer(len(slots), max_loras, DEVICE)
    buf.load(buf.pack(slots)[0])
    return buf.meta if slot_rank is None else buf.meta._replace(
        slot_rank=torch.tensor(slot_rank, dtype=torch.int32, device=DEVICE))


def shrink_ref(x, a, slots, launched, slices, rank, scale):
    """h[t, s·R + r] = scale · x[t]·A[slot, s·RA + r] for tokens of launched slots (RA = A's rows per slice)."""
    rows = a.shape[1] // slices
    h = torch.zeros(x.shape[0], slices * rank, dtype=torch.float32, device=x.device)
    for t, slot in enumerate(slots):
        if slot in launched:
            part = scale * (a[slot].float() @ x[t].float())
            for s in range(slices):
                h[t, s * rank:s * rank + rows] = part[s * rows:(s + 1) * rows]
    return h


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def launched_slots(meta, launch):
    return set(meta.active_slots[:launch].tolist()) - {-1}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [96, 300])  # one chunk; two chunks, the last partial
@pytest.mark.parametrize("slices,rank,rows", [(3, 16, 16), (1, 100, 100), (2, 16, 8)])  # rows < rank: fully sharded
@pytest.mark.parametrize("launch", [0, 2, 3])
def test_norm_shrink_is_the_norm_then_the_shrink(dtype, hidden, slices, rank, rows, launch):
    g = torch.Generator().manual_seed(hidden + rank)
    x = torch.randn(len(SLOTS), hidden, generator=g).to(DEVICE, dtype)
    for delta in (None, torch.randn(len(SLOTS), hidden, generator=g).to(DEVICE, dtype)):
        w = (torch.rand(hidden, generator=g) + 0.5).to(DEVICE, dtype)
        a = (torch.randn(3, slices * rows, hidden, generator=g) / hidden**0.5).to(DEVICE, dtype)
        meta = meta_of(SLOTS, 3)
        h = torch.zeros(len(SLOTS) + 2, slices * rank + 5, dtype=torch.float32, device=DEVICE)  # wider, as the model's scratch
        out, res = producer_shrink.add_rmsnorm_shrink(x, delta, w, 1e-5, a, h, meta, launch, 0.5, rank, slices)
        ref_out, ref_res = add_rmsnorm(x, delta, w, 1e-5, fused=False)
        assert rel(out, ref_out) < TOL[dtype] and torch.equal(res, ref_res)
        want = shrink_ref(ref_out, a, SLOTS, launched_slots(meta, launch), slices, rank, 0.5)
        assert rel(h[:len(SLOTS), :slices * rank], want) < TOL[dtype] * 3
        assert h[len(SLOTS):].abs().sum() == 0 and h[:, slices * rank:].abs().sum() == 0
        served = launched_slots(meta, launch) if launch else set()
        assert len(served) == launch
        for t, slot in enumerate(SLOTS):  # base tokens and tokens of slots past the launch count get nothing
            if slot not in served:
                assert h[t].abs().sum() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [256, 1100])
def test_silu_mul_shrink_is_silu_mul_then_the_shrink(dtype, inter):
    g = torch.Generator().manual_seed(inter)
    gu = torch.randn(len(SLOTS), 2 * inter, generator=g).to(DEVICE, dtype)
    a = (torch.randn(3, 16, inter, generator=g) / inter**0.5).to(DEVICE, dtype)
    meta = meta_of(SLOTS, 3)
    h = torch.zeros(len(SLOTS), 16, dtype=torch.float32, device=DEVICE)
    out = producer_shrink.silu_mul_shrink(gu, a, h, meta, 3, 0.5, 16)
    ref = silu_mul(gu, fused=False)
    assert rel(out, ref) < TOL[dtype]
    assert rel(h, shrink_ref(ref, a, SLOTS, launched_slots(meta, 3), 1, 16, 0.5)) < TOL[dtype] * 3


def test_unpadded_never_reads_as_padding():
    """With each slot's own rank the rows of A past it (rounded up to 16) are never read: NaN there changes nothing."""
    hidden, rank, own = 128, 64, (8, 64, 20)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(len(SLOTS), hidden, generator=g).to(DEVICE)
    w = torch.ones(hidden, device=DEVICE)
    a = torch.randn(3, 2 * rank, hidden, generator=g).to(DEVICE) / hidden**0.5
    clean = a.clone()
    for slot, r in enumerate(own):
        kept = min(rank, -(-r // 16) * 16)
        for s in range(2):
            a[slot, s * rank + r:s * rank + kept] = 0
            clean[slot, s * rank + r:(s + 1) * rank] = 0
            a[slot, s * rank + kept:(s + 1) * rank] = float("nan")
    meta = meta_of(SLOTS, 3, own)
    h = torch.zeros(len(SLOTS), 2 * rank, dtype=torch.float32, device=DEVICE)
    out, _ = producer_shrink.add_rmsnorm_shrink(x, None, w, 1e-5, a, h, meta, 3, 0.5, rank, 2)
    assert torch.isfinite(h).all()
    assert rel(h, shrink_ref(out, clean, SLOTS, launched_slots(meta, 3), 2, rank, 0.5)) < 1e-5


def gemm_and_reference_logits(monkeypatch, slots, launch, layers, rank, spied):
    """A model whose base ops are the fused kernels (as on a GPU) run on ``slots`` under the
    reference backend, then under ``gemm``; the model, each backend's logits, and the names of
    the ``spied`` (module, function) pairs the gemm step called."""
    cfg = ModelConfig("m", layers, 256, 4, 2, 384, 96)
    model = LlamaLoRA(cfg, max_loras=launch, rank=rank, max_tokens=len(slots), context_len=8, dtype=torch.float32,
                      device=DEVICE)
    model.fused = True
    calls = []
    for mod, name in spied:
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    ids, pos = torch.arange(len(slots), device=DEVICE), torch.full((len(slots),), 7, device=DEVICE)
    outs = {}
    for name in ("reference", "gemm"):
        model.scratch.zero_()
        calls.clear()
        outs[name] = model(ids, pos, LoRAStep(get_backend(name), meta_of(slots, launch), launch, 0.5)).float()
    return model, outs, calls


@pytest.mark.e2e
def test_a_model_whose_norms_shrink_matches_its_reference(monkeypatch):
    """The gemm backend in a model whose base ops are the fused kernels (as on a GPU), at its cap of
    launched slots: its norms and SiLU·mul compute qkv's, gate_up's and down's shrinks; the logits
    match the reference's."""
    from lorabench.kernels import gemm_lora

    launch = gemm_lora.EPILOGUE_MAX_LAUNCH
    slots = [s % launch if s >= 0 else -1 for s in SLOTS]
    spied = [(producer_shrink, "add_rmsnorm_shrink"), (producer_shrink, "silu_mul_shrink")]
    model, outs, calls = gemm_and_reference_logits(monkeypatch, slots, launch, 2, 16, spied)
    assert calls.count("add_rmsnorm_shrink") == 2 * 2 and calls.count("silu_mul_shrink") == 2
    ids, pos = torch.arange(len(slots), device=DEVICE), torch.full((len(slots),), 7, device=DEVICE)
    base = model(ids, pos, None).float()
    assert (outs["reference"] - base).abs().max() > 1e-3  # LoRA changed the logits
    tol = 1e-2 if DEVICE == "cuda" else 1e-3
    assert torch.allclose(outs["gemm"], outs["reference"], rtol=tol, atol=tol)


@pytest.mark.e2e
@pytest.mark.parametrize("over", [False, True], ids=["at-the-cap", "over-the-cap"])
def test_the_model_shrinks_in_its_producers_only_where_its_gemm_runs(monkeypatch, over):
    """``gemm_lora.runs_gemm``: over at most ``EPILOGUE_MAX_LAUNCH`` launched slots a decode step's
    norms and SiLU·mul shrink and each linear is one ``linear_apply``; over more, no producer
    shrinks and each linear is cuBLAS and the pair. Every slot holds tokens; the logits match the
    reference backend's either way."""
    from lorabench.kernels import gemm_lora, triton_lora

    launch = gemm_lora.EPILOGUE_MAX_LAUNCH + (2 if over else 0)
    slots = [i % (launch + 1) - 1 for i in range(2 * (launch + 1))]  # base tokens and every slot's
    spied = [(producer_shrink, "add_rmsnorm_shrink"), (producer_shrink, "silu_mul_shrink"),
             (gemm_lora, "linear_apply"), (triton_lora, "lora_apply")]
    _, outs, calls = gemm_and_reference_logits(monkeypatch, slots, launch, 1, 8, spied)
    if over:
        assert calls.count("lora_apply") == 4 and not {"add_rmsnorm_shrink", "silu_mul_shrink", "linear_apply"} & set(calls)
    else:
        assert calls.count("linear_apply") == 4 and calls.count("add_rmsnorm_shrink") == 2 and "lora_apply" not in calls
    tol = 1e-2 if DEVICE == "cuda" else 1e-3
    assert torch.allclose(outs["gemm"], outs["reference"], rtol=tol, atol=tol)
