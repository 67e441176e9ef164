"""Loading adapters into slots: the copies land where vLLM's do, captured graphs replay with
what was loaded, residency steps record their loads, and a sweep with --adapters runs residency
points end to end (rows, samples, timed loads, the report's section, recommend --adapters)."""

import json

import pandas as pd
import pytest
import torch
from conftest import DEVICE, HAS_CUDA

from lorabench.cli import main
from lorabench.config.models import resolve
from lorabench.config.strategies import capture_counts
from lorabench.kernels import get_backend
from lorabench.runtime.adapters import LOADS, AdapterLoader, time_loads
from lorabench.runtime.check import row_errors
from lorabench.runtime.dispatch import Dispatcher
from lorabench.runtime.model import LlamaLoRA, LoRALinear
from lorabench.runtime.moe import MoEMLP
from lorabench.runtime.timing import time_steps
from lorabench.storage.samples import read_loads, read_samples

DTYPE = torch.float16 if HAS_CUDA else torch.float32
TOL = 3e-2 if HAS_CUDA else 1e-4


def model(max_loras=4) -> LlamaLoRA:
    return LlamaLoRA(resolve("tiny"), max_loras=max_loras, rank=16, max_tokens=8, context_len=16, dtype=DTYPE,
                     device=DEVICE, seed=0)


def test_a_load_copies_every_slice_of_every_linear_into_the_slot():
    m = model()
    loader = AdapterLoader(m)
    linears = [x for x in m.modules() if isinstance(x, LoRALinear)]
    assert loader.ops == 4 * sum(len(x.slice_starts) - 1 for x in linears) == 4 * 2 * 7  # 2 layers, 7 slices
    before = [(x.lora_a.clone(), x.lora_b.clone()) for x in linears]
    loader.load(2, 1)  # bank 1 holds slot 1's adapter
    if HAS_CUDA:
        torch.cuda.synchronize()
    for x, (a, b) in zip(linears, before):
        assert torch.equal(x.lora_a[2], a[1]) and torch.equal(x.lora_b[2], b[1])
        for other in (0, 1, 3):
            assert torch.equal(x.lora_a[other], a[other]) and torch.equal(x.lora_b[other], b[other])
    if HAS_CUDA:
        assert all(h.is_pinned() for part in loader.bank for pair in part for h in pair)


def test_a_moe_load_copies_every_experts_lora_as_vllm_does():
    m = LlamaLoRA(resolve("tiny-moe"), max_loras=3, rank=8, max_tokens=8, context_len=16, dtype=DTYPE,
                  device=DEVICE, seed=0)
    loader = AdapterLoader(m)
    experts = [x for x in m.modules() if isinstance(x, MoEMLP)]
    dense = sum(len(x.slice_starts) - 1 for x in m.modules() if isinstance(x, LoRALinear))
    assert experts and loader.ops == 4 * (dense + 3 * len(experts))  # w13's gate and up, w2: each A and B
    before = [[w.clone() for w in (x.w13_a, x.w13_b, x.w2_a, x.w2_b)] for x in experts]
    loader.load(0, 1)  # bank 1 holds slot 1's adapter
    if HAS_CUDA:
        torch.cuda.synchronize()
    for x, old in zip(experts, before):
        for w, o in zip((x.w13_a, x.w13_b, x.w2_a, x.w2_b), old):
            assert torch.equal(w[:, 0], o[:, 1]) and torch.equal(w[:, 1:], o[:, 1:])


def test_a_moe_sweep_with_adapters_times_expert_loads_and_recommend_prices_them(tmp_path, capsys):
    code = main(["sweep", "--out", str(tmp_path), "--max-loras", "2", "--concurrency", "1,4", "--strategy", "max",
                 "--kernels", "torch", "--iters", "8", "--warmup", "1", "--context-len", "16", "--workload", "uniform",
                 "--adapters", "6", "--output-tokens", "4", "--device", DEVICE, "--model", "tiny-moe"])
    assert code == 0
    run = next(tmp_path.glob("*/points.parquet")).parent
    df = pd.read_parquet(run / "points.parquet")
    assert (df.status == "ok").all() and (df["mode"] == "residency").sum() == 1
    assert df.load_alone_ms_median.notna().all() and (df.load_ops == 4 * 2 * (4 + 3)).all()
    # per layer: q, k, v and o's slices, and the experts' w13 gate, up and w2 (tiny-moe: every MLP a MoE)
    assert (df.lora_bytes_per_slot > df.expert_lora_bytes_per_slot).all()
    assert main(["recommend", str(run), "--adapters", "6", "--workload", "uniform", "--output-tokens", "4"]) == 0
    assert "--max-loras 2" in capsys.readouterr().out


def test_loads_are_timed_in_a_step_and_alone():
    m = model()
    d = Dispatcher(m, get_backend("torch"), max_loras=4, capture_sizes=[1, 2], counts=[4], use_graphs=HAS_CUDA)
    d.warm_up()
    d.capture()
    t = time_loads(AdapterLoader(m), d)
    assert all(len(v) == LOADS for v in t.values())
    assert (t["alone_ms"] > 0).all() and (t["host_us"] > 0).all()
    assert abs(float(pd.Series(t["load_ms"]).median())) < 100 * float(pd.Series(t["alone_ms"]).median())


