"""The gemm backend's whole linear (``linear_apply``: base GEMM + bias + LoRA in its epilogue)
against plain torch, on batches mixing base-model and adapter tokens at every launch count."""

import random
from dataclasses import replace

import pytest
import torch
from conftest import DEVICE, HAS_CUDA
from lorabench.kernels import gemm_configs, gemm_lora
from lorabench.kernels.reference import lora_delta

from lorabench.runtime.lora_meta import MetaBuffer

# Triton's CPU interpreter returns garbage from bf16 dots (the kernels upcast there): bf16 on the GPU.
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if HAS_CUDA else [])
TOL = {torch.float16: 2e-2, torch.bfloat16: 3e-2, torch.float32: 5e-3 if HAS_CUDA else 1e-4}


@pytest.fixture(params=["walk", "gather"])
def epilogue(request, monkeypatch):
    """Both epilogues: the walk over the active slots (default) and the gathered one (each token
    its own slot's B), chosen through the default tiling."""
    if request.param == "gather":
        chosen = gemm_lora.config_for
        monkeypatch.setattr(gemm_lora, "config_for", lambda t, k, n: replace(chosen(t, k, n), gather=True))
        monkeypatch.setattr(gemm_lora, "FITTED", {})
    return request.param


def case(tokens, k, widths, rank, max_loras, dtype, base_frac=0.3, seed=0, bias=True, a_rows=None):
    """Inputs, weights and a batch; ``a_rows``: A's rows per slice (rank / TP: a fully sharded rank)."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    n = sum(widths)
    rows = a_rows or rank
    x = torch.randn(tokens, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b0 = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    a = (torch.randn(max_loras, len(widths) * rows, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(max_loras, n, rank, generator=g).to(DEVICE, dtype)
    slots = [-1 if rnd.random() < base_frac else rnd.randrange(max_loras) for _ in range(tokens)]
    return x, w, b0, a, b, slots


def starts_of(widths):
    return tuple([0] + [sum(widths[: i + 1]) for i in range(len(widths))])


def run(x, w, bias, a, b, slots, starts, max_loras, launch, rank=None):
    buf = MetaBuffer(x.shape[0], max_loras, DEVICE)
    buf.load(buf.pack(slots)[0])
    rank = rank or b.shape[2]
    scratch = torch.zeros(x.shape[0], (len(starts) - 1) * rank, dtype=torch.float32, device=DEVICE)
    y = gemm_lora.linear_apply(x, w, bias, a, b, starts, buf.meta, launch, 0.5, scratch)
    launched = set(buf.meta.active_slots[:launch].tolist()) - {-1}
    served = torch.tensor([s if s in launched else -1 for s in slots], device=DEVICE)
    ref = x.float() @ w.float().t() + (bias.float() if bias is not None else 0)
    return y, ref, served


def close(out, ref, dtype):
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert torch.isfinite(out).all() and err < TOL[dtype], err


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rank", [1, 8, 16, 100, 512])
def test_whole_linear_matches_torch_at_every_rank(dtype, rank, epilogue):
    widths = (40, 24, 24)  # q/k/v-like slices of unequal width, none a multiple of the N tile
    x, w, bias, a, b, slots = case(9, 96, widths, rank, 4, dtype, seed=rank)
    y, base, served = run(x, w, bias, a, b, slots, starts_of(widths), 4, 4)
    close(y, base + lora_delta(x, a, b, starts_of(widths), served, 0.5), dtype)
    # the LoRA is really there, and base-model rows carry none of it
    is_base = torch.tensor([s < 0 for s in slots], device=DEVICE)
    assert (y[~is_base].float() - base[~is_base]).abs().max() > 1e-2
    close(y[is_base], base[is_base], dtype)


@pytest.mark.parametrize("tokens", [1, 2, 17, 64, 130])  # one M tile of every decode size, and several (prefill)
@pytest.mark.parametrize("widths", [(72,), (48, 48), (32, 16, 16)], ids=["1slice", "2slices", "3slices"])
def test_token_counts_and_slices(tokens, widths, epilogue):
    x, w, bias, a, b, slots = case(tokens, 64, widths, 16, 4, torch.float16, seed=tokens)
    y, base, served = run(x, w, bias, a, b, slots, starts_of(widths), 4, 4)
    close(y, base + lora_delta(x, a, b, starts_of(widths), served, 0.5), torch.float16)


@pytest.mark.parametrize("launch", [1, 2, 3, 6])
def test_launch_count_below_the_active_count_serves_only_the_launched(launch, epilogue):
    """A graph launched for fewer slots than the batch holds serves the first ``launch`` active
    slots only (what a too-small grid does; the dispatcher must never let it happen)."""
    x, w, bias, a, b, _ = case(12, 64, (48, 16), 16, 6, torch.float32)
    slots = [0, 1, 2, 3, 4, 5, -1, 5, 4, 3, 2, 1]
    y, base, served = run(x, w, bias, a, b, slots, starts_of((48, 16)), 6, launch)
    assert len(set(served.tolist()) - {-1}) == launch
    close(y, base + lora_delta(x, a, b, starts_of((48, 16)), served, 0.5), torch.float32)


def test_unlaunched_tokens_get_nothing_even_with_an_h(epilogue):
    """The launch count gates the epilogue itself: an h handed in for every adapter token (as a
    producer's shrink may leave it) adds nothing for tokens whose slot was not launched."""
    x, w, bias, a, b, _ = case(8, 64, (48, 16), 16, 6, torch.float32)
    slots = [0, 1, 2, 3, 4, 5, -1, 2]
    buf = MetaBuffer(8, 6, DEVICE)
    buf.load(buf.pack(slots)[0])
    scratch = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    y = gemm_lora.linear_apply(x, w, bias, a, b, starts_of((48, 16)), buf.meta, 2, 0.5, scratch, shrunk=True)
    launched = set(buf.meta.active_slots[:2].tolist())
    ref = x.float() @ w.float().t() + bias.float()
    for t, slot in enumerate(slots):
        if slot in launched:
            ref[t, :48] += scratch[t, :16] @ b[slot, :48].float().t()
            ref[t, 48:] += scratch[t, 16:] @ b[slot, 48:].float().t()
    close(y, ref, torch.float32)


def test_one_adapter_token(epilogue):
    """The decode size the gathered epilogue is made for: one token, of an adapter."""
    x, w, bias, a, b, slots = case(1, 64, (32, 16, 16), 16, 4, torch.float16, base_frac=0.0, seed=3)
    y, base, served = run(x, w, bias, a, b, slots, starts_of((32, 16, 16)), 4, 4)
    assert served.tolist() == slots and slots[0] >= 0
    close(y, base + lora_delta(x, a, b, starts_of((32, 16, 16)), served, 0.5), torch.float16)


def test_launch_count_zero_is_the_base_gemm_alone():
    x, w, bias, a, b, slots = case(5, 64, (48,), 16, 2, torch.float32)
    y, base, _ = run(x, w, bias, a, b, slots, starts_of((48,)), 2, 0)
    close(y, base, torch.float32)
    close(gemm_lora.base_linear(x, w, bias), base, torch.float32)
    close(gemm_lora.base_linear(x, w), x.float() @ w.float().t(), torch.float32)


def test_many_slots_take_several_epilogue_steps(epilogue):
    """32 slots of rank 16 over 3 slices: 1536 slot-rank columns, 12 steps of the epilogue."""
    widths = (32, 16, 16)
    x, w, bias, a, b, _ = case(40, 32, widths, 16, 32, torch.float32, bias=False)
    slots = [t % 32 for t in range(32)] + [-1] * 8
    y, base, served = run(x, w, bias, a, b, slots, starts_of(widths), 32, 32)
    close(y, base + lora_delta(x, a, b, starts_of(widths), served, 0.5), torch.float32)


def test_all_base_tokens_and_no_bias(epilogue):
    x, w, _, a, b, _ = case(4, 64, (48,), 16, 2, torch.float16, bias=False)
    y, base, _ = run(x, w, None, a, b, [-1] * 4, starts_of((48,)), 2, 2)
    close(y, base, torch.float16)


def test_fully_sharded_shapes(epilogue):
    """A fully sharded rank: A holds R / TP rows per slice (the rest of h is other ranks'), and a
    row-parallel rank's LoRA updates only the first N / TP outputs (slices end before y does)."""
    x, w, bias, a, b, slots = case(6, 64, (32, 32), 16, 3, torch.float32, a_rows=8)
    y, base, served = run(x, w, bias, a, b, slots, starts_of((32, 32)), 3, 3)
    close(y, base + lora_delta(x, a, b, starts_of((32, 32)), served, 0.5), torch.float32)
    # row-parallel: 64 outputs, LoRA on the first 32
    x, w, bias, a, _, slots = case(6, 64, (64,), 16, 3, torch.float32)
    b = torch.randn(3, 32, 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    y, base, served = run(x, w, bias, a, b, slots, (0, 32), 3, 3)
    delta = lora_delta(x, a, b, (0, 32), served, 0.5)
    close(y[:, :32], base[:, :32] + delta, torch.float32)
    close(y[:, 32:], base[:, 32:], torch.float32)


@pytest.mark.parametrize("gather", [False, True], ids=["walk", "gather"])
@pytest.mark.parametrize("group_m", [1, 2, 3, 8])
def test_several_m_tiles_walked_in_groups(group_m, gather):
    """Prefill-like launches: 5 M tiles x 6 N tiles, walked GROUP_M M tiles at a time (the last
    group shorter): every output tile is computed once, by the right program."""
    widths = (40, 56)
    x, w, bias, a, b, slots = case(70, 64, widths, 16, 3, torch.float32, seed=7)
    buf = MetaBuffer(70, 3, DEVICE)
    buf.load(buf.pack(slots)[0])
    cfg = gemm_configs.GemmConfig(16, 16, 32, num_stages=2, group_m=group_m, gather=gather)
    scratch = torch.zeros(70, 2 * 16, dtype=torch.float32, device=DEVICE)
    y = gemm_lora.linear_apply(x, w, bias, a, b, starts_of(widths), buf.meta, 3, 0.5, scratch, config=cfg)
    served = torch.tensor(slots, device=DEVICE)
    ref = x.float() @ w.float().t() + bias.float() + lora_delta(x, a, b, starts_of(widths), served, 0.5)
    close(y, ref, torch.float32)


def test_a_tiling_past_shared_memory_steps_down_until_it_launches(monkeypatch):
    """A tiling the GPU cannot hold fails to launch (OutOfResources, before it runs): the launcher
    takes ``smaller`` tilings until one launches, and remembers it for that launch; a config
    asked for (a tune's) is not changed. Whether the compiler fits them is tests/compile_sm90.py's."""
    from triton.runtime.errors import OutOfResources

    kernel, tried = gemm_lora._gemm_lora_kernel, []

    class Fake:  # holds any tiling whose K step x stages is at most 256 (a stand-in for the GPU's limit)
        def __getitem__(self, grid):
            def launch(*args, **kw):
                tried.append((kw["BLOCK_K"], kw["num_stages"], kw["BLOCK_N"]))
                if kw["BLOCK_K"] * kw["num_stages"] > 256:
                    raise OutOfResources(kw["BLOCK_K"] * kw["num_stages"], 256, "shared memory")
                kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(gemm_lora, "_gemm_lora_kernel", Fake())
    monkeypatch.setattr(gemm_lora, "FITTED", {})
    x, w, bias, a, b, slots = case(9, 64, (40,), 16, 2, torch.float32)
    start = gemm_configs.default_config(9, 64, 40)
    y, base, served = run(x, w, bias, a, b, slots, starts_of((40,)), 2, 2)
    close(y, base + lora_delta(x, a, b, starts_of((40,)), served, 0.5), torch.float32)
    chain, cfg = [], start
    while cfg.block_k * cfg.num_stages > 256:
        chain.append((cfg.block_k, cfg.num_stages, cfg.block_n))
        cfg = gemm_configs.smaller(cfg)
    assert tried == chain + [(cfg.block_k, cfg.num_stages, cfg.block_n)] and len(chain) >= 2
    assert list(gemm_lora.FITTED.values()) == [cfg]
    tried.clear()
    run(x, w, bias, a, b, slots, starts_of((40,)), 2, 2)
    assert tried == [(cfg.block_k, cfg.num_stages, cfg.block_n)]  # remembered: no failed launch the second time
    with pytest.raises(OutOfResources):
        gemm_lora.linear_apply(x, w, bias, a, b, starts_of((40,)), MetaBuffer(9, 2, DEVICE).meta, 2, 0.5, config=start)


def test_smaller_tilings_end():
    """The steps down shrink K, then stages, then N, keep the M tile, and end."""
    for tokens in (1, 40, 8192):
        cfg, seen = gemm_configs.default_config(tokens, 4096, 4096), []
        while cfg is not None:
            seen.append(cfg)
            cfg = gemm_configs.smaller(cfg)
        assert len(seen) < 20 and seen[-1].block_k == 32 and seen[-1].num_stages == 2 and seen[-1].block_n == 16
        assert len({c.block_m for c in seen}) == 1
        assert all(c.block_k * c.num_stages * c.block_n > d.block_k * d.num_stages * d.block_n for c, d in zip(seen, seen[1:]))


def test_operands_need_a_contiguous_last_axis():
    x, w, bias, a, b, slots = case(4, 64, (32,), 16, 2, torch.float32)
    meta = MetaBuffer(4, 2, DEVICE).meta
    with pytest.raises(ValueError, match="weight's last axis"):
        gemm_lora.linear_apply(x, w.t().contiguous().t(), bias, a, b, starts_of((32,)), meta, 2, 0.5)
    with pytest.raises(ValueError, match="B's last axis"):
        gemm_lora.linear_apply(x, w, bias, a, b.transpose(1, 2).contiguous().transpose(1, 2), starts_of((32,)), meta, 2, 0.5)


def test_unpadded_epilogue_never_reads_bs_padding(epilogue):
    """With ``meta.slot_rank`` the epilogue leaves out each slot's B columns past its own rank
    (rounded up to 16): NaN there changes nothing (read, it would turn the row to NaN even times
    a zero h)."""
    rank, own = 64, (8, 64, 20)
    widths = (32, 16)
    x, w, bias, a, b, slots = case(7, 64, widths, rank, 3, torch.float32, base_frac=0.0, seed=5)
    for slot, r in enumerate(own):
        kept = min(rank, -(-r // 16) * 16)
        for s in range(len(widths)):
            a[slot, s * rank + r:(s + 1) * rank] = 0  # vLLM's zero padding
        b[slot, :, r:kept] = 0
        b[slot, :, kept:] = float("nan")
    buf = MetaBuffer(7, 3, DEVICE)
    buf.load(buf.pack(slots)[0])
    meta = buf.meta._replace(slot_rank=torch.tensor(own, dtype=torch.int32, device=DEVICE))
    scratch = torch.zeros(7, len(widths) * rank, dtype=torch.float32, device=DEVICE)
    y = gemm_lora.linear_apply(x, w, bias, a, b, starts_of(widths), meta, 3, 0.5, scratch)
    served = torch.tensor(slots, device=DEVICE)
    ref = x.float() @ w.float().t() + bias.float() + lora_delta(x, a, torch.nan_to_num(b, nan=0.0), starts_of(widths),
                                                               served, 0.5)
    close(y, ref, torch.float32)


@pytest.mark.parametrize("tokens, launch, in_gemm", [
    (gemm_lora.GEMM_MAX_TOKENS, gemm_lora.EPILOGUE_MAX_LAUNCH, True),
    (gemm_lora.GEMM_MAX_TOKENS + 1, gemm_lora.EPILOGUE_MAX_LAUNCH, False),
    (8, gemm_lora.EPILOGUE_MAX_LAUNCH + 1, False),
])
def test_the_model_takes_lora_in_the_gemm_at_decode_sizes_over_few_slots_else_the_pair(monkeypatch, tokens, launch,
                                                                                        in_gemm):
    """``runs_gemm``: up to ``GEMM_MAX_TOKENS`` and ``EPILOGUE_MAX_LAUNCH`` launched slots a
    gemm-backend linear is one ``linear_apply``; above either (prefill sizes, where its GEMM is
    slower than cuBLAS; many slots, where its epilogue's walk is slower than the pair) cuBLAS and
    the shrink + expand pair, whose result is the triton backend's to the bit."""
    from lorabench.kernels import get_backend, triton_lora
    from lorabench.runtime.model import LoRALinear, LoRAStep

    calls = []
    for mod, name in ((gemm_lora, "linear_apply"), (triton_lora, "lora_apply")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    slots = gemm_lora.EPILOGUE_MAX_LAUNCH + 1
    linear = LoRALinear(32, (24, 8), slots, 8, torch.float16, DEVICE, gen)
    buf = MetaBuffer(tokens, slots, DEVICE)
    buf.load(buf.pack([i % (launch + 1) - 1 for i in range(tokens)])[0])  # base tokens and every launched slot
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.float16)
    outs = {}
    for backend in ("gemm", "triton"):
        scratch = torch.zeros(tokens, 2 * 8, dtype=torch.float32, device=DEVICE)
        outs[backend] = linear(x, LoRAStep(get_backend(backend), buf.meta, launch, 0.5), scratch)
    assert calls[0] == ("linear_apply" if in_gemm else "lora_apply")
    if in_gemm:
        close(outs["gemm"], outs["triton"].float(), torch.float16)
    else:
        assert torch.equal(outs["gemm"], outs["triton"])
