"""Partial runs: a killed worker, Ctrl-C, a killed sweep. Built from the frozen H200 rows
(tests/data) by dropping or failing points, they must give no gain from points only one side
has, show what each strategy covers, say that the run is incomplete, and make ``report`` and
``recommend`` agree."""

import io
import json
import re
import socket
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from conftest import H200_CARD, H200_SLOTS, with_schema
from rich.console import Console

from lorabench.analysis.compare import NOT_COMPARABLE, PARTIAL, compare
from lorabench.analysis.optimise import auto_recommendations
from lorabench.analysis.points import CONFIG, expected_steps
from lorabench.analysis.recommend import recommend
from lorabench.cli import main
from lorabench.commands.report import write_report
from lorabench.commands.summary import points_table
from lorabench.storage.results import SCHEMA
from lorabench.storage.runs import KILLED, coverage, run_status

CARD = pd.read_parquet(H200_CARD / "points.parquet")  # triton, max_loras 4: max, pow2, dense at c = 1, 2, 4, 8
KILLED_WORKER = "worker exited with status -9 before this point; its log ends: Killed"
TIMES = ["step_ms_median", "step_ms_mean", "step_ms_p10", "step_ms_p90"]


def plan(df: pd.DataFrame) -> list[dict]:
    """run.json's jobs, as the sweep writes them: every point of every configuration."""
    jobs = []
    for (k, m, s), g in df.groupby(CONFIG, sort=False):
        points = [{"index": int(r.point), "mode": r.mode, "concurrency": int(r.concurrency),
                   "n_active": None if pd.isna(r.n_active) else int(r.n_active),
                   "workload": r.workload if isinstance(r.workload, str) else None} for r in g.itertuples()]
        jobs.append({"kernels": k, "max_loras": int(m), "strategy": s, "points": points})
    return jobs


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def partial_run(tmp_path, name="run", rows=CARD, drop=None, fail=None, speed=None, status="finished") -> "Path":  # noqa: F821
    """A run folder of ``rows`` whose run.json plans all of them; then the rows where ``drop``
    holds are gone (Ctrl-C, a killed sweep), those where ``fail`` holds are failed rows (a killed
    worker, as the sweep writes them), and ``speed`` {(strategy, c): factor} scales step times.
    ``status``: finished, interrupted, or killed (running, its process gone)."""
    df = with_schema(rows)
    info = {"run_id": df.run_id.iloc[0], "argv": "lorabench sweep --spec sweeps/card.toml", "spec": {"concurrency": [1, 2, 4, 8]},
            "jobs": plan(df), "status": status, "wall_s": 60.0}
    if status == KILLED:
        info.update(status="running", host=socket.gethostname(), pid=dead_pid())
        del info["wall_s"]
    for (s, c), f in (speed or {}).items():
        sel = (df.strategy == s) & (df.concurrency == c)
        df.loc[sel, TIMES] = df.loc[sel, TIMES] * f
    if fail is not None:
        bad = fail(df)
        df.loc[bad, "status"], df.loc[bad, "error"] = "failed", KILLED_WORKER
        df.loc[bad, TIMES + ["captured_counts", "graph_mem_bytes", "startup_s", "num_graphs"]] = None
    if drop is not None:
        df = df[~drop(df)]
    run = tmp_path / name
    run.mkdir()
    df.to_parquet(run / "points.parquet", schema=SCHEMA)
    (run / "run.json").write_text(json.dumps(info))
    return run


def pow2_at(*cs):
    return lambda d: (d.strategy == "pow2") & d.concurrency.isin(cs)


def report(run) -> tuple[dict, str]:
    assert main(["report", str(run)]) == 0
    return json.loads((run / "recommendation.json").read_text()), (run / "report.md").read_text()


