"""Mixture-of-experts shapes: the published MoE configs parse to their shapes, one TP rank's
experts, which layers are routed, the LoRA each layer holds, and the memory estimate of expert
LoRA against what the model really allocates."""

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from lorabench.config.limits import Shape, culprit, estimate, expert_lora_bytes_per_slot, model_bytes
from lorabench.config.models import (
    ARCHITECTURES,
    CONFIG_FOLDER,
    MOE_ARCHITECTURES,
    PRESETS,
    SHIPPED,
    MoE,
    ModelConfig,
    check_moe_options,
    from_hf,
    layer_lora_linears,
    lora_linears,
    moe_layer,
    moe_lora_shapes,
    resolve,
    shard,
)
from lorabench.errors import UserError

CONFIGS = Path(__file__).parent / "data" / "configs"

# (preset, layers, hidden, heads, kv heads, head_dim, vocab, rope_theta, norm eps, MoE, qkv bias, qk_norm, qk_norm_full)
REAL = [
    ("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 151936, 1e6, 1e-6, MoE(128, 8, 768, True), False, True, False),
    ("mixtral-8x7b", 32, 4096, 32, 8, 128, 32000, 1e6, 1e-5, MoE(8, 2, 14336, True), False, False, False),
    ("olmoe-1b-7b", 16, 2048, 16, 16, 128, 50304, 1e4, 1e-5, MoE(64, 8, 1024, False), False, False, True),
    ("qwen1.5-moe-a2.7b", 24, 2048, 16, 16, 128, 151936, 1e6, 1e-6,
     MoE(60, 4, 1408, False, shared_intermediate=5632, shared_gate=True), True, False, False),
]
DENSE_INTERMEDIATE = {"qwen3-30b-a3b": 6144, "mixtral-8x7b": 14336, "olmoe-1b-7b": 1024, "qwen1.5-moe-a2.7b": 5632}


@pytest.mark.parametrize("case", REAL, ids=[c[0] for c in REAL])
def test_shipped_moe_configs_parse_to_their_published_shapes(case):
    name, layers, hidden, heads, kv, d, vocab, theta, eps, moe, bias, qk_norm, qk_norm_full = case
    cfg = resolve(name)
    shapes = (cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.vocab)
    assert shapes == (layers, hidden, heads, kv, d, vocab)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.qkv_bias, cfg.o_bias, cfg.qk_norm, cfg.qk_norm_full) == (
        theta, eps, bias, False, qk_norm, qk_norm_full)
    assert cfg.moe == moe and cfg.is_moe and cfg.intermediate == DENSE_INTERMEDIATE[name]
    assert all(moe_layer(cfg, i) for i in range(layers))
    assert cfg.architecture in MOE_ARCHITECTURES and name in PRESETS and name in SHIPPED


@pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated")
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b", "olmoe-1b-7b", "qwen1.5-moe-a2.7b"])
def test_a_transformers_too_old_for_the_model_type_reads_the_files_own_values(name):
    """The fallback for unknown model types (a bare PretrainedConfig) gives the same shapes."""
    from transformers import PretrainedConfig

    raw = json.loads((CONFIG_FOLDER / f"{name}.json").read_text())
    assert from_hf(PretrainedConfig(**raw), name, source="preset") == resolve(name)


def test_the_built_in_tiny_moe_presets():
    moe, shared = resolve("tiny-moe"), resolve("tiny-moe-shared")
    assert (moe.layers, moe.hidden, moe.heads, moe.kv_heads, moe.intermediate, moe.vocab) == (2, 128, 4, 2, 256, 512)
    assert moe.moe == MoE(experts=16, top_k=2, intermediate=64, renormalize=True) and not moe.qkv_bias
    assert shared.moe == MoE(experts=6, top_k=2, intermediate=64, renormalize=False, shared_intermediate=96,
                             shared_gate=True, dense_layers=(1,))
    assert shared.qkv_bias and [moe_layer(shared, i) for i in range(2)] == [True, False]
    assert not resolve("tiny").is_moe and not moe_layer(resolve("tiny"), 0)


def test_a_trimmed_mixtral_config_parses():
    cfg = resolve(str(CONFIGS / "mixtral-8x7b.json"))
    assert cfg.moe == MoE(8, 2, 14336, True) and cfg.architecture == "MixtralForCausalLM"


def test_a_moe_model_survives_a_json_round_trip():
    """Plans and run.json files carry the model as a dict (``asdict``) and rebuild it."""
    cfg = shard(resolve("tiny-moe-shared"), 2)
    assert ModelConfig(**json.loads(json.dumps(asdict(cfg)))) == cfg


def _write(tmp_path, raw):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


def test_other_moe_architectures_are_refused_naming_what_is_built(tmp_path):
    raw = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
           "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2,
           "num_experts_per_tok": 6, "num_attention_heads": 16, "num_hidden_layers": 27, "num_key_value_heads": 16,
           "vocab_size": 102400, "kv_lora_rank": 512, "q_lora_rank": None}
    with pytest.raises(UserError) as e:
        resolve(_write(tmp_path, raw))
    message = str(e.value)
    assert message.startswith("--model: ") and "\n" not in message
    assert "is a DeepseekV2ForCausalLM; lorabench builds Llama-style dense decoders" in message
    assert all(arch in message for arch in ARCHITECTURES) and "mixture-of-experts decoders" in message


