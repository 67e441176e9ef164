"""Intervals and the same-GPU rule: synthetic runs written to disk as a sweep writes them
(points.parquet through PointsWriter, samples/ through write_samples), built from the frozen H200
rows with known differences and known noise. Each point's samples are drawn around its target
median and shifted so that their median is exactly the target: the estimates are exact, only
the intervals' widths come from the noise."""

import json
import re

import numpy as np
import pandas as pd
import pytest
from conftest import H200_CARD, with_schema

from lorabench.analysis.compare import compare
from lorabench.analysis.optimise import auto_recommendations
from lorabench.analysis.points import run_samples, same_gpu
from lorabench.analysis.recommend import recommend
from lorabench.cli import main
from lorabench.storage.results import PointsWriter
from lorabench.storage.samples import write_samples

CARD = pd.read_parquet(H200_CARD / "points.parquet")  # triton, max_loras 4: max, pow2, dense at c = 1, 2, 4, 8
GPU_A = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
GPU_B = "GPU-bbbbbbbb-5555-6666-7777-888888888888"
TIGHT, NOISY = 0.005, 0.12  # relative spread of one step


def write_run(tmp_path, faster=None, noise=TIGHT, steps=100, gpu=None, samples=True, rows=CARD, name="run",
              seed=0) -> "Path":  # noqa: F821
    """A run folder: ``rows`` with max's step times (A/A), scaled per strategy or kernels
    (``faster``: {strategy: 0.05} makes it 5 % faster at every point, or {strategy: {n: 0.05}} at
    those active counts), each point's ``steps`` samples spread by ``noise`` (relative), on GPU
    ``gpu`` ({strategy or kernels: uuid}, GPU_A otherwise), with samples/ unless ``samples`` is
    False. A ``predicted_ms`` in ``rows`` is a factor: the prediction is the point's median times it."""
    rng = np.random.default_rng(seed)
    df = with_schema(rows).reset_index(drop=True)
    df["point"] = range(len(df))
    at = ["max_loras", "concurrency", "n_active", "mode", "workload"]  # every row starts from max's time: A/A
    key = lambda d: list(zip(*(d[c].astype(object).where(d[c].notna(), None) for c in at)))  # noqa: E731
    base = dict(zip(key(CARD[CARD.strategy == "max"]), CARD[CARD.strategy == "max"].step_ms_median))
    df["step_ms_median"] = [base[k] for k in key(df)]
    run = tmp_path / name
    run.mkdir()
    writer = PointsWriter(run)
    writer.flush = lambda: None  # points.parquet once, at the end, not after every row
    for rec in df.astype(object).where(df.notna(), None).to_dict("records"):
        f = (faster or {}).get(rec["strategy"], (faster or {}).get(rec["kernels"], 0.0))
        if isinstance(f, dict):
            f = f.get(None if rec["n_active"] is None else int(rec["n_active"]), 0.0)
        target = rec["step_ms_median"] * (1 - f)
        x = target * (1 + noise * rng.standard_normal(steps))
        x += target - np.median(x)
        if rec["predicted_ms"] is not None:
            rec["predicted_ms"] = target * rec["predicted_ms"]
        where = (gpu or {})
        rec.update(step_ms_median=float(np.median(x)), step_ms_mean=float(x.mean()), step_ms_p10=float(np.percentile(x, 10)),
                   step_ms_p90=float(np.percentile(x, 90)), step_ms_p99=float(np.percentile(x, 99)),
                   step_ms_std=float(x.std(ddof=1)), step_ms_iqr=float(np.subtract(*np.percentile(x, [75, 25]))),
                   iters=steps, timed_steps=steps,
                   gpu_uuid=where.get(rec["strategy"], where.get(rec["kernels"], GPU_A)),
                   captured_counts=[int(c) for c in rec["captured_counts"]],
                   capture_sizes=[int(c) for c in rec["capture_sizes"]])
        if samples:
            n = 0 if rec["n_active"] is None else int(rec["n_active"])
            write_samples(run, rec["point"], {"turn": np.arange(steps) // 10, "step_ms": x, "host_us": np.zeros(steps),
                                              "copy_us": np.zeros(steps), "launch_us": np.zeros(steps),
                                              "n_active": np.full(steps, n), "launches": np.full(steps, n)})
        writer.append(rec)
    PointsWriter.flush(writer)
    return run


@pytest.fixture(autouse=True)
def no_figures(monkeypatch):
    """The report's figures are not what these tests are about: each plot only names its file."""
    from lorabench.commands.report import plots

    for name in ("latency_vs_active", "memory_startup", "latency_vs_concurrency", "speedup", "latency_vs_memory",
                 "backends", "roofline"):
        monkeypatch.setattr(plots, name, lambda *args: args[-1])


