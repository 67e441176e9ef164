"""End to end on the CPU: a small sweep through real worker processes, its Parquet rows, failures
that become rows, an interrupted sweep, the report, the recommendation and the notebook."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from PIL import Image
from conftest import H200_CARD, fault_injected, with_schema

from lorabench.cli import main
from lorabench.commands.report import write_report
from lorabench.commands.report.markdown import hypothesis_verdict
from lorabench.config.strategies import capture_counts
from lorabench.runtime.dispatch import choose_launch
from lorabench.storage.results import SCHEMA
from lorabench.storage.samples import PACKED, read_samples

SMALL = ["--max-loras", "4", "--concurrency", "1,4", "--strategy", "max,pow2", "--iters", "5", "--warmup", "1",
         "--context-len", "16", "--workload", "uniform,base:0.5", "--device", "cpu"]
POINTS = 2 * ((2 + 2) + (5 + 2))  # per worker: c=1 -> n 0..1 + 2 workloads; c=4 -> n 0..4 + 2 workloads


def sweep(tmp: Path, *extra: str, fault: str | None = None) -> tuple[int, Path | None]:
    with fault_injected(fault) if fault else nullcontext():
        code = main(["sweep", "--out", str(tmp)] + SMALL + list(extra))
    runs = sorted(tmp.glob("*/points.parquet"))
    return code, runs[-1].parent if runs else None


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    code, run = sweep(tmp_path_factory.mktemp("sweep"))
    assert code == 0
    return run


def test_rows_schema_and_plan(run_dir):
    table = pq.read_table(run_dir / "points.parquet")
    assert table.schema.equals(SCHEMA)
    df = table.to_pandas()
    assert len(df) == POINTS and (df.status == "ok").all()
    assert sorted(df.point) == list(range(POINTS))
    assert (df.device == "cpu").all() and (df.timing == "cpu_wall").all() and df.graph_mem_bytes.isna().all()
    assert (df.model == "tiny").all() and (df.iters == 5).all()
    for col in ["step_ms_median", "step_ms_p10", "step_ms_p99", "host_us_median", "startup_s", "tokens_per_s"]:
        assert (df[col] > 0).all(), col
    assert (df.step_ms_p10 <= df.step_ms_median).all() and (df.step_ms_median <= df.step_ms_p99).all()
    for col in ["run_id", "started_at", "torch", "triton", "argv"]:
        assert df[col].notna().all(), col


def test_fixed_rows_record_the_dispatched_graph(run_dir):
    df = pd.read_parquet(run_dir / "points.parquet")
    fixed = df[df["mode"] == "fixed"]
    for r in fixed.itertuples():
        assert r.graph_loras == choose_launch(r.n_active, capture_counts(r.strategy, 4))
        assert r.graph_tokens == r.concurrency
        assert r.base_tokens == (r.concurrency if r.n_active == 0 else 0)
    wl = df[df["mode"] == "workload"]
    assert set(wl.workload) == {"uniform", "base:0.5"} and wl.n_active.isna().all()
    assert (wl[wl.concurrency == 1].n_active_mean <= 1).all()


def test_run_json(run_dir):
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "finished" and info["wall_s"] > 0
    assert info["spec"]["concurrency"] == [1, 4] and info["spec"]["device"] == "cpu"
    assert len(info["jobs"]) == 2


def test_a_finished_sweep_packs_every_points_samples(run_dir):
    assert (run_dir / PACKED).is_file() and not list((run_dir / "samples").glob("point-*.parquet"))
    df = pd.read_parquet(run_dir / "points.parquet")
    per_point = read_samples(run_dir).groupby("point").size()
    assert per_point.to_dict() == dict(zip(df.point, df.timed_steps))


def test_rows_carry_the_check_verdict(run_dir):
    """Every row carries its configuration's verdict, and checks.json has one per strategy."""
    df = pd.read_parquet(run_dir / "points.parquet")
    assert df.correct.all() and df.check_detail.str.startswith("ok:").all() and (df.check_batches > 0).all()
    checks = json.loads((run_dir / "checks.json").read_text())
    assert [(c["strategy"], c["correct"]) for c in checks] == [("max", True), ("pow2", True)]


