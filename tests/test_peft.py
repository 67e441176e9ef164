"""The user's own adapters (``--adapters DIR``): PEFT folders read and checked against the model,
their weights in the slots (B times each module's scale, untargeted linears zero, a TP rank's
share), their LoRA equal to PEFT's own, loads that leave the same slots, and a sweep and a check
on them."""

import dataclasses
import json
import re
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from peft_folders import HIDDEN, INTER, KV, PREFIX, Q, adapter_files, module_tensors, write

from lorabench.cli import main
from lorabench.config.flags import Machine
from lorabench.config.models import PRESETS, resolve, shard
from lorabench.config.spec_checks import check_adapter_bank
from lorabench.config.peft import read_adapters, slot_ranks
from lorabench.config.residency import Adapters, simulate
from lorabench.config.workload import parse_workload
from lorabench.errors import UserError
from lorabench.runtime.adapters import AdapterLoader
from lorabench.runtime.model import LlamaLoRA
from lorabench.runtime.peft_slots import fill_slot, fill_slots, read_tensors
from lorabench.analysis.residency_price import validation
from lorabench.analysis.view import RunView
from lorabench.storage.samples import read_load_paths, read_samples

RANK = 16


def build(cfg, adapters, max_loras=3):
    model = LlamaLoRA(cfg, max_loras=max_loras, rank=RANK, max_tokens=4, context_len=8, dtype=torch.float32,
                      device="cpu", slot_ranks=slot_ranks(adapters, max_loras))
    fill_slots(model, adapters)
    return model


def lora_of(model, slot, layer, linear, slice_):
    """(A [R, K], B [N, R]) of one slice of one dense linear in a slot."""
    lin = getattr(model.layers[layer], linear)
    rows = lin.lora_a.shape[1] // (len(lin.slice_starts) - 1)
    a = lin.lora_a[slot, slice_ * rows:(slice_ + 1) * rows]
    return a, lin.lora_b[slot, lin.slice_starts[slice_]:lin.slice_starts[slice_ + 1]]