def test_olmoe_with_clipped_qkv_is_refused(tmp_path):
    raw = json.loads((CONFIG_FOLDER / "olmoe-1b-7b.json").read_text()) | {"clip_qkv": 8.0}
    with pytest.raises(UserError) as e:
        resolve(_write(tmp_path, raw))
    assert str(e.value).startswith("--model: ") and "\n" not in str(e.value)
    assert "clip_qkv = 8.0; lorabench builds clip_qkv = None" in str(e.value)


@pytest.mark.parametrize("change,says", [
    ({"num_experts_per_tok": 200}, "routes each token to 200 of 128 experts"),
    ({"moe_intermediate_size": 0}, "experts have intermediate size 0"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step = 0"),
])
def test_bad_moe_values_get_one_line(tmp_path, change, says):
    raw = json.loads((CONFIG_FOLDER / "qwen3-30b-a3b.json").read_text()) | change
    with pytest.raises(UserError) as e:
        resolve(_write(tmp_path, raw))
    assert says in str(e.value) and str(e.value).startswith("--model: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("step,only,sparse", [
    (1, [], [True] * 6),
    (2, [], [False, True, False, True, False, True]),
    (1, [0, 4], [False, True, True, True, False, True]),
    (3, [2], [False, False, False, False, False, True]),
])
def test_moe_layers_follow_mlp_only_layers_and_decoder_sparse_step(tmp_path, step, only, sparse):
    raw = json.loads((CONFIG_FOLDER / "qwen1.5-moe-a2.7b.json").read_text())
    raw |= {"num_hidden_layers": 6, "decoder_sparse_step": step, "mlp_only_layers": only}
    cfg = resolve(_write(tmp_path, raw))
    assert [moe_layer(cfg, i) for i in range(6)] == sparse
    assert cfg.moe.dense_layers == tuple(i for i in range(6) if not sparse[i])


@pytest.mark.parametrize("tp,heads,kv,inter", [(2, 16, 2, 384), (4, 8, 1, 192)])
def test_shard_splits_each_experts_intermediate(tp, heads, kv, inter):
    cfg = shard(resolve("qwen3-30b-a3b"), tp)
    assert (cfg.heads, cfg.kv_heads, cfg.moe.intermediate, cfg.moe.experts, cfg.moe.top_k) == (heads, kv, inter, 128, 8)
    assert cfg.intermediate == 6144 // tp and cfg.hidden == 2048 and cfg.tp == tp
    assert moe_lora_shapes(cfg, 16)["w13_b"] == (2, 128, inter, 16)
    shared = shard(resolve("qwen1.5-moe-a2.7b"), 2).moe
    assert (shared.intermediate, shared.shared_intermediate) == (704, 2816)


def test_shard_refuses_experts_that_do_not_split():
    odd = replace(resolve("tiny-moe"), moe=MoE(8, 2, 66, True))
    with pytest.raises(UserError) as e:
        shard(odd, 4)
    assert str(e.value) == "--tp 4: tiny-moe's expert intermediate size 66 does not split over 4 ranks"
    shared = replace(resolve("tiny-moe-shared"), moe=replace(resolve("tiny-moe-shared").moe, shared_intermediate=98))
    with pytest.raises(UserError, match="shared expert intermediate size 98 does not split over 4 ranks"):
        shard(shared, 4)


def test_an_unused_dense_intermediate_need_not_split():
    """Every layer routed: the dense intermediate size is no tensor's, so it does not refuse a TP."""
    cfg = replace(resolve("tiny-moe"), intermediate=250)
    assert shard(cfg, 4).moe.intermediate == 16
    with pytest.raises(UserError, match="intermediate size 250 does not split"):
        shard(replace(resolve("tiny-moe-shared"), intermediate=250), 4)  # its layer 1 is dense


def test_fully_sharded_lora_is_refused_for_moe_models():
    check_moe_options(resolve("qwen3-8b"), True, "--fully-sharded-loras")
    check_moe_options(resolve("qwen3-30b-a3b"), False, "--fully-sharded-loras")
    with pytest.raises(UserError) as e:
        check_moe_options(resolve("qwen3-30b-a3b"), True, "--fully-sharded-loras")
    assert str(e.value).startswith("--fully-sharded-loras: ") and "expert LoRA is built without it" in str(e.value)


def test_layer_lora_linears():
    cfg = resolve("tiny-moe-shared")
    dense = lora_linears(cfg)
    assert layer_lora_linears(cfg, 1) == dense  # the dense layer
    assert layer_lora_linears(cfg, 0) == {"qkv": dense["qkv"], "o": dense["o"], "gate_up": (128, (96, 96)),
                                          "down": (96, (128,))}  # the shared expert
    assert list(layer_lora_linears(resolve("tiny-moe"), 0)) == ["qkv", "o"]
    assert layer_lora_linears(resolve("tiny"), 0) == lora_linears(resolve("tiny"))