def recommend_cli(run, capsys, *args) -> tuple[dict, str]:
    capsys.readouterr()
    assert main(["recommend", str(run), "--workload", "uniform", *args]) == 0
    out = capsys.readouterr().out
    [auto] = json.loads((run / "recommendation.json").read_text())["auto"]["uniform"]
    return auto, out


def section(md: str, title: str) -> str:
    return md.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def faster_claims(text: str) -> set[str]:
    """Strategies said to be faster than max without a "over c = ..." qualifier."""
    return set(re.findall(r"(\S+) is [\d.]+ % faster than max", text)) - {"it"}


def naive_gain(df: pd.DataFrame, strategy: str) -> float:
    """What averaging each strategy over its own concurrencies says (the old, wrong way)."""
    exp = expected_steps(df).groupby("strategy").expected_ms.mean()
    return 1 - exp[strategy] / exp["max"]


def test_a_killed_worker_gives_no_gain_from_the_points_it_lacks(tmp_path, capsys):
    """max_loras 4, max and pow2: pow2's worker killed after c = 1, 2, where it is slower than
    max; averaged over its own points it would look >= 2 % faster than max over all of max's."""
    rows = CARD[CARD.strategy.isin(["max", "pow2"])]
    run = partial_run(tmp_path, rows=rows, fail=pow2_at(4, 8), speed={("pow2", 1): 1.005, ("pow2", 2): 1.005,
                                                                     ("pow2", 4): 0.5, ("pow2", 8): 0.5})
    df = pd.read_parquet(run / "points.parquet")
    assert naive_gain(df, "pow2") > 0.02, "the trap: fewer points look faster"
    rec, md = report(run)
    [r] = rec["recommendations"]
    assert r["strategy"] == "max" and "pow2" not in faster_claims(r["reason"])
    assert r["gain_by_strategy_pct"]["pow2"] < 0 and "--specialize-active-lora" not in r["vllm"]["flags"]
    pow2 = r["comparison"]["strategies"]["pow2"]
    assert (pow2["status"], pow2["compared_over"], pow2["lacks"]) == (PARTIAL, [1, 2], [4, 8])
    assert pow2["coverage"] == "pow2: 2 of 4 concurrencies; compared over c = 1, 2"
    assert set(r["expected_step_ms_max"]) == {"1", "2", "4", "8"}
    sec = section(md, "Recommendation")
    assert "- coverage `pow2`: 2 of 4 concurrencies; compared over c = 1, 2 (-0." in sec and "partial: not proposed" in sec
    assert "pow2 is not proposed: measured at 2 of max's 4 concurrencies; over c = 1, 2 it is 0." in sec
    auto, out = recommend_cli(run, capsys)
    assert auto["auto"]["counts"] == [4] and auto["measured"]["strategy"] == "max"
    assert auto["vllm"]["flags"] == r["vllm"]["flags"]
    out = " ".join(out.split())
    assert "measured, as lorabench report says: max [4]" in out and "pow2 is not proposed" in out


