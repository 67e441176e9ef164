"""The shrink fused into SiLU·mul at prompt sizes (``prompt_shrink``): act as ``silu_mul``'s, h as
the separate shrink's, over token tiles that hold one prompt, several, shuffled tokens and
base-model tokens, at a launch count below the active count, K split or not; and a model's prompt
step with it against the reference."""

import random

import pytest
import torch
from conftest import DEVICE, HAS_CUDA
from lorabench.kernels import prompt_shrink
from lorabench.kernels.base_ops import silu_mul
from lorabench.kernels.prompt_shrink import PromptShrinkConfig
from test_producer_shrink import launched_slots, meta_of, rel, shrink_ref

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if HAS_CUDA else [])
TOL = {torch.float16: 3e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5 if not HAS_CUDA else 1e-4}
# h's tolerance: on a GPU the kernel's float32 dots are TF32 (about 1e-3 relative), as every kernel's here
DOT_TOL = {**{d: 3 * t for d, t in TOL.items()}, torch.float32: 5e-3 if HAS_CUDA else 3e-5}
FP32_DOT_TOL = 5e-3 if HAS_CUDA else 1e-5  # the same for float32 cases held to 1e-5 on the CPU


def prompts(lengths, slots) -> list[int]:
    """Each prompt's tokens in a row, of its slot (-1: the base model)."""
    return [s for n, s in zip(lengths, slots) for _ in range(n)]


