"""The extended GEMM (``extended_gemm``: LoRA as extra K columns of one cuBLAS GEMM) against plain
torch on batches mixing base-model and adapter tokens at every launch count, the step's packing
(hm by launch place, the launched slots' B in launch order) against a torch rendering of the
layout, and the model that holds its weights extended: which linears extend, steps above
``GEMM_MAX_TOKENS`` equal to the reference (graphs and PIECEWISE graphs checked, also after loads
that wrote B), steps below it bit-identical to an unextended model's."""

import random

import pytest
import torch
from conftest import DEVICE, HAS_CUDA
import lorabench.kernels as kernels
from lorabench.kernels import BACKENDS, extended_gemm, gemm_lora, get_backend
from lorabench.kernels.reference import lora_delta

from lorabench.config.models import resolve, shortened
from lorabench.config.strategies import capture_counts
from lorabench.runtime.adapters import AdapterLoader
from lorabench.runtime.check import check
from lorabench.runtime.dispatch import Dispatcher
from lorabench.runtime.load_paths import OneCopy
from lorabench.runtime.lora_meta import MetaBuffer
from lorabench.runtime.model import LlamaLoRA, LoRAStep

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if HAS_CUDA else [])
TOL = {torch.float16: 2e-2, torch.bfloat16: 3e-2, torch.float32: 5e-3 if HAS_CUDA else 1e-4}  # TF32 dots on the GPU