def test_a_captured_graph_replays_with_the_adapter_loaded_after_capture():
    """Graphs read the slots' storage, never a copy taken at capture: after a load, a replay of
    the same graph gives the new adapter's answer (the reference, which reads the slots too)."""
    m = model()
    d = Dispatcher(m, get_backend("triton" if HAS_CUDA else "torch"), max_loras=4, capture_sizes=[1, 4],
                   counts=capture_counts("max", 4), use_graphs=HAS_CUDA)
    d.warm_up()
    d.capture()
    loader = AdapterLoader(m, bank=4)
    slots = [3, 3, -1, 0]
    before = d.launch(d.prepare(slots)).clone()
    loader.load(3, 1)  # slot 3 now holds slot 1's adapter
    after = d.launch(d.prepare(slots)).clone()
    ref = d.reference(slots)
    assert row_errors(after, ref).max().item() < TOL
    assert row_errors(before[:2], after[:2]).max().item() > 10 * TOL  # the adapter tokens changed
    assert row_errors(before[2:], after[2:]).max().item() < TOL  # the base and slot-0 tokens did not


def test_residency_steps_record_their_tokens_and_loads():
    m = model()
    d = Dispatcher(m, get_backend("torch"), max_loras=4, capture_sizes=[1, 2, 4], counts=[4], use_graphs=HAS_CUDA)
    d.warm_up()
    d.capture()
    batches = [[0], [0, 1], [2, -1, 1], [3, 3, 3, 3]]
    loads = [[], [(1, 5)], [(2, 6)], [(3, 7)]]
    s = time_steps(d, batches, 8, 1, loads=loads, loader=AdapterLoader(m))
    assert s.tokens.tolist() == [1, 2, 3, 4] * 2 and s.loads.tolist() == [0, 1, 1, 1] * 2
    assert (s.step_ms > 0).all()
    plain = time_steps(d, batches, 4, 0)
    assert plain.loads.tolist() == [0] * 4 and plain.tokens.tolist() == [1, 2, 3, 4]


@pytest.fixture(scope="module")
def residency_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("residency")
    code = main(["sweep", "--out", str(out), "--max-loras", "2,4", "--concurrency", "1,2,4", "--strategy", "max,pow2",
                 "--iters", "30", "--warmup", "1", "--context-len", "16", "--workload", "uniform,zipf:1.2",
                 "--adapters", "12", "--output-tokens", "6", "--device", DEVICE, "--model", "tiny"])
    assert code == 0
    return next(out.glob("*/points.parquet")).parent


def test_a_sweep_with_adapters_runs_residency_points_at_its_largest_concurrency(residency_run):
    df = pd.read_parquet(residency_run / "points.parquet")
    assert (df.status == "ok").all()
    runs = df[df["mode"] == "residency"]
    assert len(runs) == 2 * 2 * 2 and set(runs.concurrency) == {4} and not (df["mode"] == "workload").any()
    assert (runs.adapters == 12).all() and (runs.max_cpu_loras == 12).all() and (runs.output_tokens == "6").all()
    assert (runs.timed_steps == 30).all() and (runs.loads_per_step > 0).all()
    assert (runs[runs.max_loras == 2].tokens_per_step < 4).all()  # two slots: requests wait
    assert ((runs.tokens_per_s - 1e3 * runs.tokens_per_step / runs.step_ms_mean).abs() < 1e-6 * runs.tokens_per_s).all()
    assert df.load_ms_median.notna().all() and df.load_alone_ms_median.notna().all() and (df.load_ops == 56).all()
    samples = read_samples(residency_run)
    mine = samples[samples.point.isin(runs.point)]
    assert mine.tokens.notna().all() and mine.groupby("point").loads.mean().round(6).tolist() == \
        runs.sort_values("point").loads_per_step.round(6).tolist()
    loads = read_loads(residency_run)
    assert set(loads) == {(df.kernels.iloc[0], 2), (df.kernels.iloc[0], 4)} and all(len(v) == 30 for v in loads.values())


def test_the_report_and_recommend_read_the_residency_run(residency_run, capsys):
    assert main(["report", str(residency_run)]) == 0
    md = (residency_run / "report.md").read_text()
    assert "## Adapters: residency, loads and memory" in md and "predicted ms (same steps)" in md
    assert (residency_run / "residency.png").is_file()
    assert main(["recommend", str(residency_run), "--adapters", "12", "--workload", "zipf:1.2", "--output-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "max_loras" in out and "vLLM: --enable-lora" in out and "--max-cpu-loras 12" in out
    rec = json.loads((residency_run / "recommendation.json").read_text())
    (entry,) = rec["residency"]["zipf:1.2 over 12 adapters"]
    assert entry["chosen"]["max_loras"] in (2, 4) and entry["clients"] == 4
    assert "recommendations" in rec  # the report's own entries stay
    assert main(["report", str(residency_run)]) == 0  # and the report keeps recommend's
    assert json.loads((residency_run / "recommendation.json").read_text())["residency"] == rec["residency"]
