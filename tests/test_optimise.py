"""Strategy auto: the cost model reads measured points (and says when it interpolates), the
graph count matches the dispatcher's, the dynamic programme finds the exact optimum within the
budget, and ``lorabench recommend`` prints and records it."""

import itertools
import json

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import H200_CARD, H200_SLOTS
from lorabench.kernels import get_backend

from lorabench.analysis import search
from lorabench.analysis.costmodel import (
    EXTRAPOLATED,
    INTERPOLATED,
    MEASURED,
    CostModel,
    Pricing,
    lora_graphs,
)
from lorabench.analysis.optimise import auto_recommendations
from lorabench.analysis.search import fits
from lorabench.cli import main
from lorabench.config.models import resolve
from lorabench.config.strategies import capture_counts
from lorabench.config.workload import parse_workload
from lorabench.runtime.dispatch import Dispatcher
from lorabench.runtime.model import LlamaLoRA

L, SIZES, CONC = 6, [1, 2, 6], [1, 2, 6]
MB = 1e6


def step_ms(c, n, g):
    """A made-up cost: each launched slot costs more at larger batches; not linear in g."""
    return 0.0 if n == 0 and g else 5 + 0.5 * c + (0 if n == 0 else 0.3 + 0.05 * c * g + 0.02 * g * g + 0.1 * n)


def synthetic_run(strategies=("max", "pow2", "dense"), mem_per_graph=2 * MB, cap_per_graph=0.01, conc=CONC):
    rows = []
    for s in strategies:
        counts = capture_counts(s, L)
        graphs = lora_graphs(counts, SIZES, L)
        for c in conc:
            for n in range(min(c, L) + 1):
                # past the largest capture size a step runs eagerly with launch count n
                g = 0 if n == 0 else n if c > SIZES[-1] else next(k for k in counts if k >= n)
                rows.append({"status": "ok", "kernels": "triton", "max_loras": L, "strategy": s, "mode": "fixed",
                             "concurrency": c, "n_active": n, "graph_loras": g, "step_ms_median": step_ms(c, n, g),
                             "captured_counts": counts, "capture_sizes": SIZES, "rank": 16, "run_id": "synthetic",
                             "graph_mem_bytes": 100 * MB + mem_per_graph * graphs, "capture_s": 0.05 + cap_per_graph * graphs,
                             "startup_s": 2.0 + 0.05 + cap_per_graph * graphs, "device": "cuda"})
    return pd.DataFrame(rows)


def test_step_times_measured_interpolated_and_extrapolated():
    m = CostModel(synthetic_run(("max", "dense")), "triton", L)
    assert m.step(6, 3, 3) == (step_ms(6, 3, 3), MEASURED)  # dense
    assert m.step(6, 3, 6) == (step_ms(6, 3, 6), MEASURED)  # max
    ms, src = m.step(6, 3, 4)  # between the measured 3 and 6
    assert src == INTERPOLATED and step_ms(6, 3, 3) < ms < step_ms(6, 3, 6)
    m2 = CostModel(synthetic_run(("max",)), "triton", L)
    assert m2.step(6, 3, 4)[0] is None  # one launch count per (c, n) and no slope anywhere: cannot say
    m3 = CostModel(synthetic_run(("max", "pow2")), "triton", L)
    ms, src = m3.step(6, 3, 3)  # pow2 measured 4, max 6: below both -> the fitted slope
    assert src == EXTRAPOLATED and ms < step_ms(6, 3, 4)


def test_graph_costs_are_fitted_per_graph():
    m = CostModel(synthetic_run(), "triton", L)
    assert m.graph_memory([3, 6]) == pytest.approx(100 * MB + 2 * MB * lora_graphs([3, 6], SIZES, L))
    assert m.memory(0) == pytest.approx(100 * MB)  # below every measured set: the nearest slope


