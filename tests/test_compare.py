"""``lorabench compare RUN_A RUN_B``: matching (same key, same GPU), per-point and overall verdicts,
the gate's exit status, the JSON and plot, bad input in one line; on synthetic runs of known
truth, and once on two real tiny CPU sweeps."""

import json
from pathlib import Path

import numpy as np
import pytest

from lorabench.analysis.ab import compare_runs, device_of, key_of
from lorabench.cli import main
from lorabench.stats import geometric_mean_ratio, relative_difference
from lorabench.storage.results import PointsWriter
from lorabench.storage.samples import read_samples, step_times, write_samples

GPU_A, GPU_B = "GPU-aaaa-1111", "GPU-bbbb-2222"


def grid(strategies=("max", "pow2"), concurrencies=(1, 2, 4)):
    """(strategy, c, n, workload) of a small sweep: every active count at each c, then uniform."""
    out = []
    for s in strategies:
        for c in concurrencies:
            out += [(s, c, n, None) for n in range(1, c + 1)]
            out.append((s, c, None, "uniform"))
    return out


def true_ms(strategy, c, n):
    """A different median for every point, so matching the wrong points would show."""
    return 5.0 + 0.7 * c + 0.3 * (n or 2.5) + (0.4 if strategy == "pow2" else 0.0)


def make_run(path: Path, seed: int, scale: float = 1.0, points=None, gpu=lambda i: GPU_A, sigma=0.01,
             steps=100, samples=True, failed=(), device="cuda", host="node-1", rank=16) -> Path:
    """A run folder as a sweep writes it: points.parquet and, with ``samples``, every step, drawn
    lognormally around ``scale`` times the point's true median."""
    path.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    writer = PointsWriter(path)
    for i, (s, c, n, wl) in enumerate(points or grid()):
        ms = true_ms(s, c, n) * scale * np.exp(sigma * rng.standard_normal(steps))
        ok = i not in failed
        if samples and ok:
            write_samples(path, i, {"turn": list(range(steps)), "step_ms": ms.tolist(), "host_us": [20.0] * steps,
                                    "copy_us": [5.0] * steps, "launch_us": [8.0] * steps,
                                    "n_active": [n or 1] * steps, "launches": [4] * steps})
        writer.append({"run_id": path.name, "model": "llama-2-7b", "rank": rank, "dtype": "float16",
                       "kernels": "triton", "max_loras": 4, "strategy": s, "mode": "workload" if wl else "fixed",
                       "concurrency": c, "n_active": n, "workload": wl, "status": "ok" if ok else "failed",
                       "step_ms_median": float(np.median(ms)) if ok else None, "point": i, "device": device,
                       "gpu_uuid": gpu(i) if device == "cuda" else None, "host": host,
                       "gpu_name": "NVIDIA H200" if device == "cuda" else None, "git_sha": f"sha{seed}",
                       "timed_steps": steps})
    return path


def read(run: Path, point: int) -> np.ndarray:
    return step_times(read_samples(run, [point]))[point]