def test_ctrl_c_shows_an_incomplete_run_and_compares_over_common_ground(tmp_path, capsys):
    """Interrupted during pow2 (dense never started); pow2 5 % slower at c = 2, a little faster
    at c = 1: over c = 1, 2 it is slower, so nothing says it is faster."""
    run = partial_run(tmp_path, drop=lambda d: pow2_at(4, 8)(d) | (d.strategy == "dense"),
                      speed={("pow2", 1): 0.99, ("pow2", 2): 1.05}, status="interrupted")
    rec, md = report(run)
    assert rec["coverage"] == {"status": "interrupted", "complete": False, "planned": 57, "finished": 26, "missing": 31,
                               "failed": 0, "missing_by_config": [
                                   {"kernels": "triton", "max_loras": 4, "strategy": "pow2", "missing": 12},
                                   {"kernels": "triton", "max_loras": 4, "strategy": "dense", "missing": 19}]}
    head = md.split("## Correctness")[0]
    assert ("> **Incomplete run**: interrupted: 26 of 57 planned points finished (31 missing, 0 failed); missing: "
            "triton/4/pow2 12, triton/4/dense 19.") in head
    [r] = rec["recommendations"]
    assert r["strategy"] == "max" and not faster_claims(r["reason"]) and r["gain_by_strategy_pct"]["pow2"] < 0
    assert r["comparison"]["strategies"]["dense"]["status"] == NOT_COMPARABLE and "dense" not in r["gain_by_strategy_pct"]
    sec = section(md, "Recommendation")
    assert sec.startswith("\nThis run is incomplete (see the top): each strategy is compared with max only over")
    assert "- coverage `dense`: 0 of 4 concurrencies (not comparable)" in sec
    console = Console(width=80, file=io.StringIO())
    write_report(run, console)
    assert "incomplete run, interrupted: 26 of 57 planned points finished" in " ".join(console.file.getvalue().split())
    auto, out = recommend_cli(run, capsys)
    assert " ".join(out.split()).startswith("incomplete run, interrupted: 26 of 57 planned points finished (31 missing, "
                                            "0 failed); missing: triton/4/pow2 12, triton/4/dense 19")
    assert auto["auto"]["counts"] == [4] and auto["measured"]["strategy"] == r["strategy"]
    data = json.loads((run / "recommendation.json").read_text())
    assert data["coverage"]["status"] == "interrupted" and data["recommendations"] == rec["recommendations"]


def test_a_killed_sweep_says_killed(tmp_path, capsys):
    run = partial_run(tmp_path, drop=lambda d: pow2_at(4, 8)(d) | (d.strategy == "dense"), status=KILLED)
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "running" and run_status(info) == KILLED
    rec, md = report(run)
    assert rec["coverage"]["status"] == KILLED
    assert "> **Incomplete run**: killed: 26 of 57 planned points finished" in md
    assert "- sweep wall time: not recorded (run killed);" in md and "nan" not in md.split("## Correctness")[0]
    _, out = recommend_cli(run, capsys)
    assert " ".join(out.split()).startswith("incomplete run, killed: 26 of 57")


def test_max_missing_points_limits_every_comparison(tmp_path, capsys):
    """max's worker killed at c = 8; pow2 10 % faster everywhere and complete: proposed, from
    c = 1, 2, 4 only, and c = 8 (which only pow2 has) is never compared."""
    fail = lambda d: (d.strategy == "max") & (d.concurrency == 8)  # noqa: E731
    run = partial_run(tmp_path, fail=fail, speed={("pow2", c): 0.9 for c in (1, 2, 4, 8)})
    rec, md = report(run)
    [r] = rec["recommendations"]
    assert r["strategy"] == "pow2" and set(r["expected_step_ms"]) == {"1", "2", "4"}
    assert re.match(r"pow2 is 10\.\d % faster than max on average over c = 1, 2, 4 \(>= the 2 %", r["reason"])
    assert "max lacks c = 8, so nothing is compared there" in r["reason"]
    assert r["comparison"]["strategies"]["pow2"]["extra"] == [8]
    assert "- coverage `max`: 3 of 4 concurrencies; compared over c = 1, 2, 4" in section(md, "Recommendation")
    auto, _ = recommend_cli(run, capsys)
    assert auto["concurrency"] == [1, 2, 4] and set(auto["auto"]["expected_ms_by_c"]) == {"1", "2", "4"}
    assert auto["auto"]["counts"] != [4] and auto["measured"]["strategy"] == "pow2"
    assert auto["vllm"]["flags"] == r["vllm"]["flags"]