def report(run) -> tuple[dict, str]:
    assert main(["report", str(run)]) == 0
    return json.loads((run / "recommendation.json").read_text()), (run / "report.md").read_text()


def section(md: str, title: str) -> str:
    return md.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def uniform(rec: dict) -> dict:
    [r] = [x for x in rec["recommendations"] if x["workload"] == "uniform"]
    return r


def test_five_percent_faster_and_tight_is_recommended(tmp_path):
    run = write_run(tmp_path, faster={"pow2": 0.05})
    rec, md = report(run)
    r = uniform(rec)
    assert r["strategy"] == "pow2" and not r["inconclusive"] and r["decided_on"] == "the 95 % interval of the gain"
    iv = r["gain_interval_pct"]
    assert iv["estimate"] == pytest.approx(5.0, abs=0.01) and 2 < iv["low"] < 5 < iv["high"] < 6
    assert re.search(r"pow2 vs max on average over concurrency: faster by 5\.0\d* % \(95 % CI 4\.\d+…5\.\d+\); "
                     r"the interval's low end clears the 2 %", r["reason"])
    assert r["comparison"]["gpu_uuid"] == r["gpu_uuid"] == GPU_A and rec["gpu_uuids"] == [GPU_A]
    assert r["comparison"]["strategies"]["pow2"]["gain_over_max_ci_pct"]["low"] == iv["low"]
    assert "no difference detected" in r["versus_max"]["dense"]  # dense is as fast as max here
    sec = section(md, "Recommendation")
    assert "`pow2` [1, 2, 4], +5.0 % vs max" in sec and "faster by 5.0" in sec and "(95 % CI 4." in sec
    assert "- `dense` vs max over c = 1, 2, 4, 8: no difference detected (" in sec
    assert f"compared on one GPU: {GPU_A}" in sec and "(**inconclusive**)" not in sec
    assert "no interval" not in md


