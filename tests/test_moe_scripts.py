"""The MoE scripts behind BENCHMARKS.md, on the CPU (no timings): the expert-LoRA bench checks
every variant it would time, and the figures script reads its runs."""

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
               "--expand-programs", "1,512", "--base-tokens", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    names = {r["variant"] for r in rows if r["variant"].startswith("lorabench")}
    assert names == {"lorabench", "lorabench per-entry", "lorabench sorted", "lorabench sorted /1",
                     "lorabench sorted /512"}
    assert all(r["correct"] for r in rows)
    assert {(r["tokens"], r["active"], r["launch"], r["base_tokens"]) for r in rows} == {(2, 1, 4, 1), (12, 2, 2, 1)}


@pytest.mark.parametrize("point", ["1:2:1", "1:1:9", "one", "2:0", "2:3"])
def test_the_expert_lora_bench_refuses_a_bad_point_in_one_line(point):
    done = run("scripts/moe_lora_bench.py", "--model", "tiny-moe", "--points", point)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("moe_lora_bench.py: error: point")