def extended_case(tokens, k, widths, rank, max_loras, dtype, seed=0, bias=True, base_frac=0.3, b_rows=None):
    """x written into an extended input, W and B's tail in one [N, K + E], and a batch; ``b_rows``:
    B's outputs when they end before N (a fully sharded row-parallel rank's share)."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    n = sum(widths)
    starts = tuple([0] + [sum(widths[: i + 1]) for i in range(len(widths))])
    if b_rows is not None:
        starts = (0, b_rows)
    x = torch.randn(tokens, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b0 = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    slices = len(starts) - 1
    a = (torch.randn(max_loras, slices * rank, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(max_loras, starts[-1], rank, generator=g).to(DEVICE, dtype)
    width = k + kernels.tail_width(slices, max_loras, rank)
    w_ext = torch.full((n, width), float("nan"), dtype=dtype, device=DEVICE)  # the tail: as it comes
    w_ext[:, :k] = w
    w_ext[:, k:] = 0  # what ``LoRALinear.extend`` allocates (the copies keep the off-diagonal zero)
    view = extended_gemm.input_buffer(tokens, k, width, dtype, DEVICE)
    view.copy_(x)
    x_ext = extended_gemm.extended_of(view, width)
    slots = [-1 if rnd.random() < base_frac else rnd.randrange(max_loras) for _ in range(tokens)]
    return x, w, b0, a, b, starts, w_ext, x_ext, slots


def run(case, max_loras, launch, rank):
    x, w, bias, a, b, starts, w_ext, x_ext, slots = case
    buf = MetaBuffer(x.shape[0], max_loras, DEVICE)
    buf.load(buf.pack(slots)[0])
    scratch = torch.zeros(x.shape[0], (len(starts) - 1) * rank, dtype=torch.float32, device=DEVICE)
    y = extended_gemm.extended_linear(x_ext, x.shape[1], w_ext, bias, a, b, starts, buf.meta, launch, 0.5, scratch)
    launched = set(buf.meta.active_slots[:launch].tolist()) - {-1}
    served = torch.tensor([s if s in launched else -1 for s in slots], device=DEVICE)
    ref = x.float() @ w.float().t() + (bias.float() if bias is not None else 0)
    ref[:, :starts[-1]] += lora_delta(x, a, b, starts, served, 0.5)
    return y, ref


def close(y, ref, dtype):
    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < TOL[dtype], err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("widths", [(48,), (40, 24), (24, 8, 8)])
@pytest.mark.parametrize("rank, max_loras", [(1, 3), (8, 4), (16, 1)])
def test_extended_linear_matches_torch_at_every_launch_count(dtype, widths, rank, max_loras):
    """Base tokens, served tokens and tokens past the launch count (no LoRA) in one step; launch
    counts up, then down (the tail's padding then holds B a wider launch left there)."""
    case = extended_case(37, 64, widths, rank, max_loras, dtype, seed=rank + len(widths))
    for launch in [*range(1, max_loras + 1), *range(max_loras - 1, 0, -1)]:
        y, ref = run(case, max_loras, launch, rank)
        close(y, ref, dtype)


def test_a_row_parallel_share_updates_its_outputs_only():
    """B ending before N (a fully sharded row-parallel rank): the rows past it get the base GEMM."""
    case = extended_case(9, 32, (64,), 8, 2, torch.float32, b_rows=16, base_frac=0.0)
    y, ref = run(case, 2, 2, 8)
    close(y, ref, torch.float32)
    w_ext = case[6]
    assert not w_ext[16:, 32:].any()


def packed_layout(h, b, starts, slots, active, launch, width):
    """What ``pack_step`` writes, in torch: hm [T, width] and the tail's first ``width`` columns."""
    slices, rank = len(starts) - 1, b.shape[2]
    hm = torch.zeros(len(slots), width)
    tail = torch.zeros(b.shape[1], width)
    launched = active[:launch]
    for t, slot in enumerate(slots):
        if slot >= 0 and slot in launched:
            j = launched.index(slot)
            hm[t, j * slices * rank:(j + 1) * slices * rank] = h[t, :slices * rank]
    for j, slot in enumerate(launched):
        for s in range(slices):
            col = (j * slices + s) * rank
            if slot >= 0:
                tail[starts[s]:starts[s + 1], col:col + rank] = b[slot, starts[s]:starts[s + 1]].float()
    return hm, tail


@pytest.mark.parametrize("widths, rank, max_loras", [((6,), 1, 3), ((2, 1, 3), 2, 2), ((40, 24), 8, 4), ((64,), 16, 5),
                                                     ((3, 2, 4), 64, 2), ((9,), 320, 2)])
def test_pack_step_writes_hm_and_the_launched_slots_b_in_launch_order(widths, rank, max_loras):
    """Base tokens, tokens past the launch count, a launch place whose active id is -1 (graphs
    launch more slots than a batch holds: zeros there), slices of odd sizes, a step width rounded
    up to ``TAIL_ALIGN``, widths of several packing blocks and ranks of several copying blocks
    (320); every column the GEMM reads is written, a stale tail and input overwritten, nothing
    past the step's width touched."""
    dtype = torch.float16 if HAS_CUDA else torch.float32
    g = torch.Generator().manual_seed(rank)
    starts = tuple([0] + [sum(widths[: i + 1]) for i in range(len(widths))])
    slices, k, tokens = len(widths), 24, 37
    b = torch.randn(max_loras, starts[-1], rank, generator=g).to(DEVICE, dtype)
    e = kernels.tail_width(slices, max_loras, rank)
    rnd = random.Random(rank)
    for used in range(1, max_loras + 1):  # active slots in the batch
        chosen = rnd.sample(range(max_loras), used)
        slots = [-1 if rnd.random() < 0.25 else rnd.choice(chosen) for _ in range(tokens)]
        buf = MetaBuffer(tokens, max_loras, DEVICE)
        buf.load(buf.pack(slots)[0])
        active = buf.meta.active_slots.tolist()
        h = torch.randn(tokens, slices * rank, generator=g).to(DEVICE, torch.float32)
        for launch in sorted({used, max_loras}):
            x_ext = torch.full((tokens, k + e), 7.0, dtype=dtype, device=DEVICE)
            tail = torch.full((starts[-1] + 3, e), 5.0, dtype=dtype, device=DEVICE)  # 3 rows past B's: a share's
            width = extended_gemm.pack_step(x_ext, k, tail, h, b, starts, buf.meta, launch)
            assert width == kernels.tail_width(slices, launch, rank) and width % kernels.TAIL_ALIGN == 0
            hm, want = packed_layout(h.cpu(), b.cpu(), starts, slots, active, launch, width)
            torch.testing.assert_close(x_ext[:, k:k + width].float().cpu(), hm.to(dtype).float())
            got = tail[:starts[-1], :width].float().cpu()
            on = torch.zeros_like(got, dtype=torch.bool)  # the blocks the copies own: the launched slots' slices
            for j in range(launch):
                for s in range(slices):
                    on[starts[s]:starts[s + 1], (j * slices + s) * rank:(j * slices + s + 1) * rank] = True
            assert torch.equal(got[on], want[on])
            assert (got[~on] == 5).all()  # off the diagonal: as allocated (zeros in the model)
            assert (x_ext[:, :k] == 7).all() and (x_ext[:, k + width:] == 7).all() and (tail[:, width:] == 5).all()
            assert (tail[starts[-1]:] == 5).all()


def test_pack_step_refuses_what_it_cannot_pack():
    """A tail too narrow for the launch, more launched than active ids, B shorter than its slices."""
    b = torch.zeros(3, 8, 4)
    buf = MetaBuffer(2, 3, "cpu")
    buf.load(buf.pack([0, 1])[0])
    with pytest.raises(ValueError, match="need 16 tail columns"):
        extended_gemm.pack_step(torch.zeros(2, 8 + 8), 8, torch.zeros(8, 8), torch.zeros(2, 4), b, (0, 8), buf.meta, 3)
    with pytest.raises(ValueError, match="launched of 3 active ids"):
        extended_gemm.pack_step(torch.zeros(2, 8 + 32), 8, torch.zeros(8, 32), torch.zeros(2, 4), b, (0, 8), buf.meta, 4)
    with pytest.raises(ValueError, match="B of 8 rows for slices ending at 9"):
        extended_gemm.pack_step(torch.zeros(2, 8 + 16), 8, torch.zeros(9, 16), torch.zeros(2, 4), b, (0, 9), buf.meta, 1)


def test_pack_step_copies_only_b_rows_inside_the_slices():
    """B with rows past the last slice's end: they are not the linear's, and go nowhere."""
    b = (torch.arange(2 * 24 * 4, dtype=torch.float32).view(2, 24, 4) + 1).to(DEVICE)
    buf = MetaBuffer(3, 2, DEVICE)
    buf.load(buf.pack([1, 1, -1])[0])
    e = kernels.tail_width(1, 1, 4)
    tail = torch.zeros(24, e, device=DEVICE)
    extended_gemm.pack_step(torch.zeros(3, 8 + e, device=DEVICE), 8, tail, torch.ones(3, 4, device=DEVICE), b, (0, 16),
                            buf.meta, 1)
    assert torch.equal(tail[:16, :4], b[1, :16]) and not tail[16:].any() and not tail[:, 4:].any()


def test_tail_widths_round_up_to_whole_alignments():
    assert kernels.tail_width(3, 3, 1) == 16 and kernels.tail_width(3, 4, 16) == 192
    assert kernels.tail_width(1, 1, 1) == 16 and kernels.tail_width(3, 3, 8) == 80 and kernels.tail_width(3, 2, 16) == 96
    assert kernels.tail_width(2, 0, 8) == 0


def test_extended_of_finds_only_an_extended_input():
    view = extended_gemm.input_buffer(5, 8, 12, torch.float32, "cpu")
    full = extended_gemm.extended_of(view, 12)
    assert full.shape == (5, 12) and full.data_ptr() == view.data_ptr()
    assert extended_gemm.extended_of(view[1:4], 12).data_ptr() == view[1:4].data_ptr()
    assert extended_gemm.extended_of(torch.empty(5, 8), 12) is None  # its own tensor
    assert extended_gemm.extended_of(torch.empty(5, 10)[:, :8], 12) is None  # another width


def test_a_linear_extends_only_where_its_tail_fits():
    """At rank 16 on llama-2-7b's shapes: qkv (3 slices) up to 10 slots, gate_up up to 16, o up to
    32, down (K = 11008) up to 86; ``EXTEND_MAX_FRACTION`` of K."""
    fits = lambda k, s, slots: kernels.extends(k, s, slots, 16)  # noqa: E731
    assert fits(4096, 3, 4) and fits(4096, 3, 10) and not fits(4096, 3, 11)
    assert fits(4096, 2, 16) and not fits(4096, 2, 17)
    assert fits(4096, 1, 32) and not fits(4096, 1, 33)
    assert fits(11008, 1, 86) and not fits(11008, 1, 87)


def test_the_registry_says_which_backends_extend():
    """``Backend.extends_k`` (what the memory estimate reads) is each module's ``EXTENDS_K``."""
    for name, info in BACKENDS.items():
        if name != "vllm":  # its module needs vLLM; it extends nothing
            assert info.extends_k == getattr(get_backend(name), "EXTENDS_K", False), name
    assert BACKENDS["gemm"].extends_k and not BACKENDS["vllm"].extends_k


def tiny(extended, max_loras=3, rank=8, max_tokens=80, layers=None, dtype=torch.float32, slot_ranks=()):
    return LlamaLoRA(shortened(resolve("tiny"), layers), max_loras=max_loras, rank=rank, max_tokens=max_tokens,
                     context_len=16, dtype=dtype, device=DEVICE, extended=extended, cache_rows=max_tokens + 6,
                     slot_ranks=slot_ranks)


@pytest.fixture
def roomy(monkeypatch):
    """The tiny model's K of 128 holds no tail within the real bound: allow any."""
    monkeypatch.setattr(kernels, "EXTEND_MAX_FRACTION", 8.0)


def test_an_extended_model_holds_its_weights_in_place(roomy):
    model = tiny(True)
    assert len(model.extended) == 4 * 2  # qkv, o, gate_up, down of both layers
    for m in model.extended:
        assert m.weight.data_ptr() == m.weight_ext.data_ptr() and m.weight.stride(0) == m.weight_ext.shape[1]
        assert not m.weight_ext[:, m.weight.shape[1]:].any()  # the tail: zeros until a step copies B
    plain = tiny(False)
    assert not plain.extended and all(m.weight_ext is None for m in plain.modules() if hasattr(m, "weight_ext"))
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        assert torch.equal(p, q), name  # the same weights, whatever their layout


def step(model, kernels, tokens, launch, seed=0):
    buf = MetaBuffer(tokens, 3, DEVICE)
    rnd = random.Random(seed)
    buf.load(buf.pack([rnd.choice([-1, 0, 1, 2]) for _ in range(tokens)])[0])
    ids = torch.arange(tokens, device=DEVICE) % model.cfg.vocab
    with torch.no_grad():
        return model(ids, torch.arange(tokens, device=DEVICE) % 16, LoRAStep(get_backend(kernels), buf.meta, launch, 0.5))


@pytest.mark.parametrize("launch", [1, 3])
def test_steps_above_gemm_max_tokens_take_the_extended_gemm(roomy, monkeypatch, launch):
    """Every linear of an extended model runs as one extended GEMM above ``GEMM_MAX_TOKENS`` (o's
    input copied in after attention); the step equals the pair's on an unextended model (the
    reference serves every active slot, whatever the launch count)."""
    calls = []
    real = extended_gemm.extended_linear
    monkeypatch.setattr(extended_gemm, "extended_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    tokens = gemm_lora.GEMM_MAX_TOKENS + 3
    got = step(tiny(True, layers=1), "gemm", tokens, launch)
    ref = step(tiny(False, layers=1), "triton", tokens, launch)
    assert len(calls) == 4
    tol = 5e-3 if HAS_CUDA else 1e-4  # TF32 dots in fp32 on the GPU
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


def test_steps_after_loads_read_the_loaded_b(roomy):
    """Loads by both paths (per slice, one copy) write B only; the next extended step copies the
    launched slots' B into the tails, so it equals the pair's on an unextended model with the same loads."""
    tokens, outs = gemm_lora.GEMM_MAX_TOKENS + 3, {}
    for kernels, extended in (("gemm", True), ("triton", False)):
        model = tiny(extended, layers=1)
        loader = AdapterLoader(model, bank=3)
        loader.load(0, 1)
        loader.load(1, 2)
        OneCopy(loader).load(2, 0)
        outs[kernels] = step(model, kernels, tokens, 3)
    tol = 5e-3 if HAS_CUDA else 1e-4
    torch.testing.assert_close(outs["gemm"], outs["triton"], rtol=tol, atol=tol)


@pytest.mark.usefixtures("epilogue_at_any_launch")  # its own GEMM at 3 launched slots
def test_steps_at_decode_sizes_are_those_of_an_unextended_model(roomy):
    """Up to ``GEMM_MAX_TOKENS`` the gemm backend's own GEMM reads the weight in place: the same
    step, to the bit."""
    tokens = 8
    torch.testing.assert_close(step(tiny(True, layers=1), "gemm", tokens, 3), step(tiny(False, layers=1), "gemm", tokens, 3),
                               rtol=0, atol=0)



def test_an_extended_model_passes_the_check_on_decode_and_mixed_graphs(roomy):
    """The check's decode and PIECEWISE keys past ``GEMM_MAX_TOKENS``, batches mixing base and
    adapter requests: every graph against the reference (which reads B, not the tails)."""
    top = gemm_lora.GEMM_MAX_TOKENS + 2
    model = tiny(True, max_loras=2, rank=8, max_tokens=top, layers=1, dtype=torch.float16 if HAS_CUDA else torch.float32)
    d = Dispatcher(model, get_backend("gemm"), max_loras=2, capture_sizes=[1, top], counts=capture_counts("pow2", 2),
                   use_graphs=HAS_CUDA, mixed_sizes=[top])
    d.warm_up()
    d.capture()
    d.capture_mixed()
    v = check(d, "float16" if HAS_CUDA else "float32")
    assert v.correct is True, v.detail
    assert v.graphs_checked == v.graphs_total and v.mixed_graphs_checked == v.mixed_graphs_total > 0
    for m in model.extended:
        m.lora_b.data.normal_()  # B written after capture (a load): the graphs copy it into the tails
    v = check(d, "float16" if HAS_CUDA else "float32")
    assert v.correct is True, v.detail


def test_the_check_sees_a_wrong_extended_gemm_in_its_graphs(roomy, monkeypatch):
    """An extended GEMM that doubles hm, captured into the graphs past ``GEMM_MAX_TOKENS``: the
    check fails there, not below."""
    real = extended_gemm.pack_step

    def doubled(x_ext, k, *args):
        width = real(x_ext, k, *args)
        x_ext[:, k:k + width] *= 2
        return width

    monkeypatch.setattr(extended_gemm, "pack_step", doubled)
    top = gemm_lora.GEMM_MAX_TOKENS + 2
    model = tiny(True, max_loras=2, rank=8, max_tokens=top, layers=1, dtype=torch.float16 if HAS_CUDA else torch.float32)
    d = Dispatcher(model, get_backend("gemm"), max_loras=2, capture_sizes=[1, top], counts=capture_counts("pow2", 2),
                   use_graphs=HAS_CUDA)
    d.warm_up()
    d.capture()
    v = check(d, "float16" if HAS_CUDA else "float32")
    assert v.correct is False and v.first.graph_tokens > gemm_lora.GEMM_MAX_TOKENS  # the smallest batch that shows it


@pytest.mark.parametrize("tp, fully_sharded", [(1, False), (2, True)])
def test_the_memory_estimate_counts_the_tails(tp, fully_sharded):
    """``config.limits`` counts every extended linear's tail as ``LoRALinear.extend`` allocates it,
    with the real bound: at rank 1 over 6 slots qkv's tail (18 columns, 32 rounded) is past 128/8,
    the others extend (a row-parallel share's one slice under fully sharded TP; at TP 2 o's tail of
    16 is past 64/8 too)."""
    from dataclasses import replace

    from lorabench.config.limits import Shape, model_bytes
    from lorabench.config.models import shard

    cfg = shard(replace(resolve("tiny"), layers=1), tp) if tp > 1 else shortened(resolve("tiny"), 1)
    model = LlamaLoRA(cfg, max_loras=6, rank=1, max_tokens=4, context_len=8, dtype=torch.float16, device="cpu",
                      extended=True, fully_sharded=fully_sharded)
    assert model.extended and model.layers[0].qkv not in model.extended
    real = sum(t.nbytes for t in model.parameters()) + sum(t.nbytes for t in model.buffers())
    tails = sum(m.weight_ext.nbytes - m.weight.nbytes for m in model.extended)
    shape = Shape(cfg, 6, 1, "float16", 4, 8, fully_sharded=fully_sharded)
    assert sum(model_bytes(replace(shape, extended=True))) == real + tails > sum(model_bytes(shape)) == real


def test_unpadded_adapters_of_mixed_ranks_take_the_extended_gemm(roomy):
    """``+unpadded`` (each slot's own rank, ``meta.slot_rank``) above ``GEMM_MAX_TOKENS``: the
    shrink leaves each slot's padding out and the tail's padded columns hold zeros, so the step is
    the pair's on an unextended model."""
    tokens, ranks = gemm_lora.GEMM_MAX_TOKENS + 5, (4, 8, 2)
    outs = {}
    for kernels, extended in (("gemm", True), ("triton", False)):
        model = tiny(extended, layers=1, slot_ranks=ranks)
        buf = MetaBuffer(tokens, 3, DEVICE)
        rnd = random.Random(3)
        buf.load(buf.pack([rnd.choice([-1, 0, 1, 2]) for _ in range(tokens)])[0])
        meta = buf.meta._replace(slot_rank=model.slot_rank)
        ids = torch.arange(tokens, device=DEVICE) % model.cfg.vocab
        with torch.no_grad():
            outs[kernels] = model(ids, torch.arange(tokens, device=DEVICE) % 16,
                                  LoRAStep(get_backend(kernels), meta, 3, 0.5))
    tol = 5e-3 if HAS_CUDA else 1e-4
    torch.testing.assert_close(outs["gemm"], outs["triton"], rtol=tol, atol=tol)


def test_a_moe_model_extends_its_attention_and_runs_its_experts_as_before(roomy, monkeypatch):
    """In a MoE model the attention's qkv and o take the extended GEMM above ``GEMM_MAX_TOKENS``;
    the experts' LoRA is the backend's own, as without the extension."""
    calls = []
    real = extended_gemm.extended_linear
    monkeypatch.setattr(extended_gemm, "extended_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    tokens = gemm_lora.GEMM_MAX_TOKENS + 2
    cfg = shortened(resolve("tiny-moe"), 1)
    outs = {}
    for kernels, extended in (("gemm", True), ("triton", False)):
        model = LlamaLoRA(cfg, max_loras=3, rank=8, max_tokens=tokens, context_len=16, dtype=torch.float32,
                          device=DEVICE, extended=extended, cache_rows=tokens + 6)
        outs[kernels] = step(model, kernels, tokens, 3)
    assert len(calls) == 2  # qkv and o
    tol = 5e-3 if HAS_CUDA else 1e-4
    torch.testing.assert_close(outs["gemm"], outs["triton"], rtol=tol, atol=tol)