def test_two_and_a_half_percent_but_noisy_is_max_and_inconclusive(tmp_path, capsys):
    run = write_run(tmp_path, faster={"pow2": 0.025}, noise=NOISY)
    rec, md = report(run)
    r = uniform(rec)
    iv = r["comparison"]["strategies"]["pow2"]["gain_over_max_ci_pct"]
    assert iv["estimate"] == pytest.approx(2.5, abs=0.01) and iv["low"] < 2 < iv["high"], "the scenario's premise"
    assert r["strategy"] == "max" and r["inconclusive"] and r["gain_interval_pct"] is None
    steps = int(re.fullmatch(r"about (\d+) steps per point would settle it: --iters (\d+)", r["more_measuring"]).group(1))
    assert 100 < steps < 100_000 and r["more_measuring"].endswith(f"--iters {steps}")
    assert "inconclusive: the interval's low end does not clear the 2 %" in r["reason"] and r["more_measuring"] in r["reason"]
    assert "--specialize-active-lora" not in r["vllm"]["flags"]
    sec = section(md, "Recommendation")
    assert "`max` [4] (**inconclusive**)" in sec and f"  - inconclusive: {r['more_measuring']}" in sec
    assert main(["recommend", str(run)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "measured, as lorabench report says: max [4]" in out and "inconclusive" in out


def test_medians_alone_would_have_taken_the_noisy_strategy(tmp_path):
    """The same noisy run without its samples: today's rule on medians proposes pow2, and says so."""
    run = write_run(tmp_path, faster={"pow2": 0.025}, noise=NOISY, samples=False)
    rec, md = report(run)
    r = uniform(rec)
    assert r["strategy"] == "pow2" and not r["inconclusive"]
    assert r["decided_on"] == "decided on medians alone (the run kept no samples)"
    assert r["reason"].startswith("pow2 is 2.5 % faster than max on average over concurrency (>= the 2 %")
    assert "decided on medians alone (the run kept no samples)" in r["reason"]
    assert r["gain_interval_pct"] is None and r["comparison"]["strategies"]["pow2"]["gain_over_max_ci_pct"] is None
    sec = section(md, "Recommendation")
    assert "- `pow2` vs max over c = 1, 2, 4, 8: +2.5 % by the medians (no interval: the run kept no samples)" in sec
    assert "- intervals: none: the run kept no samples" in md


def test_an_a_a_run_says_no_difference(tmp_path):
    run = write_run(tmp_path)
    rec, md = report(run)
    r = uniform(rec)
    assert r["strategy"] == "max" and not r["inconclusive"]
    for s in ("pow2", "dense"):
        assert r["versus_max"][s].startswith("no difference detected (")
        iv = r["comparison"]["strategies"][s]["gain_over_max_ci_pct"]
        assert iv["low"] < 0 < iv["high"] and iv["high"] < 2
    assert "no difference detected" in section(md, "Recommendation")


def test_a_strategy_measured_on_another_gpu_is_not_compared(tmp_path, capsys):
    """dense ran on another GPU, 10 % faster there: it is not compared, and both commands say so."""
    run = write_run(tmp_path, faster={"dense": 0.10}, gpu={"dense": GPU_B})
    rec, md = report(run)
    r = uniform(rec)
    assert r["strategy"] == "max" and r["gpu_uuid"] == GPU_A
    dense = r["comparison"]["strategies"]["dense"]
    assert dense["status"] == "not comparable" and dense["measured_elsewhere"] == [GPU_B]
    assert dense["coverage"] == "dense: 0 of 4 concurrencies; measured on another GPU (GPU-bbbbbbbb…): not compared"
    assert "dense" not in r["gain_by_strategy_pct"]
    assert "dense is not comparable: measured on another GPU (GPU-bbbbbbbb…): not compared" in r["reason"]
    assert "- triton/4/dense: measured on another GPU (GPU-bbbbbbbb…) than max's (GPU-aaaaaaaa…): not compared" in md
    assert "measured on another GPU (GPU-bbbbbbbb…): not compared" in section(md, "Recommendation")
    capsys.readouterr()
    assert main(["recommend", str(run)]) == 0
    [auto] = json.loads((run / "recommendation.json").read_text())["auto"]["uniform"]
    assert auto["auto"]["counts"] == [4] and auto["measured"]["comparison"]["strategies"]["dense"]["status"] == "not comparable"


def test_same_gpu_follows_the_majority_of_max(tmp_path):
    """Two of max's points on another GPU: those are left out (max then lacks c = 8); a null uuid
    (CPU, old runs) is one GPU of its own."""
    df = CARD.assign(gpu_uuid=GPU_A)
    df.loc[(df.strategy == "max") & (df.concurrency == 8) & (df.n_active >= 3), "gpu_uuid"] = GPU_B
    df.loc[(df.strategy == "pow2") & (df.concurrency == 1), "gpu_uuid"] = None
    kept, gpus = same_gpu(df)
    assert gpus[("triton", 4)] == {"gpu_uuid": GPU_A, "elsewhere": {"max": [GPU_B], "pow2": [None]}}
    assert len(df) - len(kept) == 2 + 3
    [cmp] = compare(df, ["uniform"])
    assert cmp.grid == (1, 2, 4) and cmp.covers["pow2"].compared_over == (2, 4)
    assert cmp.covers["pow2"].text().endswith("measured on another GPU (unknown): those points not compared")
    assert same_gpu(CARD)[1][("triton", 4)] == {"gpu_uuid": None, "elsewhere": {}}


def test_backends_are_compared_on_one_gpu_with_intervals(tmp_path):
    tuned = CARD.assign(kernels="triton+tuned")
    _, md = report(write_run(tmp_path, rows=pd.concat([CARD, tuned]), faster={"triton+tuned": 0.03}))
    side = section(md, "Backends side by side")
    assert "| triton+tuned vs triton |" in side and "0.97x" in side
    assert "faster by 3.0" in side and "triton+tuned vs triton over the 15 points both have (geometric mean of the ratios): faster by 3.0" in side
    away = write_run(tmp_path, rows=pd.concat([CARD, tuned]), gpu={"triton+tuned": GPU_B}, name="away")
    _, md = report(away)
    side = section(md, "Backends side by side")
    assert "triton+tuned measured on another GPU (GPU-bbbbbbbb… vs triton's GPU-aaaaaaaa…): not compared" in side
    assert "| triton+tuned vs triton |" not in side
    old = write_run(tmp_path, rows=pd.concat([CARD, tuned]), samples=False, name="old")
    _, md = report(old)
    side = section(md, "Backends side by side")
    assert "no interval: the run kept no samples" in side and "triton+tuned/triton" in side


def test_auto_prediction_against_its_measured_samples(tmp_path):
    """Strategy auto's workload runs, 3 % faster than predicted, tight: the interval comes from
    the measured samples only (a prediction from another run is held to the ±1 % margin of
    comparisons across workers)."""
    auto = CARD[CARD.strategy == "pow2"].assign(strategy="auto")
    auto["predicted_ms"] = np.where(auto["mode"] == "workload", 1 / 0.97, np.nan)
    run = write_run(tmp_path, rows=pd.concat([CARD[CARD.strategy == "max"], auto]))
    _, md = report(run)
    sec = section(md, "Strategy auto: predicted vs measured (GPU ms)")
    assert "drawn from the measured samples only" in sec
    assert sec.count("faster by 3.0") == 4 and "(95 % CI" in sec
    old = write_run(tmp_path, rows=pd.concat([CARD[CARD.strategy == "max"], auto]), samples=False, name="old")
    _, md = report(old)
    assert "-3.00 % (no interval: the run kept no samples)" in section(md, "Strategy auto: predicted vs measured (GPU ms)")


@pytest.mark.parametrize("noise, proposed", [(TIGHT, True), (0.2, False)])
def test_auto_holds_its_unmeasured_set_to_the_interval(tmp_path, noise, proposed):
    """max and dense measured, dense 5 % faster at n = 1 and 2: the cost model's best set is
    [1, 2, 4], which nobody measured; auto takes it only when the low end of its predicted gain's
    interval clears 2 %. The interval's estimate is the model's own prediction."""
    rows = CARD[CARD.strategy.isin(["max", "dense"])]
    run = write_run(tmp_path, rows=rows, faster={"dense": {1: 0.05, 2: 0.05}}, noise=noise)
    df = pd.read_parquet(run / "points.parquet")
    samples = run_samples(run)
    [a] = auto_recommendations(df, "uniform", samples=samples)
    [medians] = auto_recommendations(df, "uniform")
    assert medians["auto"]["counts"] == [1, 2, 4] and medians["decided_on"].startswith("decided on medians alone")
    predicted = medians["baselines"]["max"]["auto_gain_pct"]
    assert predicted > 2
    if proposed:
        assert a["auto"]["counts"] == [1, 2, 4] and not a["inconclusive"]
        iv = a["gain_interval_pct"]
        assert iv["estimate"] == pytest.approx(predicted, abs=0.01) and iv["low"] > 2
    else:
        assert a["auto"]["counts"] == [4] and a["gain_interval_pct"]["low"] < 2
        assert "the cost model's best set [1, 2, 4] vs max: " in a["reason"] and "so max, the fewest graphs" in a["reason"]
        assert a["inconclusive"] and a["more_measuring"].startswith("about ")


def test_the_predicted_gain_is_the_cost_models_prediction():
    """The gain statistic the intervals resample prices any set as Pricing.plan does, from the
    rows' medians: one model, on floats or on bootstrap draws."""
    from lorabench.analysis.costmodel import CostModel, Pricing
    from lorabench.config.workload import parse_workload

    df = CARD.copy()
    df.loc[(df.strategy == "dense") & (df.n_active == 1), "step_ms_median"] *= 0.9
    df = df[~((df.strategy == "pow2") & (df.concurrency == 8))]
    model = CostModel(df, "triton", 4)
    pricing = Pricing(model, {c: parse_workload("zipf:1.2").active_count_pmf(c, 4) for c in model.concurrency})
    for counts in ([4], [1, 4], [2, 4], [1, 2, 4], [3, 4], [1, 2, 3, 4]):
        want = 100 * (1 - pricing.plan(counts).expected_ms / pricing.plan([4]).expected_ms)
        assert pricing.gain_statistic(counts)(model.medians) == pytest.approx(want, abs=1e-9), counts
        assert pricing.gain(counts, None).pct == pytest.approx(want, abs=1e-9)
    draws = {k: np.full(7, v) for k, v in model.medians.items()}  # every draw the observed median
    assert pricing.expected_ms([1, 2, 4], draws) == pytest.approx(np.full(7, pricing.plan([1, 2, 4]).expected_ms))


def test_too_few_steps_fall_back_to_medians(tmp_path):
    run = write_run(tmp_path, faster={"pow2": 0.05}, steps=5)
    rec, _ = report(run)
    r = uniform(rec)
    assert r["strategy"] == "pow2" and r["decided_on"] == "decided on medians alone (fewer than 10 timed steps at a point)"


def test_recommend_json_without_samples_keeps_todays_answer():
    """The frozen H200 rows (no samples, no gpu_uuid): the same answer as before, said to rest on medians."""
    [r] = recommend(CARD)["recommendations"]
    assert r["strategy"] == "max" and r["gpu_uuid"] is None
    assert r["decided_on"] == "decided on medians alone (the run kept no samples)"
    assert r["versus_max"]["pow2"].endswith("by the medians (no interval: the run kept no samples)")