def test_moe_lora_shapes_are_vllms_layout():
    assert moe_lora_shapes(resolve("qwen3-30b-a3b"), 16) == {
        "w13_a": (2, 128, 16, 2048), "w13_b": (2, 128, 768, 16), "w2_a": (1, 128, 16, 768), "w2_b": (1, 128, 2048, 16)}
    assert moe_lora_shapes(resolve("tiny"), 16) == {}


def test_qwen3_30b_a3b_expert_lora_is_830m_parameters_a_slot():
    per_expert = 2 * 16 * 2048 + 2 * 768 * 16 + 16 * 768 + 2048 * 16
    assert expert_lora_bytes_per_slot(resolve("qwen3-30b-a3b"), 16, "bfloat16") == 48 * 128 * per_expert * 2
    assert 48 * 128 * per_expert == 830_472_192  # 1.66 GB in bfloat16
    assert expert_lora_bytes_per_slot(resolve("tiny"), 16, "bfloat16") == 0
    per_expert = 2 * 8 * 128 + 2 * 64 * 8 + 8 * 64 + 128 * 8
    assert expert_lora_bytes_per_slot(resolve("tiny-moe-shared"), 8, "float32") == 4 * 6 * per_expert  # layer 0's


def test_the_estimate_of_a_moe_model():
    """Adapter slots hold expert LoRA; a slot too many names max_loras with its expert LoRA."""
    cfg = resolve("qwen3-30b-a3b")
    s = Shape(cfg, 8, 16, "bfloat16", 32, 1024)
    expert = expert_lora_bytes_per_slot(cfg, 16, "bfloat16")
    assert model_bytes(s)[1] > 8 * expert
    e = estimate(s, 10, True)
    assert e.adapters == model_bytes(s)[1] and e.total > 8 * expert
    big = Shape(cfg, 256, 16, "bfloat16", 32, 1024)
    assert culprit(big, 10, True) == "max_loras 256 at 1.5 GiB of expert LoRA per slot"
    assert culprit(Shape(cfg, 1, 16, "bfloat16", 1, 16), 1, True).startswith("qwen3-30b-a3b (48 layers, 128 experts,")


@pytest.mark.parametrize("name,tp,shared", [("tiny-moe", 1, False), ("tiny-moe-shared", 1, False),
                                            ("tiny-moe-shared", 2, False), ("olmoe-1b-7b", 2, False),
                                            ("qwen3-30b-a3b", 1, False), ("tiny-moe", 1, True),
                                            ("qwen3-30b-a3b", 1, True), ("tiny-moe-shared", 2, True)])
def test_the_estimate_is_the_moe_models_parameters_and_buffers(name, tp, shared):
    """model_bytes is LlamaLoRA's parameters and buffers to the byte, expert LoRA included (real
    configs cut to two layers, few experts and small widths, so the CPU builds them quickly), with
    the layers' routed experts one set or each layer's own."""
    torch = pytest.importorskip("torch")
    from lorabench.runtime.model import LlamaLoRA

    cfg = resolve(name, layers=2)
    if not name.startswith("tiny"):
        cfg = replace(cfg, hidden=256, intermediate=512, vocab=1024, moe=replace(cfg.moe, experts=8, intermediate=128))
    cfg = shard(replace(cfg, moe=replace(cfg.moe, shared_weights=shared)), tp)
    for max_loras, tokens, dtype in [(2, 3, "float16"), (5, 1, "float32")]:
        model = LlamaLoRA(cfg, max_loras=max_loras, rank=8, max_tokens=tokens, context_len=8,
                          dtype=getattr(torch, dtype), device="cpu")
        real = sum(t.nbytes for t in model.parameters()) + sum(t.nbytes for t in model.buffers())
        shape = Shape(cfg, max_loras, 8, dtype, tokens, 8)
        assert sum(model_bytes(shape)) == real
        assert model_bytes(shape)[1] == max_loras * model.lora_bytes_per_slot()
        assert expert_lora_bytes_per_slot(cfg, 8, dtype) == model.expert_lora_bytes_per_slot()


def test_shared_expert_weights_are_one_set_read_by_every_moe_layer():
    """--share-expert-weights: the layers' w13 and w2 are one tensor each; their routers, expert LoRA
    and attention stay their own; the estimate holds the experts once."""
    torch = pytest.importorskip("torch")
    from lorabench.runtime.model import LlamaLoRA

    cfg = resolve("tiny-moe")
    one = replace(cfg, moe=replace(cfg.moe, shared_weights=True))
    model = LlamaLoRA(one, max_loras=2, rank=8, max_tokens=2, context_len=8, dtype=torch.float32, device="cpu")
    first, second = (layer.moe for layer in model.layers)
    assert first.w13 is second.w13 and first.w2 is second.w2
    assert first.router.data_ptr() != second.router.data_ptr() and first.w13_a.data_ptr() != second.w13_a.data_ptr()
    own, shared = (model_bytes(Shape(c, 2, 8, "float32", 2, 8))[0] for c in (cfg, one))
    assert own - shared == 4 * cfg.moe.experts * 3 * cfg.moe.intermediate * cfg.hidden  # one layer's experts fewer