def test_graph_costs_are_exact_at_the_measured_sets():
    """Graph memory comes in allocator blocks, so it is not linear in the graph count; a set
    that was measured is priced at what it measured, others between their neighbours."""
    df = synthetic_run()
    sets = df.drop_duplicates("strategy").set_index("strategy")
    bump = {"max": 0.0, "pow2": 1.5 * MB, "dense": 0.0}  # pow2 took more than a straight line says
    df["graph_mem_bytes"] += df.strategy.map(bump)
    m = CostModel(df, "triton", L)
    for name in ("max", "pow2", "dense"):
        counts = [int(x) for x in sets.loc[name, "captured_counts"]]
        assert m.graph_memory(counts) == pytest.approx(sets.loc[name, "graph_mem_bytes"] + bump[name])
    g = [lora_graphs([int(x) for x in sets.loc[s, "captured_counts"]], SIZES, L) for s in ("max", "pow2")]
    mid = m.memory((g[0] + g[1]) / 2)
    assert m.memory(g[0]) < mid < m.memory(g[1])


@pytest.mark.parametrize("counts", [[4], [1, 2, 4], [1, 2, 3, 4], [3, 4], [2, 4]])
def test_graph_count_is_the_dispatchers(counts):
    model = LlamaLoRA(resolve("tiny"), max_loras=4, rank=8, max_tokens=8, context_len=8, dtype=torch.float32, device="cpu")
    d = Dispatcher(model, get_backend("torch"), max_loras=4, capture_sizes=[1, 2, 8], counts=counts, use_graphs=False)
    assert lora_graphs(counts, [1, 2, 8], 4) == d.num_graphs - 3  # minus one no-LoRA graph per size


def brute_force(pricing: Pricing, budget: int):
    best = None
    for r in range(L):
        for extra in itertools.combinations(range(1, L), r):
            plan = pricing.plan(list(extra) + [L])
            if plan and plan.graphs <= budget and (best is None or plan.expected_ms < best.expected_ms - 1e-12):
                best = plan
    return best


@pytest.mark.parametrize("workload", ["uniform", "zipf:1.5", "base:0.5", "single"])
@pytest.mark.parametrize("memory_mb", [None, 112, 108, 106])
def test_dynamic_programme_finds_the_exact_optimum(monkeypatch, workload, memory_mb):
    monkeypatch.setattr(search, "NOISE", 0.0)
    m = CostModel(synthetic_run(), "triton", L)
    wl = parse_workload(workload)
    pricing = Pricing(m, {c: wl.active_count_pmf(c, L) for c in CONC})
    budget = None if memory_mb is None else memory_mb * MB
    got = search.best(pricing, budget)
    limit = 99 if memory_mb is None else (memory_mb - 100) // 2  # the synthetic run's 100 MB + 2 MB per graph
    want = brute_force(pricing, limit)
    assert got is not None and want is not None
    assert got.expected_ms == pytest.approx(want.expected_ms, abs=1e-12)
    assert budget is None or got.graph_mem_bytes <= budget + 1


@pytest.mark.parametrize("memory_mb", [106, 108, 110])
def test_under_a_budget_dense_exceeds_auto_beats_what_fits(memory_mb):
    m = CostModel(synthetic_run(), "triton", L)
    wl = parse_workload("uniform")
    pricing = Pricing(m, {c: wl.active_count_pmf(c, L) for c in CONC})
    budget = memory_mb * MB
    base = search.baselines(pricing)
    assert not fits(base["dense"], budget, None)
    got = search.best(pricing, budget)
    fitting = [p.expected_ms for name, p in base.items() if name in ("max", "pow2") and fits(p, budget, None)]
    assert fits(got, budget, None) and got.expected_ms <= min(fitting) * (1 + search.NOISE) + 1e-12


def test_no_set_fits_a_budget_below_max():
    m = CostModel(synthetic_run(), "triton", L)
    pricing = Pricing(m, {c: parse_workload("uniform").active_count_pmf(c, L) for c in CONC})
    assert search.best(pricing, 100.5 * MB) is None