@pytest.mark.e2e
def test_a_failing_point_becomes_a_failed_row(tmp_path):
    code, run = sweep(tmp_path, fault="point:3")
    df = pd.read_parquet(run / "points.parquet")
    assert code == 0 and len(df) == POINTS
    bad = df[df.status == "failed"]
    assert list(bad.point) == [3] and "injected failure" in bad.error.iloc[0]


@pytest.mark.e2e
def test_a_failed_capture_fails_its_points_and_the_sweep_goes_on(tmp_path):
    code, run = sweep(tmp_path, fault="capture")
    df = pd.read_parquet(run / "points.parquet")
    assert len(df) == POINTS and (df.status == "failed").all()
    assert code == 1  # nothing measured at all
    assert df.error.str.contains("injected failure at capture").all()


@pytest.mark.e2e
def test_a_killed_worker_keeps_finished_rows(tmp_path, capsys):
    """One worker per (kernels, max_loras): the first one (max_loras 2) dies at its first point,
    the next one (max_loras 4) runs normally."""
    code, run = sweep(tmp_path, "--max-loras", "2,4", fault="kill:0")
    df = pd.read_parquet(run / "points.parquet").sort_values("point")
    first = df[df.max_loras == 2]
    assert code == 0 and len(first) == 2 * ((2 + 2) + (3 + 2)) and len(df) == len(first) + POINTS
    assert (first.status == "failed").all()
    assert first.error.str.contains("worker exited with status -9").all()
    assert (df[df.max_loras == 4].status == "ok").all(), "the next worker runs normally"
    assert main(["report", str(run)]) == 0, "failed rows first in the file must not break the report"
    assert "| 0 | torch | 2 | max |" in (run / "report.md").read_text()


