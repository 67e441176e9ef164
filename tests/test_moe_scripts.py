"""The MoE scripts behind BENCHMARKS.md, on the CPU (no timings): the expert-LoRA bench checks
every variant it would time, and the figures script reads the committed runs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.e2e
def test_the_expert_lora_bench_checks_each_variant_at_max_s_launch_count_grouped_and_with_base_tokens(tmp_path):
    out = tmp_path / "bench.json"
    done = run("scripts/moe_lora_bench.py", "--model", "tiny-moe", "--points", "2:1:4,12:2",
               "--expand-programs", "1,512", "--block-programs", "1", "--per-entry", "32768:8", "--base-tokens", "1",
               "--json", str(out))
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    names = {r["variant"] for r in rows if r["variant"].startswith("lorabench")}
    assert names == {"lorabench", "lorabench per-entry", "lorabench sorted", "lorabench sorted x1", "lorabench sorted per-tile",
                     "lorabench sorted per-tile b1", "lorabench sorted x1 b1", "lorabench sorted x512 b1",
                     "lorabench per-entry a32768 w8", "lorabench per-entry no pdl"}  # sorted: x512
    assert len({r["rel_err"] for r in rows if r["variant"].startswith("lorabench") and r["tokens"] == 2}) == 1  # checked on one y
    assert all(r["correct"] for r in rows)
    assert {(r["tokens"], r["active"], r["launch"], r["base_tokens"]) for r in rows} == {(2, 1, 4, 1), (12, 2, 2, 1)}


@pytest.mark.e2e
def test_the_expert_lora_bench_with_the_gemm_checks_the_lora_inside_it_against_the_gemm_alone(tmp_path):
    out = tmp_path / "bench.json"
    done = run("scripts/moe_lora_bench.py", "--model", "tiny-moe", "--points", "2:1:4,12:2", "--base-tokens", "1",
               "--with-gemm", "--json", str(out))
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    by_name = {(r["tokens"], r["variant"]): r for r in rows}
    assert {"gemm alone", "lorabench", "lorabench in-gemm", "lorabench in-gemm per-tile", "lorabench in-gemm two-pass",
            "lorabench in-gemm shrink-first"} <= {n for _, n in by_name}
    assert by_name[(2, "lorabench in-gemm")]["path"] == "in-gemm" and by_name[(2, "gemm alone")]["rel_err"] == 0
    assert by_name[(12, "lorabench in-gemm")]["path"] == "in-gemm+shrink"  # 24 entries over 16 experts
    assert all(r["correct"] for r in rows) and all(0 < r["rel_err"] for r in rows if r["variant"] != "gemm alone")


@pytest.mark.parametrize("args,what", [(["--points", "1:2:1"], "point"), (["--points", "1:1:9"], "point"),
                                       (["--points", "one"], "point"), (["--points", "2:0"], "point"),
                                       (["--points", "2:3"], "point"), (["--base-tokens", "-1"], "--base-tokens"),
                                       (["--expand-programs", "x"], "--expand-programs"),
                                       (["--expand-programs", "0"], "--expand-programs"),
                                       (["--block-programs", "-2"], "--block-programs"),
                                       (["--per-entry", "8192"], "--per-entry"), (["--per-entry", "8192:3"], "--per-entry")])
def test_the_expert_lora_bench_refuses_bad_input_in_one_line(args, what):
    done = run("scripts/moe_lora_bench.py", "--model", "tiny-moe", *args)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"moe_lora_bench.py: error: {what}")


def test_the_figures_script_pairs_backends_within_each_run_with_and_without_samples(tmp_path):
    run_dir = ROOT / "results" / "moe" / "qwen3-30b-a3b-ml4"
    done = run("scripts/moe_figures.py", str(run_dir), str(run_dir))  # the same run twice: kept apart
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 4, 1, 1 **")]
    assert len(rows) == 4 and len(set(rows)) == 2  # vs vLLM's default and its specialised grid, once per run
    assert "0.51 [0.51, 0.52]" in rows[0]  # the ratio BENCHMARKS.md quotes, with its interval
    bare = tmp_path / "run"
    bare.mkdir()
    (bare / "points.parquet").symlink_to(run_dir / "points.parquet")  # no samples/
    done = run("scripts/moe_figures.py", str(bare))
    assert done.returncode == 0, done.stderr
    assert "0.50 [no interval]" in done.stdout