def run_cli(capsys, *argv):
    rc = main(["compare", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def verdicts(run_b: Path, run_a: Path) -> list[str]:
    data = json.loads((run_b / f"compare-{run_a.name}.json").read_text())
    return [p["verdict"] for p in data["points"]]


def test_a_a_finds_no_difference_and_writes_json_and_plot(tmp_path, capsys):
    a, b = make_run(tmp_path / "a", seed=1), make_run(tmp_path / "b", seed=2)
    rc, out, err = run_cli(capsys, a, b, "--fail-if-slower", "0.5")
    assert rc == 0, out + err
    got = verdicts(b, a)
    assert len(got) == len(grid())
    assert sum(v == "no difference detected" for v in got) >= 0.95 * len(got), got
    data = json.loads((b / "compare-a.json").read_text())
    o = data["overall"]["geomean_diff_pct"]
    assert o["low"] < 0 < o["high"] and o["high"] - o["low"] < 0.5, o
    assert data["overall"]["compared"] == len(grid()) and data["margin_pct"] == 1.0
    assert data["failed"] is False and data["fail_if_slower_pct"] == 0.5
    p = data["points"][0]
    assert (p["point_a"], p["point_b"], p["samples_a"], p["samples_b"]) == (0, 0, 100, 100)
    assert abs(p["median_ms_a"] - true_ms("max", 1, 1)) < 0.05 and 0 <= p["p_value"] <= 1
    assert (b / "compare-a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "no difference detected" in out and "0 slower, 0 faster" in out
    assert max(len(line) for line in out.splitlines()) <= 80, out


def test_b_ten_percent_slower_is_detected_everywhere_and_gates(tmp_path, capsys):
    a, b = make_run(tmp_path / "a", seed=1), make_run(tmp_path / "b", seed=2, scale=1.10)
    plot = tmp_path / "plots" / "ab.png"
    rc, out, err = run_cli(capsys, a, b, "--plot", plot)
    assert rc == 0, out + err
    assert set(verdicts(b, a)) == {"slower"}
    assert plot.is_file() and not (b / "compare-a.png").exists()
    data = json.loads((b / "compare-a.json").read_text())
    o = data["overall"]["geomean_diff_pct"]
    assert 9 < o["low"] <= o["estimate"] <= o["high"] < 11, o
    assert all(9 < p["diff_pct"]["estimate"] < 11 and p["p_value"] < 1e-6 for p in data["points"])
    assert f"{len(grid())} slower, 0 faster, 0 same" in out

    rc, out, _ = run_cli(capsys, a, b, "--fail-if-slower", "5")
    assert rc == 1 and "FAIL" in out
    assert json.loads((b / "compare-a.json").read_text())["failed"] is True
    rc, out, _ = run_cli(capsys, a, b, "--fail-if-slower", "20")
    assert rc == 0 and "FAIL" not in out
    back = compare_runs(b, a)  # the other way round: A is 9 % faster (1 / 1.1)
    assert back.counts()["faster"] == len(grid()) and not back.slower_beyond(0)
    assert -9.5 < back.overall.low < back.overall.high < -8.7, back.overall


def test_the_gate_needs_confidence_not_just_the_estimate(tmp_path, capsys):
    """Noisy points, B 10 % slower: the gate fails only when the interval's low end passes PCT."""
    a = make_run(tmp_path / "a", seed=1, sigma=0.3, steps=20, points=grid(concurrencies=(1,)))
    b = make_run(tmp_path / "b", seed=2, sigma=0.3, steps=20, scale=1.1, points=grid(concurrencies=(1,)))
    o = compare_runs(a, b).overall
    assert o.low + 1 < o.estimate, o  # wide enough to tell the two rules apart
    rc, _, _ = run_cli(capsys, a, b, "--fail-if-slower", f"{(o.low + o.estimate) / 2:.3f}")
    assert rc == 0
    rc, _, _ = run_cli(capsys, a, b, "--fail-if-slower", f"{o.low - 0.5:.3f}")
    assert rc == 1


def test_margin_decides_what_counts(tmp_path, capsys):
    a = make_run(tmp_path / "a", seed=1, sigma=0.005)
    b = make_run(tmp_path / "b", seed=2, sigma=0.005, scale=1.005)
    c = compare_runs(a, b, margin_pct=1.0)
    assert c.counts()["no difference detected"] == len(grid())
    assert compare_runs(a, b, margin_pct=0.05).counts()["slower"] >= 0.9 * len(grid())
    # the same statistics as lorabench.stats's functions (their own draws: intervals agree closely)
    pairs = [(read(a, p.point_a), read(b, p.point_b)) for p in c.points]
    for p, (x, y) in zip(c.points, pairs):
        ref = relative_difference(x, y)
        assert p.diff.estimate == pytest.approx(ref.estimate, abs=1e-9)
        assert abs(p.diff.low - ref.low) < 0.05 and abs(p.diff.high - ref.high) < 0.05
    ref = geometric_mean_ratio(pairs)
    assert c.overall.estimate == pytest.approx(ref.estimate, abs=1e-9)
    assert abs(c.overall.low - ref.low) < 0.02 and abs(c.overall.high - ref.high) < 0.02
    rc, _, err = run_cli(capsys, a, b, "--margin", "-1")
    assert rc == 2 and err.count("\n") == 1 and "--margin" in err


def test_points_on_another_gpu_are_left_out_and_said_so(tmp_path, capsys):
    a = make_run(tmp_path / "a", seed=1)
    b = make_run(tmp_path / "b", seed=2, scale=1.5, gpu=lambda i: GPU_B if i % 4 == 0 else GPU_A)
    other = sum(1 for i in range(len(grid())) if i % 4 == 0)
    rc, out, err = run_cli(capsys, a, b)
    assert rc == 0, out + err
    assert f"{other} matching points left out as measured on another GPU" in out
    data = json.loads((b / "compare-a.json").read_text())
    assert data["overall"]["compared"] == len(grid()) - other and len(data["other_device"]) == other
    assert all(p["point_a"] % 4 for p in data["points"])

    c = make_run(tmp_path / "c", seed=3, gpu=lambda i: GPU_B)
    rc, out, err = run_cli(capsys, a, c)
    assert rc == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1
    assert "on the same GPU" in err and GPU_B in err and "Traceback" not in err


def test_points_in_one_run_only_are_counted_not_compared(tmp_path, capsys):
    a = make_run(tmp_path / "a", seed=1, points=grid(concurrencies=(1, 2, 4)))
    b_points = grid(concurrencies=(1, 2)) + [("dense", 1, 1, None)]
    b = make_run(tmp_path / "b", seed=2, points=b_points, failed=(0,))  # B's max c1 n1 failed
    rc, out, err = run_cli(capsys, a, b)
    assert rc == 0, out + err
    data = json.loads((b / "compare-a.json").read_text())
    only_a = 2 * 5 + 1  # c = 4 (four n and uniform) for max and pow2, and B's failed point
    assert len(data["only_a"]) == only_a and len(data["only_b"]) == 1
    assert data["only_b"][0]["strategy"] == "dense"
    assert data["overall"]["compared"] == len(b_points) - 2
    assert f"{only_a} points only in A, not compared: " in out and "(+7 more)" in out
    assert "1 point only in B, not compared: triton L4 dense c1 n1" in out


def test_runs_set_to_different_ranks_are_compared_across_the_rank(tmp_path, capsys):
    """Rank-8 adapters at rank 8 (A) against padded to 64 (B, 5 % slower): the rank is what B
    changes, so points match on everything else, and the output says so."""
    a = make_run(tmp_path / "a", seed=1, rank=8)
    b = make_run(tmp_path / "b", seed=2, rank=64, scale=1.05)
    rc, out, err = run_cli(capsys, a, b)
    assert rc == 0, out + err
    assert "B differs from A in rank 8 -> 64: points matched on everything else" in out
    data = json.loads((b / "compare-a.json").read_text())
    assert data["across"] == {"rank": {"a": 8, "b": 64}} and data["overall"]["compared"] == len(grid())
    assert set(verdicts(b, a)) == {"slower"} and 4 < data["overall"]["geomean_diff_pct"]["low"] < 5
    same = compare_runs(a, make_run(tmp_path / "a2", seed=3, rank=8))  # one rank in both: nothing across
    assert same.across == {} and len(same.points) == len(grid())


def test_a_run_without_samples_is_refused_in_one_line(tmp_path, capsys):
    a = make_run(tmp_path / "a", seed=1)
    old = make_run(tmp_path / "old", seed=2, samples=False)
    for argv in ((a, old), (old, a)):
        rc, out, err = run_cli(capsys, *argv)
        assert rc == 2 and out == ""
        assert err == f"error: {old} has no samples/ (measured before lorabench kept raw samples): re-run it\n"
    assert not list(a.glob("compare-*")) and not list(old.glob("compare-*"))


@pytest.mark.parametrize("argv, says", [
    (["{a}", "{tmp}/nowhere"], "is not a folder"),
    (["{a}", "{tmp}"], "has no points.parquet"),
    (["{a}", "{a}", "--fail-if-slower", "-2"], "--fail-if-slower takes a percentage >= 0"),
    (["{a}", "{a}", "--fail-if-slower", "lots"], "--fail-if-slower takes a percentage >= 0"),
])
def test_bad_input_is_one_line_and_status_2(tmp_path, capsys, argv, says):
    a = make_run(tmp_path / "a", seed=1)
    rc, out, err = run_cli(capsys, *(x.format(a=a, tmp=tmp_path) for x in argv))
    assert rc == 2 and err.startswith("error: ") and says in err and err.count("\n") == 1, err


def test_cpu_runs_match_on_one_host_only(tmp_path, capsys):
    a = make_run(tmp_path / "a", seed=1, device="cpu", host="box")
    b = make_run(tmp_path / "b", seed=2, device="cpu", host="box")
    c = make_run(tmp_path / "c", seed=3, device="cpu", host="other-box")
    rc, out, _ = run_cli(capsys, a, b)
    assert rc == 0 and "ms CPU wall" in out
    rc, _, err = run_cli(capsys, a, c)
    assert rc == 2 and "cpu@box" in err and "cpu@other-box" in err
    assert device_of({"gpu_uuid": None, "host": "box", "device": "cpu"}) == "cpu@box"
    assert device_of({"gpu_uuid": None, "host": "box", "device": "cuda"}) is None  # a GPU row without its uuid
    nan_row = {"model": "m", "rank": 16.0, "dtype": "float16", "kernels": "t", "max_loras": 4, "strategy": "max",
               "mode": "workload", "concurrency": 2, "n_active": float("nan"), "workload": "uniform"}
    assert key_of(nan_row) == key_of({**nan_row, "n_active": None, "rank": 16})


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory):
    """Two real tiny CPU sweeps of three points each (about 10 s each on two cores)."""
    runs = []
    for name in ("first", "second"):
        out = tmp_path_factory.mktemp(name)
        rc = main(["sweep", "--out", str(out), "--device", "cpu", "--max-loras", "2", "--concurrency", "1",
                   "--strategy", "max", "--iters", "30", "--warmup", "2", "--context-len", "16"])
        assert rc == 0
        (run,) = [p.parent for p in out.glob("*/points.parquet")]
        runs.append(run)
    return runs


def test_two_real_cpu_sweeps_compare(cpu_runs, capsys):
    a, b = cpu_runs
    rc, out, err = run_cli(capsys, a, b, "--fail-if-slower", "1000000")  # a million percent: never met
    assert rc == 0, out + err
    data = json.loads((b / f"compare-{a.name}.json").read_text())
    assert data["overall"]["compared"] == 3 and not data["only_a"] and not data["only_b"]
    assert data["run_a"]["devices"] == data["run_b"]["devices"] and data["run_a"]["devices"][0].startswith("cpu@")
    assert {(p["n_active"], p["workload"]) for p in data["points"]} == {(0, None), (1, None), (None, "uniform")}
    assert all(p["samples_a"] == p["samples_b"] == 30 and p["diff_pct"] is not None for p in data["points"])
    assert (b / f"compare-{a.name}.png").is_file()
    # a run against itself: every difference is exactly 0, and nothing is slower beyond 0 %
    rc, out, err = run_cli(capsys, a, a, "--fail-if-slower", "0")
    assert rc == 0, out + err
    data = json.loads((a / f"compare-{a.name}.json").read_text())
    assert all(p["diff_pct"]["estimate"] == 0 and p["verdict"] != "slower" for p in data["points"])