@pytest.fixture
def two_adapters(tmp_path):
    """a: rank 8 on q, v (v at rank 4 by rank_pattern) and down (alpha 32 by alpha_pattern); b: rank 16
    on all seven modules, rsLoRA."""
    rng = np.random.default_rng(1)
    v4 = {k: v for i in (0, 1) for k, v in module_tensors(i, "self_attn.v_proj", 4, HIDDEN, KV, rng).items()}
    write(tmp_path / "adapters", adapter_files("a", 8, 16, ("q_proj", "down_proj"), tensors=v4,
                                               config={"target_modules": ["q_proj", "v_proj", "down_proj"],
                                                       "rank_pattern": {"v_proj": 4}, "alpha_pattern": {"down_proj": 32}}))
    write(tmp_path / "adapters", adapter_files("b", 16, 8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"), config={"use_rslora": True}, seed=2))
    return tmp_path / "adapters"


def test_a_folder_of_adapters_maps_onto_the_fused_linears_with_each_modules_scale(two_adapters):
    a, b = read_adapters(str(two_adapters), resolve("tiny"), RANK)
    assert (a.name, a.rank, b.name, b.rank) == ("a", 8, "b", 16)
    where = {(m.layer, m.linear, m.slice): (m.rank, m.scale) for m in a.modules}
    assert where == {(i, lin, s): v for i in (0, 1) for (lin, s), v in
                     {("qkv", 0): (8, 2.0), ("qkv", 2): (4, 4.0), ("down", 0): (8, 4.0)}.items()}
    assert {m.scale for m in b.modules} == {8 / 4}  # rsLoRA: alpha / sqrt(r)
    assert not a.has_expert_lora


# Where each PEFT module lands, and its adapter's scale (alpha / r, or alpha / sqrt(r) for b's rsLoRA),
# written out here rather than read back from lorabench.config.peft.
SLICES = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
          "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
SCALES = {"a": {"q_proj": 16 / 8, "v_proj": 16 / 4, "down_proj": 32 / 8}, "b": dict.fromkeys(SLICES, 8 / 16**0.5)}


def test_the_slots_hold_the_files_tensors_scaled_and_zeros_elsewhere(two_adapters):
    adapters = read_adapters(str(two_adapters), resolve("tiny"), RANK)
    model = build(resolve("tiny"), adapters)  # slot 2 holds adapter a again
    files = [read_tensors(x) for x in adapters]
    for slot, (name, tensors) in enumerate(zip(["a", "b", "a"], [*files, files[0]])):
        seen = 0
        for key, a_file in tensors.items():
            if ".lora_A." not in key:
                continue
            layer, leaf = int(key.split(".")[4]), key.split(".")[6]
            r = a_file.shape[0]
            a, b = lora_of(model, slot, layer, *SLICES[leaf])
            torch.testing.assert_close(a[:r], a_file)
            torch.testing.assert_close(b[:, :r], tensors[key.replace("lora_A", "lora_B")] * SCALES[name][leaf])
            assert not a[r:].any() and not b[:, r:].any()  # padded to --rank with zeros
            seen += 1
        assert seen == 2 * len(SCALES[name])
    for layer in (0, 1):  # adapter a targets neither k, o, gate nor up
        assert not lora_of(model, 0, layer, "qkv", 1)[0].any() and not model.layers[layer].o.lora_b[0].any()
        assert not model.layers[layer].gate_up.lora_a[0].any() and not model.layers[layer].gate_up.lora_b[0].any()
    assert model.slot_rank.tolist() == [8, 16, 8]


def test_the_lora_in_the_slots_is_peft_s_own(tmp_path):
    """PEFT's own model and its save_pretrained folder: each targeted linear's LoRA update on an
    input equals what the slot computes (x A^T B^T, the scale folded into B)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg)
    lora = peft.LoraConfig(r=8, lora_alpha=24, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                           rank_pattern={"v_proj": 4}, alpha_pattern={"down_proj": 4}, init_lora_weights=False)
    peft_model = peft.get_peft_model(base, lora)
    peft_model.save_pretrained(tmp_path / "mine")
    (adapter,) = read_adapters(str(tmp_path / "mine"), resolve("tiny"), RANK)
    model = build(resolve("tiny"), (adapter,), max_loras=1)
    layer = peft_model.base_model.model.model.layers[1]
    for module, linear, slice_, k in ((layer.self_attn.q_proj, "qkv", 0, HIDDEN), (layer.self_attn.v_proj, "qkv", 2, HIDDEN),
                                      (layer.self_attn.o_proj, "o", 0, Q), (layer.mlp.down_proj, "down", 0, INTER)):
        x = torch.randn(3, k)
        with torch.no_grad():
            want = module(x) - module.base_layer(x)
        a, b = lora_of(model, 0, 1, linear, slice_)
        torch.testing.assert_close(x @ a.T @ b.T, want, rtol=1e-4, atol=1e-5)


def peft_fused_experts(folder, r=4, alpha=8.0, parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
    """A transformers-5 Qwen3-MoE model at tiny-moe's shapes with PEFT's LoRA on its fused expert
    parameters (and q), saved by PEFT; returns the PEFT model."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    if not hasattr(transformers, "Qwen3MoeConfig"):
        pytest.skip("this transformers has no Qwen3-MoE")
    cfg = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, intermediate_size=INTER, moe_intermediate_size=64, num_experts=16,
                                      num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=32, vocab_size=512, decoder_sparse_step=1,
                                      mlp_only_layers=[])
    torch.manual_seed(0)
    base = transformers.Qwen3MoeForCausalLM(cfg)
    if base.model.layers[0].mlp.experts.gate_up_proj.dim() != 3:
        pytest.skip("this transformers keeps its experts as modules")
    lora = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=["q_proj"], target_parameters=list(parameters),
                           init_lora_weights=False)
    model = peft.get_peft_model(base, lora)
    model.save_pretrained(folder)
    return model


