"""Models from real config.json files, one tensor-parallel rank's shapes, and the kernels at
those shapes: sharded as vLLM shards LoRA, recombined, against the unsharded reference."""

import json
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, HAS_CUDA
from lorabench.kernels import get_backend
from lorabench.kernels.reference import lora_delta

from lorabench.config.models import (
    PRESETS,
    SHIPPED,
    ModelConfig,
    lora_linears,
    lora_shares,
    resolve,
    shard,
    shortened,
)
from lorabench.errors import UserError
from lorabench.runtime.lora_meta import MetaBuffer

CONFIGS = Path(__file__).parent / "data" / "configs"

# (preset, layers, hidden, heads, kv heads, head_dim, intermediate, vocab, rope_theta, qkv bias, qk norm)
REAL = [
    ("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, 500000.0, False, False),
    ("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256, 500000.0, False, False),
    ("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, 1e6, True, False),
    ("mistral-7b-v0.3", 32, 4096, 32, 8, 128, 14336, 32768, 1e6, False, False),
    ("mistral-nemo-12b", 40, 5120, 32, 8, 128, 14336, 131072, 1e6, False, False),  # head_dim 128, not 5120 / 32
    ("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936, 1e6, False, True),
]


@pytest.mark.parametrize("case", REAL, ids=[c[0] for c in REAL])
def test_shipped_configs_parse_to_their_published_shapes(case):
    name, layers, hidden, heads, kv, d, inter, vocab, theta, bias, qk_norm = case
    cfg = resolve(name)
    assert (cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.intermediate, cfg.vocab) == (
        layers, hidden, heads, kv, d, inter, vocab)
    assert (cfg.rope_theta, cfg.qkv_bias, cfg.qk_norm) == (theta, bias, qk_norm)
    assert name in PRESETS and name in SHIPPED


def test_llama_3_1_rope_scaling_is_recorded():
    assert resolve("llama-3.1-8b").rope_scaling == "llama3"
    assert resolve("qwen2.5-7b").rope_scaling is None


def test_a_config_json_path_and_a_folder(tmp_path):
    src = Path(__file__).parents[1] / "lorabench" / "config" / "model_configs" / "qwen2.5-7b.json"
    folder = tmp_path / "Qwen2.5-7B-Instruct"
    folder.mkdir()
    (folder / "config.json").write_text(src.read_text())
    by_folder, by_file = resolve(str(folder)), resolve(str(folder / "config.json"))
    assert by_folder.name == by_file.name == "Qwen2.5-7B-Instruct"
    assert by_folder == by_file and by_folder.source == str(folder / "config.json")
    assert (by_folder.hidden, by_folder.intermediate) == (3584, 18944)


def test_omitted_fields_take_transformers_defaults(tmp_path):
    """No num_key_value_heads: as many KV heads as heads (plain multi-head attention)."""
    raw = json.loads((Path(__file__).parents[1] / "lorabench/config/model_configs/llama-3.1-8b.json").read_text())
    del raw["num_key_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert resolve(str(tmp_path)).kv_heads == 32


@pytest.mark.parametrize("bad,says", [
    ("gpt2.json", "GPT2LMHeadModel; lorabench builds Llama-style dense decoders"),
])
def test_other_architectures_are_refused_naming_what_is_built(bad, says):
    with pytest.raises(UserError) as e:
        resolve(str(CONFIGS / bad))
    assert says in str(e.value) and "Qwen2ForCausalLM" in str(e.value)
    assert str(e.value).startswith("--model: ") and "\n" not in str(e.value)


def test_bad_model_values_get_one_line(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    for value, says in [("nope", "is not a preset"), (str(tmp_path), "without a config.json"), ("x" * 5000, "--model: 'xxx"),
                        (str(tmp_path / "broken.json"), "not a readable JSON config")]:
        with pytest.raises(UserError, match=says):
            resolve(value)


def test_a_hub_id_offline_without_a_cache_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(UserError, match="cannot read no-such-org/no-such-model's config: not in the local Hugging Face cache"):
        resolve("no-such-org/no-such-model")


def test_a_hub_id_unreachable_is_one_line_at_once(monkeypatch, tmp_path):
    """Offline without HF_HUB_OFFLINE: refused when the Hub's host does not resolve, not after
    the Hub client's retries."""
    import socket

    def no_dns(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    with pytest.raises(UserError, match="no-such-org/no-such-model is not in the local Hugging Face cache and "
                                        ".* cannot be reached") as e:
        resolve("no-such-org/no-such-model")
    assert "\n" not in str(e.value)


def test_layers_shorten_and_cannot_lengthen():
    assert shortened(resolve("qwen2.5-7b"), 2).layers == 2
    with pytest.raises(UserError, match="more than qwen2.5-7b's 28 layers"):
        shortened(resolve("qwen2.5-7b"), 29)


@pytest.mark.parametrize("name,tp,heads,kv,inter,vocab", [
    ("llama-3.1-70b", 4, 16, 2, 7168, 32064),
    ("llama-3.1-70b", 8, 8, 1, 3584, 16032),
    ("llama-3.1-8b", 2, 16, 4, 7168, 64128),
    ("qwen2.5-7b", 4, 7, 1, 4736, 38016),
    ("qwen2.5-7b", 2, 14, 2, 9472, 76032),
])
def test_shard_gives_one_ranks_shapes(name, tp, heads, kv, inter, vocab):
    cfg = shard(resolve(name), tp)
    assert (cfg.heads, cfg.kv_heads, cfg.intermediate, cfg.vocab, cfg.tp) == (heads, kv, inter, vocab, tp)
    assert cfg.hidden == resolve(name).hidden and cfg.head_dim == 128


def test_shard_refuses_what_does_not_split():
    with pytest.raises(UserError, match="28 attention heads do not split over 8 ranks"):
        shard(resolve("qwen2.5-7b"), 8)
    with pytest.raises(UserError, match="3 KV heads"):
        shard(ModelConfig("m", 1, 96, 6, 3, 64, 64), 2)


# ---- the kernels at real shapes, and one TP rank's shards against the unsharded reference ----

def _meta(slots, max_loras):
    buf = MetaBuffer(len(slots), max_loras, DEVICE)
    packed, n = buf.pack(slots)
    buf.load(packed)
    return buf.meta, n


def _weights(k, widths, rank, max_loras, seed):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(max_loras, len(widths) * rank, k, generator=g) / k**0.5).to(DEVICE, torch.float16)
    b = (torch.randn(max_loras, sum(widths), rank, generator=g) / rank**0.5).to(DEVICE, torch.float16)
    return a, b


def _starts(widths):
    return tuple([0] + [sum(widths[: i + 1]) for i in range(len(widths))])


def _apply(backend, x, a, b, widths, slots, max_loras):
    meta, n = _meta(slots, max_loras)
    y = torch.zeros(x.shape[0], sum(widths), dtype=x.dtype, device=DEVICE)
    scratch = torch.zeros(x.shape[0], len(widths) * b.shape[2], dtype=torch.float32, device=DEVICE)
    get_backend(backend).lora_apply(y, x, a, b, _starts(widths), meta, max_loras, 0.5, scratch)
    return y.float()


def _close(out, ref):
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < 2e-2, err


SLOTS = [0, -1, 2, 1, -1, 2]  # adapters and base-model tokens mixed


def narrowed(width: int, interpreted: bool = not HAS_CUDA) -> int:
    """On the CPU (Triton's interpreter runs every output tile in Python) an output width cut to
    at most two 128-wide tiles plus what the real width leaves past its last whole 128: the same
    default tilings (they are chosen by the input features, the rank and the token count; the
    widest output tile is 128), masks and slices of unequal width, a fraction of the tiles."""
    return min(width, 256 + width % 128) if interpreted else width


# Input features and output widths vLLM's kernel tests take from real models (not multiples of the tiles).
REAL_SIZES = pytest.mark.parametrize("k,widths", [(2049, (5504,)), (13824, (2049,)), (3584, (18944,)), (18944, (3584,)),
                                                  (3584, (896, 128, 128)), (5120, (4096, 1024, 1024))],
                                     ids=["2049-5504", "13824-2049", "qwen-up", "qwen-down", "qwen-qkv-tp4", "nemo-qkv"])


@REAL_SIZES
def test_narrowed_widths_keep_the_default_tilings(k, widths):
    """What ``narrowed`` keeps: each backend's default tiling at the real shape, and each width's
    remainder past its whole 128-wide tiles."""
    from lorabench.kernels import fused_lora, triton_lora

    cut = tuple(narrowed(w, interpreted=True) for w in widths)
    assert [w % 128 for w in cut] == [w % 128 for w in widths] and all(w <= 384 for w in cut)
    tokens, rank, slices = len(SLOTS), 16, len(widths)
    for launch in (1, 3):  # the shrink's tiling is chosen by K, slices x rank, tokens and launch: no width
        assert fused_lora.default_config(tokens, k, max(cut), rank, slices, launch) == \
            fused_lora.default_config(tokens, k, max(widths), rank, slices, launch)
        assert triton_lora.default_config("expand", tokens, rank, max(cut), slices, launch) == \
            triton_lora.default_config("expand", tokens, rank, max(widths), slices, launch)


@REAL_SIZES
@pytest.mark.usefixtures("epilogue_at_any_launch")  # gemm's own GEMM at 3 launched slots
@pytest.mark.parametrize("backend", ["triton", "fused", "gemm", "torch"])
def test_kernels_at_real_hidden_sizes(backend, k, widths):
    """Every real input width K (the split over K, parts of unequal length); the real output widths
    on a GPU, on the CPU their remainders past whole tiles (``narrowed``)."""
    widths = tuple(narrowed(w) for w in widths)
    a, b = _weights(k, widths, 16, 3, k)
    x = torch.randn(len(SLOTS), k, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.float16)
    _close(_apply(backend, x, a, b, widths, SLOTS, 3),
           lora_delta(x, a, b, _starts(widths), torch.tensor(SLOTS, device=DEVICE), 0.5))


def _column_shard(b, widths, tp, r, replicas=(1, 1, 1)):
    """Rank r's B of a column-parallel LoRA linear, as vLLM cuts it: each slice's share of the
    output features (a slice with fewer heads than ranks: the head of rank r // replicas)."""
    parts, start = [], 0
    for w, rep in zip(widths, replicas):
        share = w * rep // tp
        first = (r // rep) * share
        parts.append(b[:, start + first: start + first + share])
        start += w
    return torch.cat(parts, dim=1)


@pytest.mark.usefixtures("epilogue_at_any_launch")
@pytest.mark.parametrize("backend", ["triton", "fused", "gemm", "torch"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_recombine_to_the_unsharded_reference(backend, tp):
    """Per rank, lora_linears(shard(cfg, tp)) shapes; column-parallel outputs concatenate and
    row-parallel outputs sum (the all-reduce) to the unsharded model's LoRA update."""
    full = ModelConfig("m", 1, 256, 8, 2, 512, 64)  # 8 heads of 32, 2 KV heads: replicated at TP 4
    rank_cfg = shard(full, tp)
    full_lin, rank_lin = lora_linears(full), lora_linears(rank_cfg)
    slots = torch.tensor(SLOTS, device=DEVICE)
    for name, (k, widths) in full_lin.items():
        a, b = _weights(k, widths, 8, 3, len(name))
        x = torch.randn(len(SLOTS), k, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.float16)
        ref = lora_delta(x, a, b, _starts(widths), slots, 0.5)
        rk, rwidths = rank_lin[name]
        if name in ("qkv", "gate_up"):  # column-parallel: A whole, B's output features split
            assert rk == k
            replicas = (1, max(1, tp // full.kv_heads), max(1, tp // full.kv_heads)) if name == "qkv" else (1, 1)
            outs = []
            for r in range(tp):
                b_r = _column_shard(b, widths, tp, r, replicas)
                assert b_r.shape[1] == sum(rwidths)
                outs.append(_apply(backend, x, a, b_r, rwidths, SLOTS, 3))
            # every rank's slices, back in the unsharded order (replicated KV heads taken once)
            for s, (w, rep) in enumerate(zip(widths, replicas)):
                lo = _starts(widths)[s]
                got = torch.cat([outs[r][:, _starts(rwidths)[s]:_starts(rwidths)[s + 1]] for r in range(0, tp, rep)], 1)
                _close(got, ref[:, lo: lo + w])
        else:  # row-parallel: A's input features split, B whole, outputs summed
            assert rk == k // tp and rwidths == widths
            total = sum(_apply(backend, x[:, r * rk:(r + 1) * rk].contiguous(), a[:, :, r * rk:(r + 1) * rk].contiguous(),
                               b, widths, SLOTS, 3) for r in range(tp))
            _close(total, ref)


@pytest.mark.usefixtures("epilogue_at_any_launch")
@pytest.mark.parametrize("backend", ["triton", "gemm", "torch"])
def test_fully_sharded_shards_recombine_to_the_unsharded_reference(backend):
    """--fully-sharded-loras at TP 2: a column-parallel rank holds R / TP rows of each slice's A
    (its shrink output all-gathered: each rank's share of h times its columns of B, summed), a
    row-parallel rank hidden / TP of B's outputs (the shrink outputs all-reduced: summed over the
    K shares). Every rank's kernel call, summed as the collectives would, is the unsharded update."""
    tp, rank = 2, 16
    full = ModelConfig("m", 1, 256, 8, 4, 512, 64)
    rank_lin = lora_linears(shard(full, tp))
    slots = torch.tensor(SLOTS, device=DEVICE)
    for name, (k, widths) in lora_linears(full).items():
        a_div, b_div = lora_shares(name, tp, True)
        a, b = _weights(k, widths, rank, 3, len(name) + 7)
        x = torch.randn(len(SLOTS), k, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.float16)
        ref = lora_delta(x, a, b, _starts(widths), slots, 0.5)
        rk, rwidths = rank_lin[name]
        if name in ("qkv", "gate_up"):
            assert (a_div, b_div) == (tp, 1)
            ra = rank // tp
            for r in range(tp):  # output share r: every rank's share q of h, through B's columns q
                b_r = _column_shard(b, widths, tp, r)
                total = 0
                for q in range(tp):
                    a_q = torch.cat([a[:, s * rank + q * ra: s * rank + (q + 1) * ra] for s in range(len(widths))], 1)
                    b_rq = torch.zeros_like(b_r)
                    b_rq[:, :, :ra] = b_r[:, :, q * ra:(q + 1) * ra]
                    assert a_q.shape[1] == len(widths) * rank // a_div
                    total = total + _apply(backend, x, a_q.contiguous(), b_rq, rwidths, SLOTS, 3)
                for s, w in enumerate(widths):
                    share = w // tp
                    got = total[:, _starts(rwidths)[s]:_starts(rwidths)[s + 1]]
                    _close(got, ref[:, _starts(widths)[s] + r * share:_starts(widths)[s] + (r + 1) * share])
        else:
            assert (a_div, b_div) == (1, tp) and rk == k // tp
            share = widths[0] // tp
            for r in range(tp):  # output share r: the all-reduced h (a sum over the K shares), through B's rows r
                total = sum(_apply(backend, x[:, q * rk:(q + 1) * rk].contiguous(), a[:, :, q * rk:(q + 1) * rk].contiguous(),
                                   b[:, r * share:(r + 1) * share].contiguous(), (share,), SLOTS, 3) for q in range(tp))
                _close(total, ref[:, r * share:(r + 1) * share])


def test_fully_sharded_model_holds_the_cut_weights_and_matches_its_reference():
    """LlamaLoRA at one TP rank with fully sharded LoRA: A and B of vLLM's per-rank shapes, and
    a step through the kernels equals the plain-torch reference (mixed base and adapter tokens)."""
    from lorabench.kernels.meta import LoRAMeta  # noqa: F401

    from lorabench.runtime.model import LlamaLoRA, LoRAStep

    cfg = shard(ModelConfig("m", 2, 256, 8, 4, 512, 96), 2)
    model = LlamaLoRA(cfg, max_loras=3, rank=16, max_tokens=6, context_len=8, dtype=torch.float32, device=DEVICE,
                      fully_sharded=True)
    blk = model.layers[0]
    assert blk.qkv.lora_a.shape == (3, 3 * 8, 256) and blk.qkv.lora_b.shape == (3, 128 + 64 + 64, 16)
    assert blk.o.lora_a.shape == (3, 16, 128) and blk.o.lora_b.shape == (3, 128, 16)
    assert blk.down.lora_a.shape == (3, 16, 256) and blk.down.lora_b.shape == (3, 128, 16)
    meta, _ = _meta(SLOTS, 3)
    ids, pos = torch.arange(len(SLOTS), device=DEVICE), torch.full((len(SLOTS),), 7, device=DEVICE)
    outs = {}
    for name in ("reference", "torch", "triton"):
        model.scratch.zero_()
        outs[name] = model(ids, pos, LoRAStep(get_backend(name), meta, 3, 0.5)).float()
    base = model(ids, pos, None).float()
    assert (outs["reference"] - base).abs().max() > 1e-3  # LoRA changed the logits
    tol = 1e-2 if DEVICE == "cuda" else 1e-3  # tl.dot takes fp32 operands as TF32 on a GPU
    for name in ("torch", "triton"):
        assert torch.allclose(outs[name], outs["reference"], rtol=tol, atol=tol)


def test_a_model_type_transformers_does_not_know_is_read_from_the_file(tmp_path):
    """An older transformers (a GPU image's) may not know a new model type: the file's own values
    are read then, and defaults for what it omits (KV heads = heads, head_dim = hidden / heads)."""
    raw = {"model_type": "qwen-from-the-future", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 256,
           "num_attention_heads": 4, "num_hidden_layers": 3, "intermediate_size": 512, "vocab_size": 1000,
           "rope_theta": 5e5}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = resolve(str(tmp_path))
    assert (cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.layers, cfg.rope_theta) == (256, 4, 4, 64, 3, 5e5)
    assert cfg.qkv_bias  # Qwen2's biases come with the architecture


def test_the_model_at_one_tp_rank_holds_vllms_default_lora_shapes():
    """Default sharding at TP 4 of an 8-head, 2-KV-head model: qkv's A whole ([3R, hidden]) and B
    the rank's outputs (2 heads, 1 replicated KV head); o's A the rank's inputs, B all of hidden;
    gate_up's A whole and B the rank's intermediate features; down's A the rank's inputs."""
    from lorabench.runtime.model import LlamaLoRA

    cfg = shard(ModelConfig("m", 1, 256, 8, 2, 512, 96), 4)
    blk = LlamaLoRA(cfg, max_loras=3, rank=16, max_tokens=2, context_len=4, dtype=torch.float32, device="cpu").layers[0]
    d = 32
    assert blk.qkv.lora_a.shape == (3, 3 * 16, 256) and blk.qkv.lora_b.shape == (3, 2 * d + d + d, 16)
    assert blk.o.lora_a.shape == (3, 16, 2 * d) and blk.o.lora_b.shape == (3, 256, 16)
    assert blk.gate_up.lora_a.shape == (3, 2 * 16, 256) and blk.gate_up.lora_b.shape == (3, 2 * 128, 16)
    assert blk.down.lora_a.shape == (3, 16, 128) and blk.down.lora_b.shape == (3, 256, 16)
    assert blk.qkv.weight.shape == (2 * d + 2 * d, 256) and blk.down.weight.shape == (256, 128)


def test_a_sweep_plans_and_builds_what_its_flags_say(tmp_path):
    """--tp, --fully-sharded-loras and --ranks reach the jobs, the worker's model and rows, and
    only the +unpadded arms get each slot's rank (padded weights are zero, so results alone
    could not tell)."""
    from lorabench.config.flags import Machine
    from lorabench.config.plan import Job, plan
    from lorabench.config.spec import build_spec
    from lorabench.runtime.worker import Worker

    flags = dict(model="llama-3.1-8b", layers=1, tp=2, fully_sharded_loras=True, rank=16, ranks="8:0.5,16:0.5",
                 kernels="triton", max_loras="4", concurrency="1", strategy="max", device="cpu", out=str(tmp_path))
    spec, _ = build_spec(flags, None, Machine(cuda=False))
    assert spec.kernels == ["triton", "triton+unpadded"]
    jobs = [Job.from_json(j.to_json()) for j in plan(spec)]
    assert [j.kernels for j in jobs] == ["triton", "triton+unpadded"]
    assert all(j.tp == 2 and j.fully_sharded and j.slot_ranks == (8, 16, 8, 16) and j.ranks == "8:0.5,16:0.5"
               and j.model.name == "llama-3.1-8b" and j.model.layers == 1 for j in jobs)
    for job, unpadded in zip(jobs, (False, True)):
        w = Worker([job], 0.0)
        assert (w.common["tp"], w.common["allreduce"], w.common["fully_sharded_loras"]) == (2, "left out", True)
        assert w.common["slot_ranks"] == [8, 16, 8, 16] and w.cfg.heads == 16 and w.cfg.kv_heads == 4
        model = LlamaLoRA_small(w)
        d = w.dispatcher(model, w.arms[0], [1])
        assert (d.slot_rank is not None) == unpadded
        if unpadded:
            assert d.slot_rank.tolist() == [8, 16, 8, 16]
        qkv = model.layers[0].qkv  # fully sharded at TP 2: 8 of rank 16's rows per slice; slot 0's adapter is rank 8
        assert qkv.lora_a.shape[1] == 3 * 8 and qkv.lora_a[0].abs().min() > 0  # its 8 rows are all its own
        assert not qkv.lora_b[0, :, 8:].any() and qkv.lora_b[0, :, :8].abs().min() > 0  # B padded past rank 8
        assert qkv.lora_b[1].abs().min() > 0  # slot 1: rank 16, no padding


def LlamaLoRA_small(worker):
    """The worker's model with a small vocabulary (the CPU builds it in a moment)."""
    from dataclasses import replace

    from lorabench.runtime.model import LlamaLoRA

    job = worker.lead
    return LlamaLoRA(replace(worker.cfg, vocab=512), max_loras=job.max_loras, rank=job.rank, max_tokens=job.max_tokens,
                     context_len=8, dtype=torch.float32, device="cpu", slot_ranks=job.slot_ranks,
                     fully_sharded=job.fully_sharded)