def test_gains_below_noise_do_not_buy_graphs():
    """Where specialisation saves almost nothing, auto keeps max's single set."""
    df = synthetic_run()
    df["step_ms_median"] = 5.0 + 1e-4 * df.graph_loras  # a launched slot costs 0.1 us
    pricing = Pricing(CostModel(df, "triton", L), {c: parse_workload("uniform").active_count_pmf(c, L) for c in CONC})
    assert search.best(pricing).counts == [L]


def test_recommend_command(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    synthetic_run().to_parquet(run / "points.parquet")
    assert main(["recommend", str(run), "--workload", "zipf:1.2", "--graph-memory-budget", "110"]) == 0
    out = capsys.readouterr().out
    assert "strategy auto under zipf:1.2" in out and "validate with" in out
    data = json.loads((run / "recommendation.json").read_text())
    [r] = data["auto"]["zipf:1.2"]
    assert r["auto"]["counts"][-1] == L and r["auto"]["graph_mem_bytes"] <= 110 * 2**20
    assert set(r["baselines"]) == {"max", "pow2", "dense"}
    assert "--strategy '[" in r["validate"]
    if r["auto"]["counts"] != [L]:
        assert "check before enabling" in r["vllm"]["note"] or "--specialize-active-lora" not in r["vllm"]["flags"]
    assert main(["recommend", str(run), "--startup-budget", "-1"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_recommend_on_the_reference_runs(tmp_path):
    """On frozen H200 runs (tests/data): at max_loras 4 nothing pays (auto = max); at 128 slots a set
    as small as max's serves c <= 8 with a grid of 8."""
    card = pd.read_parquet(H200_CARD / "points.parquet")
    [r] = auto_recommendations(card, "uniform")
    assert r["auto"]["counts"] == [4]
    slots = pd.read_parquet(H200_SLOTS / "points.parquet")
    r128 = next(r for r in auto_recommendations(slots, "uniform") if r["max_loras"] == 128)
    assert r128["auto"]["lora_graphs"] == r128["baselines"]["max"]["lora_graphs"]
    assert r128["baselines"]["max"]["auto_gain_pct"] > 5
    assert np.isclose(r128["baselines"]["pow2"]["auto_gain_pct"], 0, atol=100 * search.NOISE)
    assert r128["auto"]["counts"] != capture_counts("pow2", 128)


SMALL = ["--max-loras", "4", "--concurrency", "1,4", "--iters", "4", "--warmup", "1", "--context-len", "16",
         "--device", "cpu", "--no-check", "--workload", "zipf:1.2"]


def test_sweep_strategy_auto_measures_the_chosen_set(tmp_path, capsys):
    assert main(["sweep", "--out", str(tmp_path / "src"), "--strategy", "max,dense"] + SMALL) == 0
    source = next((tmp_path / "src").glob("*/points.parquet")).parent
    assert main(["sweep", "--out", str(tmp_path / "auto"), "--strategy", "auto,max", "--auto-from", str(source)] + SMALL) == 0
    run = next((tmp_path / "auto").glob("*/points.parquet")).parent
    df = pd.read_parquet(run / "points.parquet")
    auto = df[df.strategy == "auto"]
    [want] = auto_recommendations(pd.read_parquet(source / "points.parquet"), "zipf:1.2")
    assert {tuple(int(x) for x in c) for c in auto.captured_counts} == {tuple(want["auto"]["counts"])}
    wl = auto[auto["mode"] == "workload"]
    assert len(wl) == 2 and wl.predicted_ms.notna().all() and df[df.strategy == "max"].predicted_ms.isna().all()
    assert main(["report", str(run)]) == 0
    assert "## Strategy auto: predicted vs measured" in (run / "report.md").read_text()


def test_auto_must_sweep_the_sizes_it_was_priced_for(tmp_path, capsys):
    assert main(["sweep", "--out", str(tmp_path / "src"), "--strategy", "max"] + SMALL) == 0
    source = next((tmp_path / "src").glob("*/points.parquet")).parent
    argv = ["sweep", "--out", str(tmp_path), "--strategy", "auto", "--auto-from", str(source), "--capture-sizes", "1,2,4"] + SMALL
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "priced for the --auto-from run's capture sizes" in err[0]


@pytest.mark.parametrize("args,needle", [
    (["--strategy", "auto"], "needs --auto-from"),
    (["--strategy", "max", "--auto-from", "x"], "apply to --strategy auto only"),
    (["--strategy", "auto", "--auto-from", "no/such/run"], "is not a folder"),
    (["--strategy", "auto", "--auto-from", ".", "--graph-memory-budget", "-5"], "--graph-memory-budget"),
])
def test_bad_auto_input_is_one_line(tmp_path, capsys, args, needle):
    assert main(["sweep", "--out", str(tmp_path)] + SMALL + args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


def test_falling_memory_is_taken_as_flat():
    """Free-memory deltas are noisy; more graphs never free memory, so a fall means 'flat'."""
    df = synthetic_run(mem_per_graph=-0.5 * MB)
    m = CostModel(df, "triton", L)
    most = df.drop_duplicates("strategy").graph_mem_bytes.max()  # the set with the fewest graphs
    assert m.memory(0) == pytest.approx(most) and m.memory(1000) == pytest.approx(most)


def test_budgets_bind_when_graphs_look_free():
    """A flat fit (more graphs, no more memory) still has its fixed part: a budget below it fits
    nothing, one above it fits every set."""
    m = CostModel(synthetic_run(mem_per_graph=-0.5 * MB, cap_per_graph=-0.001), "triton", L)
    pricing = Pricing(m, {c: parse_workload("uniform").active_count_pmf(c, L) for c in CONC})
    assert search.best(pricing, 10 * MB) is None and search.best(pricing, None, 0.5) is None
    assert search.best(pricing, 200 * MB) is not None and search.best(pricing, None, 10.0) is not None


def test_concurrency_past_every_capture_size_is_priced_eagerly():
    """c = 8 > the largest size 6 runs eagerly at launch count n under every set: it prices the
    same for all of them, and max and pow2 are still priced and fit their budget."""
    df = synthetic_run(conc=CONC + [8])
    m = CostModel(df, "triton", L)
    pricing = Pricing(m, {c: parse_workload("uniform").active_count_pmf(c, L) for c in m.concurrency})
    base = search.baselines(pricing)
    assert base["max"] is not None and base["pow2"] is not None
    assert base["max"].expected_ms_by_c[8] == pytest.approx(base["dense"].expected_ms_by_c[8])
    budget = base["pow2"].graph_mem_bytes  # below dense's
    assert search.best(pricing, budget) is not None


def test_a_missing_point_is_named_not_blamed_on_the_budget():
    df = synthetic_run()
    df = df[~((df.concurrency == 6) & (df.n_active == 3))]
    pricing = Pricing(CostModel(df, "triton", L), {c: parse_workload("uniform").active_count_pmf(c, L) for c in CONC})
    with pytest.raises(ValueError, match="c=6, n=3"):
        search.best(pricing)


def test_configurations_that_failed_their_check_do_not_price_sets():
    df = synthetic_run()
    df["correct"] = df.strategy != "dense"
    df.loc[df.strategy == "dense", "step_ms_median"] = 0.1  # wrong and fast
    m = CostModel(df, "triton", L)
    assert all(ms > 1 for by_g in m.t.values() for ms in by_g.values())


def test_recommend_then_report_keeps_the_auto_section(tmp_path, capsys):
    import shutil

    run = tmp_path / "ref"
    shutil.copytree(H200_CARD, run)
    assert main(["recommend", str(run)]) == 0
    assert main(["report", str(run)]) == 0
    assert "uniform" in json.loads((run / "recommendation.json").read_text())["auto"]


@pytest.mark.parametrize("argv,needle", [
    (["check", "--strategy", "auto,max", "--device", "cpu"], "fixed capture sets"),
    (["recommend", str(H200_CARD), "--graph-memory-budget", "nan"], "--graph-memory-budget"),
])
def test_more_bad_input_is_one_line(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