@pytest.mark.e2e
def test_a_worker_killed_mid_run_keeps_its_earlier_rows(tmp_path):
    """Both strategies are timed point by point in turns: killed at max's third point, the
    worker has finished the first two points of both max and pow2 (its points 11 and 12)."""
    code, run = sweep(tmp_path, fault="kill:2")
    df = pd.read_parquet(run / "points.parquet").sort_values("point")
    assert code == 0 and len(df) == POINTS
    assert list(df[df.status == "ok"].point) == [0, 1, POINTS // 2, POINTS // 2 + 1]
    assert df[df.status == "failed"].error.str.contains("worker exited with status -9").all()


@pytest.mark.e2e
def test_interrupted_sweep_leaves_readable_rows(tmp_path):
    cmd = [sys.executable, "-m", "lorabench", "sweep", "--out", str(tmp_path)] + SMALL + ["--iters", "400"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal's, even if
    deadline = time.time() + 120  # pytest itself runs with SIGINT ignored (a background job without job control)
    while time.time() < deadline and not list(tmp_path.glob("*/points.parquet")):
        time.sleep(0.2)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends to the terminal's process group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "Traceback" not in err and "interrupted" in err
    run = next(tmp_path.glob("*/points.parquet")).parent
    df = pd.read_parquet(run / "points.parquet")
    assert 1 <= len(df) < POINTS and (df.status == "ok").all()
    assert json.loads((run / "run.json").read_text())["status"] == "interrupted"


def test_report_writes_plots_markdown_and_recommendation(run_dir, capsys):
    assert main(["report", str(run_dir)]) == 0
    for name in ["latency_vs_active.png", "latency_vs_concurrency.png", "speedup_vs_max.png", "memory_startup.png",
                 "latency_vs_memory.png", "report.md", "recommendation.json"]:
        assert (run_dir / name).stat().st_size > 0, name
    with Image.open(run_dir / "latency_vs_active.png") as png:  # palettised: a third of full colour
        assert png.format == "PNG" and png.mode == "P" and png.size[0] > 400
    md = (run_dir / "report.md").read_text()
    assert "CPU wall" in md and "not GPU results" in md
    host = section(md, "Host overhead per decode step (us, median over the fixed and workload points)")
    [table] = [chunk.splitlines() for chunk in host.split("\n\n") if chunk.startswith("| kernels")]
    assert len(table) > 2
    for line in table[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 5 and all(float(c) >= 0 for c in cells[2:]), line  # numbers, not reprs
    rec = json.loads((run_dir / "recommendation.json").read_text())
    assert {r["workload"] for r in rec["recommendations"]} == {"uniform", "base:0.5"}
    for r in rec["recommendations"]:
        assert r["strategy"] in ("max", "pow2") and r["max_loras"] == 4
        assert r["vllm"]["flags"].startswith("--enable-lora --max-loras 4 --max-lora-rank 16")
        assert ("--specialize-active-lora" in r["vllm"]["flags"]) == (r["vllm"]["realises"] == "pow2")
        assert r["captured_counts"] == capture_counts(r["strategy"], 4)


def test_report_defaults_to_the_newest_run(run_dir, capsys):
    assert main(["report", "--results", str(run_dir.parent)]) == 0
    assert str(run_dir) in capsys.readouterr().out


def test_notebook_executes_on_a_cpu_run(run_dir):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(Path(__file__).parent.parent / "notebooks" / "explore.ipynb", as_version=4)
    os.environ["LORABENCH_RUN"] = str(run_dir)
    try:
        nbclient.NotebookClient(nb, timeout=300, resources={"metadata": {"path": str(run_dir)}}).execute()
    finally:
        del os.environ["LORABENCH_RUN"]
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 2


# Synthetic runs: a frozen H200 run's rows (tests/data) (GPU timings, triton, max_loras 4, max/pow2/dense),
# copied per backend, with chosen verdicts and timings; no GPU and no sweep needed.
REFERENCE = H200_CARD
WRONG = ("WRONG in 3 of 9 graphs served; smallest: batch [0, -1] (2 tokens, n=1, 1 base) -> graph (bucket 2, key 1, "
         "grid 1): 1 token(s) of slot 0 off by 1.12 relative (tolerance 0.03)")
OK = "ok: 42 batches, 9 of 9 graphs served, max error 0.004 (tolerance 0.03, LoRA moves logits by 1.1)"


def synthetic_run(tmp_path: Path, backends=("triton",), wrong=(), speed=None, failed=()) -> Path:
    """A run folder holding the reference rows once per backend (vllm: max and pow2 only). Every
    configuration passes its check except the (kernels, strategy) pairs in ``wrong``; ``speed``
    scales a (kernels, strategy)'s step times, e.g. {("triton", "pow2"): 0.9} makes it 10 % faster;
    every point of the pairs in ``failed`` is a failed row (verdict kept, as the worker writes them)."""
    ref = pd.read_parquet(REFERENCE / "points.parquet")
    df = pd.concat([ref.assign(kernels=k, vllm="0.33.0" if k == "vllm" else None) for k in backends], ignore_index=True)
    df = with_schema(df[(df.kernels != "vllm") | df.strategy.isin(["max", "pow2"])].reset_index(drop=True))
    bad = pd.Series(list(zip(df.kernels, df.strategy))).isin(list(wrong)).to_numpy()
    df["correct"] = ~bad
    df["check_detail"] = [WRONG if b else OK for b in bad]
    for (k, s), f in (speed or {}).items():
        sel = (df.kernels == k) & (df.strategy == s)
        for col in ["step_ms_median", "step_ms_mean", "step_ms_p10", "step_ms_p90"]:
            df.loc[sel, col] *= f
    down = pd.Series(list(zip(df.kernels, df.strategy))).isin(list(failed)).to_numpy()
    df.loc[down, "status"], df.loc[down, "error"] = "failed", "RuntimeError: injected"
    run = tmp_path / "run"
    run.mkdir()
    df.to_parquet(run / "points.parquet", schema=SCHEMA)
    return run


def report(run: Path) -> tuple[dict, str]:
    assert main(["report", str(run)]) == 0
    return json.loads((run / "recommendation.json").read_text()), (run / "report.md").read_text()


def section(md: str, title: str) -> str:
    return md.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("bad", ["pow2", "dense", "max"])
def test_a_wrong_configuration_is_never_recommended(tmp_path, bad, capsys):
    rec, md = report(synthetic_run(tmp_path, wrong=[("triton", bad)], speed={("triton", bad): 0.8}))
    [r] = rec["recommendations"]
    assert r["fastest_measured"] == bad and r["strategy"] not in (None, bad)
    assert r["rejected"] == [{"strategy": bad, "reason": WRONG}]
    assert f"{bad} measured fastest but failed its correctness check" in r["reason"]
    assert (r["gain_over_max_pct"] < 0) == (bad == "max"), "gains stay relative to max's timing, wrong or not"
    assert f"| triton | 4 | {bad} | WRONG | {WRONG} |" in section(md, "Correctness")
    assert f"  - rejected `{bad}`: {WRONG}" in section(md, "Recommendation")


def test_every_strategy_wrong_proposes_nothing(tmp_path, capsys):
    rec, md = report(synthetic_run(tmp_path, wrong=[("triton", s) for s in ("max", "pow2", "dense")]))
    [r] = rec["recommendations"]
    assert r["strategy"] is None and "no configuration passed" in r["reason"]
    assert {x["strategy"] for x in r["rejected"]} == {"max", "pow2", "dense"}
    assert "nothing proposed: no configuration passed" in section(md, "Recommendation")


@pytest.mark.parametrize("pow2_correct, pow2_points_failed", [(False, False), (False, True), (True, False)])
def test_vllm_pow2_verdict_decides_specialize_active_lora(tmp_path, pow2_correct, pow2_points_failed, capsys):
    """pow2 is 10 % faster for both backends: only a passing vllm/pow2 lets the flag through. A
    configuration whose every point failed still has its verdict."""
    run = synthetic_run(tmp_path, backends=("triton", "vllm"), wrong=[] if pow2_correct else [("vllm", "pow2")],
                        speed={("triton", "pow2"): 0.9, ("vllm", "pow2"): 0.9},
                        failed=[("vllm", "pow2")] if pow2_points_failed else [])
    rec, md = report(run)
    flags = [r["vllm"]["flags"] for r in rec["recommendations"]]
    assert len(flags) == 2 and all(f.startswith("--enable-lora --max-loras 4") for f in flags)
    assert any("--specialize-active-lora" in f for f in flags) == pow2_correct
    vllm = next(r for r in rec["recommendations"] if r["kernels"] == "vllm")
    assert vllm["strategy"] == ("pow2" if pow2_correct else "max")
    assert vllm["vllm"]["realises"] == vllm["strategy"]
    correctness = section(md, "Correctness")
    assert "Hypothesis: with `--specialize-active-lora`" in correctness
    if pow2_correct:
        assert "**refutes** it" in correctness and "rejected" not in section(md, "Recommendation")
    else:
        assert "**confirms** it" in correctness and "smallest failing batch: batch [0, -1] (2 tokens, n=1, 1 base)" in correctness
        for r in rec["recommendations"]:
            assert "not proposed" in r["vllm"]["note"] and WRONG in r["vllm"]["note"]
        assert vllm["rejected"] == [{"strategy": "pow2", "reason": WRONG}]


@pytest.mark.parametrize("backends", [("triton", "vllm"), ("triton", "torch", "vllm")])
def test_several_backends_side_by_side(tmp_path, backends, capsys):
    run = synthetic_run(tmp_path, backends=backends, speed={(backends[-1], "max"): 1.5})
    written = write_report(run)
    assert run / "backends.png" in written and (run / "backends.png").stat().st_size > 0
    side = section((run / "report.md").read_text(), "Backends side by side")
    assert "![backends](backends.png)" in side
    ks = " | ".join(f"{k} ms" for k in backends)
    assert "**max_loras = 4, max**" in side and f"| c | n | {ks} |" in side
    assert f"{backends[-1]}/triton" in side and "1.50x" in side and f"{backends[-1]} overhead" in side
    assert "| 4 | pow2 | vllm |" in side  # the cost table


def test_padding_costs_are_each_backends_padded_run_against_its_unpadded_twin(tmp_path, capsys):
    """fused+unpadded is compared with fused, not with the first backend (triton)."""
    run = synthetic_run(tmp_path, backends=("triton", "triton+unpadded", "fused", "fused+unpadded"),
                        speed={("triton", "max"): 1.25, ("fused", "max"): 1.1, ("fused+unpadded", "max"): 2.0})
    df = pd.read_parquet(run / "points.parquet").assign(ranks="8:1")
    df.to_parquet(run / "points.parquet", schema=SCHEMA)
    write_report(run)
    padding = section((run / "report.md").read_text(), "What padding costs")
    assert "Adapters of ranks 8:1 zero-padded to rank" in padding
    triton, fused = padding.split("**fused (padded) vs fused+unpadded**")
    assert "**triton (padded) vs triton+unpadded**" in triton
    assert "| 4 | max | 1 | 1 |" in triton and "+25.0 %" in triton and "| 4 | pow2 | 1 | 1 |" in triton
    assert "-45.0 %" in fused  # fused: 1.1 against fused+unpadded's 2.0, whatever triton did
    assert "| 4 | max | 1 | 0 |" not in padding  # n = 0 runs no LoRA: no padding to cost


def test_one_backend_has_no_side_by_side(tmp_path, capsys):
    run = synthetic_run(tmp_path)
    assert run / "backends.png" not in write_report(run) and not (run / "backends.png").exists()
    assert "Backends side by side" not in (run / "report.md").read_text()


def test_a_run_from_before_the_check_still_reports(tmp_path, capsys):
    run = tmp_path / "reference"
    shutil.copytree(REFERENCE, run)
    assert "correct" not in pd.read_parquet(run / "points.parquet").columns
    rec, md = report(run)
    [r] = rec["recommendations"]
    assert r["strategy"] == "max" and r["rejected"] == [] and "--specialize-active-lora" not in r["vllm"]["flags"]
    assert "| triton | 4 | pow2 | not checked | - |" in section(md, "Correctness")
    assert "Hypothesis" not in md


def test_a_note_beside_the_data_is_pointed_to(tmp_path, capsys):
    run = tmp_path / "reference"
    shutil.copytree(REFERENCE, run)
    (run / "NOTE.md").write_text("caveat\n")
    _, md = report(run)
    assert md.splitlines()[2].startswith("> **Read [NOTE.md](NOTE.md) first:**")


@pytest.mark.parametrize("correct, detail, says", [
    ([False, True], [WRONG, OK], "**confirms** it: vllm/pow2 is WRONG at max_loras 4; smallest failing batch: batch [0, -1]"),
    ([False], [WRONG.replace("n=1, 1 base", "n=2, 0 base")], "does not mix base requests with adapters"),
    ([True, True], [OK, OK], "**refutes** it: every vllm/pow2 configuration (max_loras 4, 8)"),
    ([True, None], [OK, None], "cannot tell"),
])
def test_hypothesis_verdict(correct, detail, says):
    pow2 = pd.DataFrame({"kernels": "vllm", "max_loras": [4, 8][:len(correct)], "strategy": "pow2",
                         "correct": pd.Series(correct, dtype=object), "check_detail": detail})
    assert says in hypothesis_verdict(pow2)


def test_roofline_puts_each_point_against_its_floor(tmp_path, capsys):
    """With the worker's probe figures on the rows, the floor is n adapters' bytes over the
    bandwidth plus one kernel per LoRA linear, and the report shows the distance from it."""
    from lorabench.analysis.roofline import floors

    run = synthetic_run(tmp_path, wrong=[("triton", "pow2")], speed={("triton", "pow2"): 0.5})
    df = pd.read_parquet(run / "points.parquet")
    df["probe_copy_gbs"], df["probe_kernel_us"] = 4000.0, 1.5
    df.to_parquet(run / "points.parquet", schema=SCHEMA)
    fl = floors(df)
    assert len(fl) and (fl.n_active > 0).all() and "pow2" not in set(fl.strategy)  # wrong, however fast
    r = fl.iloc[0]
    want = (r.n_active * r.lora_bytes_per_slot / 4000e9 + 4 * 32 * 1.5e-6) * 1e3
    assert r.floor_ms == pytest.approx(want) and r.x_floor == pytest.approx((r.step_ms_median - r.base_ms) / want)
    _, md = report(run)
    roof = section(md, "Roofline: LoRA overhead vs its floor")
    assert "4000 GB/s" in roof and "1.50 us per extra kernel" in roof and "roofline.png" in roof
    assert (run / "roofline.png").stat().st_size > 0


def test_no_probe_no_roofline(tmp_path, capsys):
    _, md = report(synthetic_run(tmp_path))
    assert "Roofline" not in md


@pytest.mark.parametrize("factor,verdict", [(1.0, "yes"), (1.10, "no")])
def test_agnostic_against_the_best_specialised(tmp_path, factor, verdict, capsys):
    run = synthetic_run(tmp_path)
    df = pd.read_parquet(run / "points.parquet")
    ag = df[df.strategy == "dense"].assign(strategy="agnostic")
    for col in ["step_ms_median", "step_ms_mean", "step_ms_p10", "step_ms_p90"]:
        ag[col] *= factor
    pd.concat([df, ag]).to_parquet(run / "points.parquet", schema=SCHEMA)
    _, md = report(run)
    sec = section(md, "Count-agnostic vs specialised")
    summary = sec.strip().splitlines()[-1]
    assert summary.startswith("| triton | 4 |") and f"| {verdict} |" in summary
    if factor > 1:
        assert "+10.0 %" in sec or "+9." in sec or "+10." in sec


def test_a_wrong_agnostic_is_never_called_good_enough(tmp_path, capsys):
    run = synthetic_run(tmp_path)
    df = pd.read_parquet(run / "points.parquet")
    ag = df[df.strategy == "max"].assign(strategy="agnostic", correct=False, check_detail=WRONG)
    for col in ["step_ms_median", "step_ms_mean", "step_ms_p10", "step_ms_p90"]:
        ag[col] *= 0.5  # skipping work looks fast
    pd.concat([df, ag]).to_parquet(run / "points.parquet", schema=SCHEMA)
    _, md = report(run)
    sec = section(md, "Count-agnostic vs specialised")
    assert "agnostic failed its correctness check" in sec and "| yes |" not in sec


@pytest.mark.parametrize("tokens, n, experts, top_k, want", [
    (1, 1, 128, 8, 8.0),  # one token: exactly its top_k experts
    (4, 4, 128, 8, 32.0),  # one token an adapter: no two share a slot
    (2, 1, 2, 2, 2.0),  # every expert taken by the first token
    (3, 0, 8, 2, 0.0),
])
def test_expert_pairs_exact_cases(tokens, n, experts, top_k, want):
    from lorabench.analysis.roofline import expert_pairs

    assert expert_pairs(tokens, n, experts, top_k) == pytest.approx(want)


def test_expert_pairs_is_the_fixed_batches_expectation():
    """Tokens placed as fixed points place them, each routed to top_k experts at random: the
    distinct (slot, expert) pairs average what ``expert_pairs`` says."""
    import random

    from lorabench.analysis.roofline import expert_pairs
    from lorabench.config.batches import fixed_batch

    rng = random.Random(0)
    for tokens, n in ((64, 4), (32, 8), (16, 1)):
        seen = []
        for _ in range(2000):
            slots = fixed_batch(tokens, n, 16, rng)
            seen.append(len({(s, e) for s in slots for e in rng.sample(range(128), 8)}))
        assert sum(seen) / len(seen) == pytest.approx(expert_pairs(tokens, n, 128, 8), rel=0.01)


def test_moe_floor_counts_the_routed_experts_not_every_expert():
    """An MoE row's floor reads n adapters' attention LoRA and the routed pairs' expert LoRA: at one
    token of a 128-expert top-8 model, 8 of 128 experts' share, not the whole slot."""
    from lorabench.analysis.roofline import expert_pairs, lora_bytes

    pts = pd.DataFrame({"n_active": [1, 4], "concurrency": [1, 64], "lora_bytes_per_slot": [1_000_000 + 128_000] * 2,
                        "expert_lora_bytes_per_slot": [128_000] * 2, "experts": [128] * 2, "top_k": [8] * 2})
    got = lora_bytes(pts)
    assert got[0] == pytest.approx(1_000_000 + 8 * 1_000)
    assert got[1] == pytest.approx(4 * 1_000_000 + expert_pairs(64, 4, 128, 8) * 1_000)
    dense = pts.drop(columns=["expert_lora_bytes_per_slot", "experts", "top_k"])
    assert list(lora_bytes(dense)) == [1_128_000, 4 * 1_128_000]