BATCHES = {
    "one prompt": prompts([40], [2]),
    "prompts": prompts([13, 20, 5, 9], [0, -1, 2, 1]),  # tiles holding two or three slots, and base tokens
    "shuffled": random.Random(3).sample(prompts([12, 10, 9, 8], [0, 1, 2, -1]), 39),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("inter,parts", [(256, 1), (1100, 1), (1100, 3)])  # K split over 3 programs a tile
@pytest.mark.parametrize("launch", [0, 2])
def test_silu_mul_shrink_is_silu_mul_then_the_shrink(dtype, batch, inter, parts, launch):
    slots = BATCHES[batch]
    g = torch.Generator().manual_seed(inter)
    gu = torch.randn(len(slots), 2 * inter, generator=g).to(DEVICE, dtype)
    a = (torch.randn(3, 16, inter, generator=g) / inter**0.5).to(DEVICE, dtype)
    meta = meta_of(slots, 3)
    h = torch.zeros(len(slots), 20, dtype=torch.float32, device=DEVICE)  # wider, as the model's scratch
    wide = torch.zeros(len(slots), inter + 24, dtype=dtype, device=DEVICE)  # the extended GEMM's input
    out = prompt_shrink.silu_mul_shrink(gu, a, h, meta, launch, 0.5, 16, out=wide[:, :inter],
                                        config=PromptShrinkConfig(16, 128, parts))
    ref = silu_mul(gu, fused=False)
    assert out.data_ptr() == wide.data_ptr() and rel(out, ref) < TOL[dtype]
    assert wide[:, inter:].abs().sum() == 0 and h[:, 16:].abs().sum() == 0
    want = shrink_ref(ref, a, slots, launched_slots(meta, launch), 1, 16, 0.5)
    if launch == 0:  # nothing served: h untouched
        assert h.abs().sum() == 0
    else:
        assert want.abs().sum() > 0 and rel(h[:, :16], want) < DOT_TOL[dtype]
        assert all(h[t].abs().sum() == 0 for t, slot in enumerate(slots) if slot not in launched_slots(meta, launch))


def test_unpadded_never_reads_as_padding():
    """With each slot's own rank the rows of A past it (rounded up to 16) are never read: NaN there changes nothing."""
    slots = BATCHES["prompts"]
    inter, rank, own = 256, 32, (8, 32, 20)
    g = torch.Generator().manual_seed(4)
    gu = torch.randn(len(slots), 2 * inter, generator=g).to(DEVICE)
    a = torch.randn(3, rank, inter, generator=g).to(DEVICE) / inter**0.5
    clean = a.clone()
    for slot, r in enumerate(own):
        kept = min(rank, -(-r // 16) * 16)
        a[slot, r:kept] = 0
        clean[slot, r:] = 0
        a[slot, kept:] = float("nan")
    meta = meta_of(slots, 3, own)
    h = torch.zeros(len(slots), rank, dtype=torch.float32, device=DEVICE)
    out = prompt_shrink.silu_mul_shrink(gu, a, h, meta, 3, 0.5, rank, config=PromptShrinkConfig(16, 128, 2))
    assert torch.isfinite(h).all()
    assert rel(h, shrink_ref(out, clean, slots, launched_slots(meta, 3), 1, rank, 0.5)) < FP32_DOT_TOL


def test_fully_sharded_rows_fill_the_first_columns():
    """A TP rank's A of rank / TP rows (fully sharded LoRA) fills h's first columns; the rest are left as they are."""
    slots = BATCHES["one prompt"]
    g = torch.Generator().manual_seed(5)
    gu = torch.randn(len(slots), 512, generator=g).to(DEVICE)
    a = torch.randn(3, 8, 256, generator=g).to(DEVICE) / 16
    meta = meta_of(slots, 3)
    h = torch.full((len(slots), 16), 7.0, device=DEVICE)
    h[:, :8] = 0
    out = prompt_shrink.silu_mul_shrink(gu, a, h, meta, 1, 0.5, 16)
    assert rel(h[:, :8], shrink_ref(out, a, slots, {2}, 1, 8, 0.5)) < FP32_DOT_TOL and (h[:, 8:] == 7).all()


def test_refuses_what_it_cannot_hold():
    slots = BATCHES["one prompt"]
    meta = meta_of(slots, 3)
    gu = torch.randn(len(slots), 128, device=DEVICE)
    rows = prompt_shrink.MAX_ROWS + 16
    with pytest.raises(ValueError, match="at most"):
        prompt_shrink.silu_mul_shrink(gu, torch.randn(3, rows, 64, device=DEVICE),
                                      torch.zeros(len(slots), rows, device=DEVICE), meta, 1, 0.5, rows)
    with pytest.raises(ValueError, match="smaller"):
        prompt_shrink.silu_mul_shrink(gu, torch.randn(3, 16, 64, device=DEVICE),
                                      torch.zeros(len(slots) - 1, 16, device=DEVICE), meta, 1, 0.5, 16)


def test_a_prompt_step_shrinks_down_in_silu_mul(monkeypatch):
    """A gemm step above decode sizes on extended weights: SiLU·mul computes down's shrink (once a
    layer, its K in 2 parts that add into h: the step zeroes its scratch itself), and the logits
    match the reference backend's on prompts mixing adapters and the base model, step after step."""
    import lorabench.runtime.model as model_mod
    from lorabench.config.models import ModelConfig
    from lorabench.kernels import get_backend
    from lorabench.runtime.model import LlamaLoRA, LoRAStep

    tokens = 80
    cfg = ModelConfig("m", 2, 256, 4, 2, 2048, 96)
    assert prompt_shrink.default_config(tokens, cfg.intermediate).parts == 2
    model = LlamaLoRA(cfg, max_loras=3, rank=16, max_tokens=tokens, context_len=tokens + 8, dtype=torch.float32,
                      device=DEVICE, extended=True)
    model.fused = True
    calls = []
    real = prompt_shrink.silu_mul_shrink
    monkeypatch.setattr(model_mod.prompt_shrink, "silu_mul_shrink", lambda *a, **k: calls.append(1) or real(*a, **k))
    meta = meta_of(prompts([30, 20, 20, 10], [1, -1, 2, 0]), 3)
    ids, pos = torch.arange(tokens, device=DEVICE) % 96, torch.arange(tokens, device=DEVICE)
    want = model(ids, pos, LoRAStep(get_backend("reference"), meta, 3, 0.5)).float()
    assert (want - model(ids, pos, None).float()).abs().max() > 1e-3  # LoRA changed the logits
    tol = 1e-2 if DEVICE == "cuda" else 1e-3
    for _ in range(2):  # a second step on the scratch the first left
        got = model(ids, pos, LoRAStep(get_backend("gemm"), meta, 3, 0.5)).float()
        assert torch.allclose(got, want, rtol=tol, atol=tol)
    assert len(calls) == 2 * cfg.layers