def test_nothing_in_common_with_max_is_not_comparable(tmp_path, capsys):
    """max's worker died before its first point: nothing can be compared, and neither command
    proposes anything."""
    run = partial_run(tmp_path, fail=lambda d: d.strategy == "max", speed={("pow2", c): 0.8 for c in (1, 2, 4, 8)})
    rec, md = report(run)
    [r] = rec["recommendations"]
    assert r["strategy"] is None and r["reason"].startswith("not comparable: max (the baseline) has no concurrency")
    assert all(s["status"] == NOT_COMPARABLE for s in r["comparison"]["strategies"].values())
    assert not faster_claims(md) and "nothing proposed: not comparable" in section(md, "Recommendation")
    capsys.readouterr()
    assert main(["recommend", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing to recommend" in err[0] and "not comparable" in err[0]


def test_a_strategy_sharing_no_concurrency_with_max_is_not_comparable():
    df = CARD[~(pow2_at(1, 2, 4)(CARD) | ((CARD.strategy == "max") & (CARD.concurrency == 8)))]
    df = df.assign(step_ms_median=np.where(df.strategy == "pow2", df.step_ms_median * 0.5, df.step_ms_median))
    [cmp] = compare(df)
    assert cmp.grid == (1, 2, 4) and cmp.covers["pow2"].extra == (8,) and cmp.status("pow2") == NOT_COMPARABLE
    assert cmp.gain("pow2") is None and cmp.covers["pow2"].text() == "pow2: 1 of 4 concurrencies"
    [r] = recommend(df)["recommendations"]
    assert r["strategy"] != "pow2" and "pow2" not in r["gain_by_strategy_pct"]
    assert "pow2 is not comparable" in r["reason"]


def scenario(seed: int) -> pd.DataFrame:
    """A partial run drawn at random: each strategy loses some concurrencies (failed or gone)
    and runs up to 8 % faster or slower per concurrency."""
    rng = np.random.default_rng(seed)
    df = CARD.copy()
    for s in ("max", "pow2", "dense"):
        for c in (1, 2, 4, 8):
            sel = (df.strategy == s) & (df.concurrency == c)
            df.loc[sel, TIMES] = df.loc[sel, TIMES] * rng.uniform(0.92, 1.08)
        lost = [c for c in (2, 4, 8) if rng.random() < (0.2 if s == "max" else 0.4)]
        sel = (df.strategy == s) & df.concurrency.isin(lost)
        if rng.random() < 0.5:
            df = df[~sel]
        else:
            df.loc[sel, "status"], df.loc[sel, TIMES] = "failed", None
    return df


@pytest.mark.parametrize("seed", range(12))
def test_report_and_recommend_agree(seed):
    """On any partial run: recommend reports the report's choice as what was measured, takes its
    vLLM flags, and its auto set contradicts no measured verdict: it is max's only when the report
    keeps max, and a measured set other than max only when the report proposes that set."""
    df = scenario(seed)
    [r] = recommend(df)["recommendations"]
    [a] = auto_recommendations(df, "uniform")
    assert a["measured"]["strategy"] == r["strategy"] and a["measured"]["reason"] == r["reason"]
    cmp = r["comparison"]
    for s, c in cmp["strategies"].items():  # no gain from uncommon points
        assert c["compared_over"] == [x for x in cmp["compared_over"] if x in c["compared_over"]]
        if s in r["gain_by_strategy_pct"]:
            assert c["status"] != NOT_COMPARABLE
    for s in faster_claims(r["reason"]):
        assert cmp["strategies"][s]["status"] == "complete" or s == r["strategy"]
    if r["strategy"] is None:
        assert a["auto"] is None or not cmp["compared_over"]
        return
    assert a["vllm"]["flags"] == r["vllm"]["flags"]
    sets = {"max": [4], "pow2": [1, 2, 4], "dense": [1, 2, 3, 4]}
    counts = a["auto"]["counts"]
    if r["strategy"] == "max":
        assert counts not in (sets["pow2"], sets["dense"])
    else:
        assert counts != [4]
        others = [v for k, v in sets.items() if k != r["strategy"]]
        assert counts not in others


def test_summary_fits_80_columns(tmp_path):
    """The sweep's console table at 80 columns (or piped): every column and the max_loras shown,
    failed counts with the first failure's reason, and the coverage of an incomplete run."""
    rows = pd.concat([CARD, CARD[CARD.strategy == "dense"].assign(strategy="[1,2,3,4]"),
                      CARD[CARD.strategy == "max"].assign(strategy="agnostic")], ignore_index=True)
    rows["point"] = range(len(rows))
    run = partial_run(tmp_path, rows=rows, fail=pow2_at(4, 8), drop=lambda d: d.strategy == "agnostic",
                      status="interrupted")
    df = pd.read_parquet(run / "points.parquet")
    console = Console(width=80, file=io.StringIO())
    console.print(points_table(df, "cuda", coverage(run, df)))
    out = console.file.getvalue()
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "triton, max_loras 4" in out
    for word in ("max", "pow2", "dense", "[1,2,3,4]", "graphs", "MiB", "start s", "failed", "check"):
        assert word in out, word
    [failed] = [line for line in out.splitlines() if line.startswith("│  failed")]
    assert [c.strip() for c in failed.strip("│").split("│")] == ["failed", "0", "12", "0", "0"]  # max, pow2, dense, [1,2,3,4]
    flat = " ".join(out.split())
    assert "12 failed points; first: triton max_loras 4 pow2 c=4 n=0: worker exited with status -9" in flat
    assert ("incomplete run, interrupted: 76 of 95 planned points finished (19 missing, 12 failed); missing: "
            "triton/4/agnostic 19") in flat
    complete = Console(width=80, file=io.StringIO())
    complete.print(points_table(CARD, "cuda", coverage(H200_CARD, CARD)))
    assert "incomplete" not in complete.file.getvalue() and "failed point" not in complete.file.getvalue()


def test_recommend_when_nothing_fits_the_budget(tmp_path, capsys):
    capsys.readouterr()
    assert main(["recommend", str(H200_CARD), "--graph-memory-budget", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no capture set fits the budgets (not even max: max needs 4 LoRA graphs, 118 MiB" in err[0]
    slots = pd.read_parquet(H200_SLOTS / "points.parquet")
    slots.loc[slots.max_loras == 128, "graph_mem_bytes"] *= 2  # 128 slots' graphs need 220 MiB, 32 slots' 110
    run = tmp_path / "slots"
    run.mkdir()
    slots.to_parquet(run / "points.parquet")
    assert main(["recommend", str(run), "--graph-memory-budget", "150"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "triton max_loras=128: no set: no capture set fits the budgets (not even max" in out
    recs = json.loads((run / "recommendation.json").read_text())["auto"]["uniform"]
    assert [r["auto"] is None for r in recs] == [False, True]


def test_coverage_of_a_plan_and_of_a_count_only_run(tmp_path):
    run = partial_run(tmp_path, drop=pow2_at(8), fail=pow2_at(4), status="interrupted")
    cov = coverage(run)
    assert (cov.planned, cov.finished, cov.failed, len(cov.missing)) == (57, 51, 6, 6)
    assert cov.missing_by_config == {("triton", 4, "pow2"): 6} and not cov.complete
    assert cov.planned_concurrency == {("triton", 4, s): (1, 2, 4, 8) for s in ("max", "pow2", "dense")}
    old = tmp_path / "old"  # run.json from before the plan was written: a count per job
    old.mkdir()
    CARD[~pow2_at(8)(CARD)].to_parquet(old / "points.parquet")
    (old / "run.json").write_text(json.dumps({"status": "finished", "spec": {"concurrency": [1, 2, 4, 8]}, "jobs": [
        {"kernels": "triton", "max_loras": 4, "strategy": s, "points": 19} for s in ("max", "pow2", "dense")]}))
    cov = coverage(old)
    assert cov.missing_by_config == {("triton", 4, "pow2"): 6} and cov.planned_concurrency[("triton", 4, "dense")] == (1, 2, 4, 8)
    assert not cov.complete and cov.line().endswith("missing: triton/4/pow2 6")