def test_lora_on_fused_expert_parameters_is_peft_s_own(tmp_path):
    """PEFT's target_parameters on transformers-5 fused experts (gate_up_proj [E, 2I, H], down_proj
    [E, H, I]): every expert's LoRA update in the slots equals PEFT's own delta weight."""
    peft_model = peft_fused_experts(tmp_path / "fused")
    (adapter,) = read_adapters(str(tmp_path / "fused"), resolve("tiny-moe"), RANK)
    assert adapter.has_expert_lora and adapter.rank == 4
    model = build(resolve("tiny-moe"), (adapter,), max_loras=2)
    for layer in (0, 1):
        outer = peft_model.base_model.model.model.layers[layer].mlp.experts  # down_proj's wrapper, around gate_up's
        with torch.no_grad():
            gate_up, down = outer.base_layer.get_delta_weight("default"), outer.get_delta_weight("default")
        moe = model.layers[layer].moe
        for slot in (0, 1):  # one adapter: both slots hold it
            w13 = [moe.w13_b[s, slot] @ moe.w13_a[s, slot] for s in (0, 1)]  # [E, I, H] each: gate, up
            torch.testing.assert_close(torch.cat(w13, dim=1), gate_up, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(moe.w2_b[0, slot] @ moe.w2_a[0, slot], down, rtol=1e-4, atol=1e-6)
            assert not moe.w13_a[:, slot, :, 4:].any() and not moe.w2_b[0, slot, :, :, 4:].any()  # zero-padded to RANK
    assert model.expert_lora_enabled[:, :2].tolist() == [[1, 1], [1, 1]]  # both layers, both slots
    rank0 = LlamaLoRA(shard(resolve("tiny-moe"), 2), max_loras=1, rank=RANK, max_tokens=4, context_len=8,
                      dtype=torch.float32, device="cpu")  # a TP rank: half of each expert's intermediate
    fill_slots(rank0, (adapter,))
    moe, whole = rank0.layers[0].moe, model.layers[0].moe
    torch.testing.assert_close(moe.w13_b[:, 0], whole.w13_b[:, 0, :, :32])  # gate's and up's first 32 outputs
    torch.testing.assert_close(moe.w13_a[:, 0], whole.w13_a[:, 0])
    torch.testing.assert_close(moe.w2_a[0, 0], whole.w2_a[0, 0, :, :, :32])  # row-parallel: the first 32 inputs
    torch.testing.assert_close(moe.w2_b[0, 0], whole.w2_b[0, 0])


def test_fused_expert_lora_that_vllm_cannot_read_is_refused(tmp_path):
    peft_fused_experts(tmp_path / "down-only", parameters=("mlp.experts.down_proj",))
    with pytest.raises(UserError, match="one of gate_up_proj and down_proj only; vLLM 0.33 reads fused-expert LoRA as the pair"):
        read_adapters(str(tmp_path / "down-only"), resolve("tiny-moe"), RANK)
    peft_fused_experts(tmp_path / "fused")
    from safetensors.torch import load_file, save_file

    swapped = {k.replace("experts.base_layer.", "experts.TMP.").replace("experts.lora_", "experts.base_layer.lora_")
               .replace("experts.TMP.", "experts."): v for k, v in load_file(tmp_path / "fused" / "adapter_model.safetensors").items()}
    (tmp_path / "swapped").mkdir()
    save_file(swapped, tmp_path / "swapped" / "adapter_model.safetensors")
    (tmp_path / "swapped" / "adapter_config.json").write_text((tmp_path / "fused" / "adapter_config.json").read_text())
    with pytest.raises(UserError, match=r"down_proj has A \[64, 128\].*experts need A \[16·r, 64\]"):
        read_adapters(str(tmp_path / "swapped"), resolve("tiny-moe"), RANK)
    with pytest.raises(UserError, match="tiny-moe-shared.s 6 experts need A"):  # another model's experts
        read_adapters(str(tmp_path / "fused"), resolve("tiny-moe-shared"), RANK)
    with pytest.raises(UserError, match="has no experts"):  # a dense model
        read_adapters(str(tmp_path / "fused"), resolve("tiny"), RANK)


def test_expert_and_shared_expert_modules_fill_their_slots(tmp_path):
    """Mixtral's expert names (block_sparse_moe.experts.E.w1/w3/w2) and Qwen2-MoE's (mlp.experts.E.*,
    mlp.shared_expert.*, a dense layer's mlp.*); an adapter without expert LoRA is flagged off."""
    rng = np.random.default_rng(3)
    experts = {}
    for e in (0, 5):
        experts |= module_tensors(0, f"block_sparse_moe.experts.{e}.w1", 8, HIDDEN, 64, rng)
        experts |= module_tensors(0, f"block_sparse_moe.experts.{e}.w2", 8, 64, HIDDEN, rng)
    experts |= module_tensors(1, "block_sparse_moe.experts.3.w3", 8, HIDDEN, 64, rng)
    write(tmp_path / "moe", adapter_files("experts", 8, 16, ("q_proj",), tensors=experts))  # scale 2
    write(tmp_path / "moe", adapter_files("attention", 8, 8, ("q_proj",)))
    cfg = resolve("tiny-moe")
    adapters = read_adapters(str(tmp_path / "moe"), cfg, RANK)
    assert [x.name for x in adapters] == ["attention", "experts"] and [x.has_expert_lora for x in adapters] == [False, True]
    model = build(cfg, adapters, max_loras=2)
    moe, tensors = model.layers[0].moe, read_tensors(adapters[1])
    key = f"{PREFIX}.0.block_sparse_moe.experts.5"
    torch.testing.assert_close(moe.w13_a[0, 1, 5, :8], tensors[f"{key}.w1.lora_A.weight"])
    torch.testing.assert_close(moe.w13_b[0, 1, 5, :, :8], tensors[f"{key}.w1.lora_B.weight"] * 2)
    torch.testing.assert_close(moe.w2_a[0, 1, 5, :8], tensors[f"{key}.w2.lora_A.weight"])
    torch.testing.assert_close(moe.w2_b[0, 1, 5, :, :8], tensors[f"{key}.w2.lora_B.weight"] * 2)
    w3 = f"{PREFIX}.1.block_sparse_moe.experts.3.w3"  # up: w13's second slice
    torch.testing.assert_close(model.layers[1].moe.w13_a[1, 1, 3, :8], tensors[f"{w3}.lora_A.weight"])
    torch.testing.assert_close(model.layers[1].moe.w13_b[1, 1, 3, :, :8], tensors[f"{w3}.lora_B.weight"] * 2)
    assert not moe.w13_a[1, 1].any() and not moe.w13_a[0, 1, 1].any()  # no w3 in layer 0, no expert 1
    assert not moe.w13_a[:, 0].any() and not model.layers[1].moe.w2_b[:, 1].any()
    assert model.expert_lora_enabled[:, :2].tolist() == [[0, 1], [0, 1]]  # per layer: experts in both of its layers

    shared = module_tensors(0, "mlp.shared_expert.down_proj", 8, 96, HIDDEN, rng)
    shared |= module_tensors(0, "mlp.experts.2.up_proj", 8, HIDDEN, 64, rng)
    shared |= module_tensors(1, "mlp.gate_proj", 8, HIDDEN, INTER, rng)  # layer 1 is dense
    write(tmp_path / "qwen2", adapter_files("s", 8, 8, (), tensors=shared))
    (adapter,) = read_adapters(str(tmp_path / "qwen2" / "s"), resolve("tiny-moe-shared"), RANK)
    model = build(resolve("tiny-moe-shared"), (adapter,), max_loras=1)
    tensors = read_tensors(adapter)
    torch.testing.assert_close(model.layers[0].moe.shared_down.lora_b[0, :, :8],
                               tensors[f"{PREFIX}.0.mlp.shared_expert.down_proj.lora_B.weight"])
    torch.testing.assert_close(model.layers[0].moe.w13_a[1, 0, 2, :8], tensors[f"{PREFIX}.0.mlp.experts.2.up_proj.lora_A.weight"])
    torch.testing.assert_close(model.layers[1].gate_up.lora_a[0, :8], tensors[f"{PREFIX}.1.mlp.gate_proj.lora_A.weight"])


@pytest.mark.parametrize("fully_sharded", [False, True], ids=["tp2", "tp2-fully-sharded"])
def test_a_tp_rank_holds_rank_zeros_share(two_adapters, fully_sharded):
    whole = resolve("tiny")
    (_, b) = read_adapters(str(two_adapters), whole, RANK)
    model = LlamaLoRA(shard(whole, 2), max_loras=1, rank=RANK, max_tokens=4, context_len=8, dtype=torch.float32,
                      device="cpu", fully_sharded=fully_sharded)
    fill_slots(model, (b,))
    t, s = read_tensors(b), {m.a_key: m.scale for m in b.modules}
    key = f"{PREFIX}.0.self_attn"
    rows = RANK // 2 if fully_sharded else RANK  # fully sharded: half of A's rank per column-parallel slice
    a_q, b_k = lora_of(model, 0, 0, "qkv", 0)[0], lora_of(model, 0, 0, "qkv", 1)[1]
    torch.testing.assert_close(a_q, t[f"{key}.q_proj.lora_A.weight"][:rows])
    torch.testing.assert_close(b_k, t[f"{key}.k_proj.lora_B.weight"][:KV // 2] * s[f"{key}.k_proj.lora_A.weight"])
    o = model.layers[0].o  # row-parallel: its A's first half of the inputs; fully sharded, B's first half of the outputs
    torch.testing.assert_close(o.lora_a[0], t[f"{key}.o_proj.lora_A.weight"][:, :Q // 2])
    outputs = HIDDEN // 2 if fully_sharded else HIDDEN
    torch.testing.assert_close(o.lora_b[0], t[f"{key}.o_proj.lora_B.weight"][:outputs] * s[f"{key}.o_proj.lora_A.weight"])
    mlp = f"{PREFIX}.0.mlp"
    torch.testing.assert_close(model.layers[0].down.lora_a[0], t[f"{mlp}.down_proj.lora_A.weight"][:, :INTER // 2])
    up_a, up_b = lora_of(model, 0, 0, "gate_up", 1)
    torch.testing.assert_close(up_a, t[f"{mlp}.up_proj.lora_A.weight"][:rows])
    torch.testing.assert_close(up_b, t[f"{mlp}.up_proj.lora_B.weight"][:INTER // 2] * s[f"{mlp}.up_proj.lora_A.weight"])


def test_loads_from_the_bank_leave_the_slots_as_filling_them_does(two_adapters):
    adapters = read_adapters(str(two_adapters), resolve("tiny"), RANK)
    model, want = build(resolve("tiny"), adapters), build(resolve("tiny"), adapters)
    loader = AdapterLoader(model, adapters=adapters)
    assert len(loader.bank) == 2 and loader.ops == 4 * len(loader.parts) + 1  # the ranks differ: the slot's too
    loader.load(0, 1)
    loader.load(2, 1)
    fill_slot(want, 0, adapters[1])
    fill_slot(want, 2, adapters[1])
    for got, ref in zip(model.state_dict().values(), want.state_dict().values()):
        torch.testing.assert_close(got, ref)
    assert model.slot_rank.tolist() == [16, 16, 16]


def test_loads_write_the_expert_lora_flag_and_restore_puts_each_adapter_back(tmp_path):
    """Each MoE layer's flag, as vLLM keeps it: the adapter with experts in layer 1 only is flagged
    there, not in layer 0."""
    experts = module_tensors(1, "block_sparse_moe.experts.1.w1", 8, HIDDEN, 64, np.random.default_rng(4))
    write(tmp_path, adapter_files("a", 8, 8, ("q_proj",)))
    write(tmp_path, adapter_files("b", 8, 8, ("q_proj",), tensors=experts, seed=5))
    cfg = resolve("tiny-moe")
    adapters = read_adapters(str(tmp_path), cfg, RANK)
    model, want = build(cfg, adapters), build(cfg, adapters)
    loader = AdapterLoader(model, adapters=adapters)
    assert loader.ops == 4 * len(loader.parts) + 1  # one rank, but not all with expert LoRA: the flag too
    assert model.expert_lora_enabled[:, :3].tolist() == [[0, 0, 0], [0, 1, 0]]
    loader.load(0, 1)
    loader.load(1, 0)
    assert model.expert_lora_enabled[:, :3].tolist() == [[0, 0, 0], [1, 0, 0]]
    loader.restore()
    assert model.expert_lora_enabled[:, :3].tolist() == [[0, 0, 0], [0, 1, 0]]
    assert model.expert_lora_enabled[:, -1].tolist() == [0, 0]  # the unused last entry
    for got, ref in zip(model.state_dict().values(), want.state_dict().values()):
        torch.testing.assert_close(got, ref)


def test_a_residency_schedule_says_what_the_slots_hold_at_each_turn():
    """Each step's running requests find their adapters in their slots, when the slots start a
    turn as ``slots_at`` says and take the step's loads."""
    adapters = Adapters(6, None, 4)
    steps = simulate(parse_workload("zipf:1"), adapters, clients=5, max_loras=3, steps=40, seed=1)
    at = steps.slots_at(range(0, 40, 10))
    assert at[0] == steps.first_slots and sorted(at) == [0, 10, 20, 30]
    for start in at:
        held = list(at[start])
        for i in range(start, min(start + 10, 40)):
            for slot, adapter in steps.loads[i]:
                held[slot] = adapter
            for slot, adapter in zip(steps.batches[i], steps.requests[i]):
                assert slot < 0 or held[slot] == adapter


def test_a_glob_of_adapter_folders_and_one_folder(two_adapters):
    cfg = resolve("tiny")
    assert [a.name for a in read_adapters(str(two_adapters / "*"), cfg, RANK)] == ["a", "b"]
    assert [a.name for a in read_adapters(str(two_adapters / "b"), cfg, RANK)] == ["b"]
    assert [m.layer for m in read_adapters(str(two_adapters / "a"), resolve("tiny", 1), RANK)[0].modules] == [0] * 3


@pytest.mark.parametrize("change,says", [
    ({"config": {"r": 4}}, "rank 8 in its weights, 4 in adapter_config.json"),
    ({"config": {"peft_type": "IA3"}}, "only LoRA adapters"),
    ({"config": {"modules_to_save": ["lm_head"]}}, "modules_to_save"),
    ({"config": {"bias": "all"}}, "bias 'all'"),
    ({"config": {"lora_alpha": "x"}}, "lora_alpha"),
    ({"layers": (0, 5)}, "targets layers.5, but tiny has 2 layers"),
    ({"config": {"lora_bias": True}}, "trained biases"),
    ({"config": {"rank_pattern": {"q_proj(": 4}}}, "is not a regular expression"),
    ({"tensors": module_tensors(0, "block_sparse_moe.experts.0.w1", 8, HIDDEN, 64, np.random.default_rng(0))},
     "which layer 0 of tiny (dense) has no LoRA linear"),
])
def test_what_cannot_be_served_is_refused_in_one_line(tmp_path, change, says):
    write(tmp_path, adapter_files("x", **change))
    with pytest.raises(UserError, match=re.escape(says)):
        read_adapters(str(tmp_path / "x"), resolve("tiny"), RANK)


def test_an_expert_past_the_models_is_refused(tmp_path):
    write(tmp_path, adapter_files("x", tensors=module_tensors(0, "block_sparse_moe.experts.16.w2", 8, 64, HIDDEN,
                                                              np.random.default_rng(0))))
    with pytest.raises(UserError, match="tiny-moe has 16 experts per layer"):
        read_adapters(str(tmp_path / "x"), resolve("tiny-moe"), RANK)


def test_a_bank_of_adapters_that_does_not_fit_the_hosts_memory_is_refused():
    spec = SimpleNamespace(adapter_dir="x", adapters=1000, rank=64, dtype="float32", rank_model=resolve("tiny"),
                           fully_sharded_loras=False)
    with pytest.raises(UserError, match="its 1000 adapters at --rank 64 take .* of pinned host memory"):
        check_adapter_bank(spec, Machine(cuda=False, free_ram_bytes=2**29), lambda name: "--adapters")  # 1 GiB needed
    check_adapter_bank(spec, Machine(cuda=False, free_ram_bytes=2**40), lambda name: "--adapters")


@pytest.mark.e2e
def test_a_sweep_and_a_check_on_the_users_adapters(two_adapters, tmp_path, capsys):
    common = ["--model", "tiny", "--max-loras", "3", "--device", "cpu", "--adapters", str(two_adapters),
              "--strategy", "max", "--out", str(tmp_path / "out")]
    assert main(["sweep", *common, "--concurrency", "2", "--iters", "3", "--warmup", "1", "--workload", "uniform",
                 "--output-tokens", "2"]) == 0
    run = next((tmp_path / "out").iterdir())
    rows = pd.read_parquet(run / "points.parquet")
    assert (rows.status == "ok").all() and rows.correct.all()
    assert set(rows.adapter_dir) == {str(two_adapters)} and set(rows.adapters) == {2}
    assert [list(r) for r in rows.slot_ranks] == [[8, 16, 8]] * len(rows)
    assert set(rows["mode"]) == {"fixed", "residency"}
    assert json.loads((run / "run.json").read_text())["spec"]["adapter_dir"] == str(two_adapters)
    assert rows.load_one_copy_alone_ms_median.notna().all() and rows.storage_read_cold_ms_median.notna().all()
    assert set(read_load_paths(run).path) == {"one-copy", "pageable", "storage-cold", "storage-warm"}  # no GPU: no overlap
    assert main(["report", str(run)]) == 0
    assert "**The other load paths" in (run / "report.md").read_text()
    assert f"the user's PEFT adapters: {two_adapters} (2 adapters, slots at ranks 8, 16, 8" in (run / "report.md").read_text()
    capsys.readouterr()
    assert main(["check", *common]) == 0
    assert "0 wrong" in capsys.readouterr().out


@pytest.mark.e2e
@pytest.mark.parametrize("load_path", ["per-slice", "one-copy"])
def test_recommend_prices_cpu_misses_with_the_storage_read_and_each_load_path(tmp_path, capsys, load_path):
    for i in range(4):
        write(tmp_path / "four", adapter_files(f"x{i}", 8, 16, ("q_proj", "o_proj"), seed=i))
    folder = str(tmp_path / "four")
    assert main(["sweep", "--model", "tiny", "--max-loras", "2", "--device", "cpu", "--adapters", folder,
                 "--max-cpu-loras", "2", "--strategy", "max", "--concurrency", "1,2", "--iters", "12", "--warmup", "1",
                 "--workload", "uniform", "--output-tokens", "2", "--load-path", load_path,
                 "--out", str(tmp_path / "out")]) == 0
    run = next((tmp_path / "out").iterdir())
    rows = pd.read_parquet(run / "points.parquet")
    res = rows[rows["mode"] == "residency"].iloc[0]
    assert res.load_path == load_path and res.storage_reads_per_step > 0  # its misses read their files in the steps
    steps = read_samples(run, [int(res.point)])
    assert steps.reads.sum() == round(res.storage_reads_per_step * len(steps)) and (steps.reads <= steps.loads).all()
    view = RunView.read(run)
    v = validation(view).iloc[0]
    assert v.load_path == load_path and v.predicted_ms > 0 and v.window_sd_pct > 0  # runs this short vary
    if load_path == "one-copy":  # the same steps priced as per-slice loads differ by the two loads' prices only
        residency = view.rows["mode"] == "residency"
        as_slice = validation(dataclasses.replace(view, rows=view.rows.assign(
            load_path=view.rows.load_path.where(~residency, "per-slice")))).iloc[0]
        per_slice = float(np.median(view.pooled_loads[res.kernels]))
        one_copy = rows.drop_duplicates("max_loras").load_one_copy_ms_median.median()
        assert as_slice.predicted_ms - v.predicted_ms == pytest.approx(v.loads_per_step * (per_slice - one_copy))
        unread = validation(dataclasses.replace(view, rows=view.rows.assign(  # as a run made before misses were read
            storage_reads_per_step=view.rows.storage_reads_per_step.where(~residency, np.nan)))).iloc[0]
        rate = rows.drop_duplicates("max_loras").storage_read_cold_gb_s.median() * 1e6  # bytes per ms
        assert v.predicted_ms - unread.predicted_ms == pytest.approx(steps.read_bytes.mean() / rate)
        assert (steps.read_bytes == steps.reads * (tmp_path / "four" / "x0" / "adapter_model.safetensors").stat().st_size).all()
        return
    capsys.readouterr()
    assert main(["recommend", str(run), "--adapters", folder, "--workload", "uniform", "--max-cpu-loras", "2",
                 "--output-tokens", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # as Rich wrapped it, unwrapped
    assert "miss the CPU cache of 2: each pays its file's bytes at the run's cold read rate" in out
    assert "loads per-slice:" in out and "loads one-copy:" in out
    section = next(iter(json.loads((run / "recommendation.json").read_text())["residency"].values()))[0]
    chosen = section["chosen"]
    size = (tmp_path / "four" / "x0" / "adapter_model.safetensors").stat().st_size  # all four alike
    assert chosen["cpu_misses_per_step"] > 0 and chosen["miss_read_gb_s"] > 0
    assert chosen["miss_bytes_per_step"] == pytest.approx(chosen["cpu_misses_per_step"] * size, rel=1e-3)
    assert chosen["miss_ms_per_step"] == pytest.approx(chosen["miss_bytes_per_step"] / (chosen["miss_read_gb_s"] * 1e6),
                                                       rel=1e-3)  # its bytes at the cold reads' rate
    assert chosen["expected_step_ms"] == pytest.approx(
        chosen["decode_ms"] + chosen["loads_per_step"] * chosen["load_ms"] + chosen["miss_ms_per_step"], rel=1e-3)
    assert [p["path"] for p in section["load_paths"]] == ["per-slice", "one-copy"]  # no GPU: no overlapped path
    assert "cpu_cache" not in section  # given, not chosen

    def cache(*extra):
        capsys.readouterr()
        assert main(["recommend", str(run), "--adapters", folder, "--workload", "uniform", "--output-tokens", "2",
                     *extra]) == 0
        text = " ".join(capsys.readouterr().out.split())
        sections = json.loads((run / "recommendation.json").read_text())["residency"]
        return text, sections[next(k for k in sections if k.startswith("uniform"))][0]

    out, section = cache()  # the CPU cache chosen: every size priced with its misses at the storage read
    choice = section["cpu_cache"]
    sizes = {x["max_cpu_loras"]: x for x in choice["sizes"]}
    assert sorted(sizes) == [2, 3, 4] and sizes[4]["misses_per_step"] == 0 < sizes[2]["misses_per_step"]
    miss, decode = size / (section["chosen"]["miss_read_gb_s"] * 1e6), section["chosen"]["decode_ms"]
    for x in sizes.values():  # the same configuration; only the misses change
        assert x["expected_step_ms"] == pytest.approx(
            decode + section["chosen"]["loads_per_step"] * section["chosen"]["load_ms"] + x["misses_per_step"] * miss,
            rel=1e-3)
    fastest = max(x["tokens_per_s"] for x in sizes.values())
    pick = choice["chosen"]["max_cpu_loras"]
    assert sizes[pick]["tokens_per_s"] >= 0.98 * fastest
    assert all(x["tokens_per_s"] < 0.98 * fastest for s, x in sizes.items() if s < pick)  # the smallest that does
    assert f"--max-cpu-loras {pick}" in section["vllm"]["flags"] and f"CPU cache: --max-cpu-loras {pick}" in out
    one = sizes[2]["host_bytes"] / 2  # one adapter's own bytes: q and o at rank 8, both layers, in float32
    assert one == 2 * 8 * ((HIDDEN + Q) + (Q + HIDDEN)) * 4  # layers x rank x (q: K + N, o: K + N) x bytes
    out, section = cache("--host-memory-budget", str(2.5 * one / 2**30))
    assert section["cpu_cache"]["chosen"]["max_cpu_loras"] == 2 and section["cpu_cache"]["host_memory_budget_bytes"] > 0
    out, section = cache("--host-memory-budget", str(one / 2**30))
    assert section["cpu_cache"]["chosen"] is None and "no cache of at least max_loras adapters fits" in out


def test_the_cpu_cache_sizes_tried():
    from lorabench.analysis.cpu_cache import candidates

    assert candidates(4, 64) == [4, 8, 16, 32, 48, 64]
    assert candidates(3, 10) == [3, 5, 6, 7, 10] and candidates(5, 5) == [5]


def test_the_adapters_script_writes_peft_folders_lorabench_reads(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "scripts/peft_adapters.py", str(tmp_path / "pa"), "--model", "tiny",
                           "--count", "3", "--ranks", "8,16", "--targets", "all,attention", "--dtype", "float32"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    adapters = read_adapters(str(tmp_path / "pa"), resolve("tiny"), 16)
    assert [(a.rank, len(a.modules)) for a in adapters] == [(8, 14), (16, 14), (8, 8)]  # 2 layers: 7 modules, then q k v o
    assert "3 adapters" in done.stdout.splitlines()[-1]


@pytest.mark.parametrize("preset", PRESETS)
def test_every_model_familys_module_names_map_onto_its_lora_linears(tmp_path, preset):
    """An adapter on every module vLLM serves LoRA on, in the first and last layers, at each
    preset's own shapes (worked out here from its config, not from lorabench's linears), with its
    family's names: Llama/Mistral/Qwen attention and MLP, Mixtral's block_sparse_moe.experts.E.w1/w3/w2,
    the others' mlp.experts.E.*, Qwen-MoE's shared expert; each lands on its linear, slice and expert."""
    from lorabench.config.models import moe_layer

    cfg = resolve(preset)
    r, q, kv = 2, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    tensors, want = {}, set()

    def module(layer, path, k, n, linear, slice_, expert=-1):
        tensors[f"{PREFIX}.{layer}.{path}.lora_A.weight"] = np.zeros((r, k), dtype=np.float16)
        tensors[f"{PREFIX}.{layer}.{path}.lora_B.weight"] = np.zeros((n, r), dtype=np.float16)
        want.add((layer, linear, slice_, expert))

    for layer in sorted({0, cfg.full_layers - 1}):
        for i, (name, n) in enumerate((("q_proj", q), ("k_proj", kv), ("v_proj", kv))):
            module(layer, f"self_attn.{name}", cfg.hidden, n, "qkv", i)
        module(layer, "self_attn.o_proj", q, cfg.hidden, "o", 0)
        if cfg.moe is None or not moe_layer(cfg, layer):
            mlp = cfg.intermediate
            module(layer, "mlp.gate_proj", cfg.hidden, mlp, "gate_up", 0)
            module(layer, "mlp.up_proj", cfg.hidden, mlp, "gate_up", 1)
            module(layer, "mlp.down_proj", mlp, cfg.hidden, "down", 0)
            continue
        e, i = cfg.moe.experts - 1, cfg.moe.intermediate  # the last expert
        names = (("block_sparse_moe", "w1", "w3", "w2") if cfg.architecture == "MixtralForCausalLM"
                 else ("mlp", "gate_proj", "up_proj", "down_proj"))
        module(layer, f"{names[0]}.experts.{e}.{names[1]}", cfg.hidden, i, "w13", 0, e)
        module(layer, f"{names[0]}.experts.{e}.{names[2]}", cfg.hidden, i, "w13", 1, e)
        module(layer, f"{names[0]}.experts.{e}.{names[3]}", i, cfg.hidden, "w2", 0, e)
        if cfg.moe.shared_intermediate:
            s = cfg.moe.shared_intermediate
            module(layer, "mlp.shared_expert.gate_proj", cfg.hidden, s, "gate_up", 0)
            module(layer, "mlp.shared_expert.up_proj", cfg.hidden, s, "gate_up", 1)
            module(layer, "mlp.shared_expert.down_proj", s, cfg.hidden, "down", 0)
    write(tmp_path, adapter_files("all", r, 4, (), tensors=tensors))
    (adapter,) = read_adapters(str(tmp_path / "all"), cfg, RANK)
    assert {(m.layer, m.linear, m.slice, m.expert) for m in adapter.modules} == want
    assert {m.scale for m in adapter.modules} == {2.0} and adapter.has_expert_lora == (cfg.moe is not None)
