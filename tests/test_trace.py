"""Workloads from a server's trace (``trace:PATH``): P(n | c) and batches, from requests or steps."""

import json
import random

import numpy as np
import pytest

from lorabench.cli import main
from lorabench.config.flags import Machine
from lorabench.config.spec import build_spec
from lorabench.config.workload import parse_workload
from lorabench.errors import UserError


@pytest.fixture
def requests_csv(tmp_path):
    path = tmp_path / "requests.csv"
    path.write_text("adapter\nsql\nsql\nbase\nchat\n\nsql\n")  # ids: sql, sql, -, chat, -, sql
    return path


def test_requests_trace_counts_distinct_adapters_per_window(requests_csv):
    wl = parse_workload(f"trace:{requests_csv}")
    assert wl.name == f"trace:{requests_csv}"
    # windows of 2: (sql,sql) 1, (sql,-) 1, (-,chat) 1, (chat,-) 1, (-,sql) 1
    assert wl.active_count_pmf(2, 4).tolist() == [0.0, 1.0, 0.0]
    # windows of 4: (sql,sql,-,chat) 2, (sql,-,chat,-) 2, (-,chat,-,sql) 2
    assert wl.active_count_pmf(4, 4).tolist() == [0, 0, 1, 0, 0]
    # one slot: a server cannot run two adapters at once, so n is capped at max_loras
    assert wl.active_count_pmf(4, 1).tolist() == [0, 1]


def test_requests_trace_batches_match_its_counts(requests_csv):
    wl, rng = parse_workload(f"trace:{requests_csv}"), random.Random(0)
    for _ in range(50):
        slots = wl.sample(4, 8, rng)
        assert len(slots) == 4 and sum(s == -1 for s in slots) in (1, 2)
        assert len({s for s in slots if s >= 0}) == 2 and all(-1 <= s < 8 for s in slots)
    assert all(len({s for s in wl.sample(4, 1, rng) if s >= 0}) == 1 for _ in range(10))


def test_steps_trace_jsonl(tmp_path):
    path = tmp_path / "steps.jsonl"
    rows = [{"concurrency": 8, "n_active": 2, "base_tokens": 3}] * 3 + [{"concurrency": 8, "n_active": 0}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    wl = parse_workload(f"trace:{path}")
    assert np.allclose(wl.active_count_pmf(8, 4), [0.25, 0, 0.75, 0, 0])
    rng = random.Random(1)
    for _ in range(20):
        slots = wl.sample(8, 4, rng)
        n = len({s for s in slots if s >= 0})
        assert len(slots) == 8 and (n, slots.count(-1)) in ((2, 3), (0, 8))
    with pytest.raises(ValueError, match="no steps at concurrency 4"):
        wl.active_count_pmf(4, 4)


@pytest.mark.parametrize("content,needle", [
    (None, "does not exist"),
    ("request,lora\n1,a\n", "needs an `adapter` column"),
    ("concurrency,n_active\n2,3\n", "0 <= n_active <= concurrency"),
])
def test_bad_traces_are_one_clear_error(tmp_path, content, needle):
    path = tmp_path / "t.csv"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError, match=needle):
        build_spec({"workload": f"trace:{path}", "device": "cpu"}, None, Machine(cuda=False))


def test_a_trace_must_cover_the_swept_concurrencies(requests_csv):
    with pytest.raises(UserError, match="fewer than concurrency 8"):
        build_spec({"workload": f"trace:{requests_csv}", "concurrency": "1,8", "device": "cpu"}, None, Machine(cuda=False))
    with pytest.raises(UserError, match="alone"):
        build_spec({"workload": f"trace:{requests_csv}+base:0.5", "device": "cpu"}, None, Machine(cuda=False))


def test_sweep_and_report_with_a_trace(tmp_path, requests_csv):
    import pandas as pd

    argv = ["sweep", "--out", str(tmp_path), "--max-loras", "2", "--concurrency", "1,4", "--strategy", "max",
            "--iters", "3", "--warmup", "1", "--context-len", "16", "--device", "cpu", "--no-check",
            "--workload", f"uniform,trace:{requests_csv}"]
    assert main(argv) == 0
    run = next(tmp_path.glob("*/points.parquet")).parent
    df = pd.read_parquet(run / "points.parquet")
    runs = df[df.workload == f"trace:{requests_csv}"]
    assert len(runs) == 2 and (runs.status == "ok").all()
    assert runs[runs.concurrency == 4].n_active_mean.iloc[0] == 2.0  # every window of 4 holds 2 adapters
    assert main(["report", str(run)]) == 0
    assert f"trace:{requests_csv}" in (run / "report.md").read_text()


def test_steps_csv_with_blank_lines_and_empty_base_cells(tmp_path):
    path = tmp_path / "steps.csv"
    path.write_text("concurrency,n_active,base_tokens\n4,2,1\n4,1,\n\n")
    wl = parse_workload(f"trace:{path}")
    assert np.allclose(wl.active_count_pmf(4, 4), [0, 0.5, 0.5, 0, 0])
    rng = random.Random(0)
    assert all(len(wl.sample(4, 4, rng)) == 4 for _ in range(10))
    bad = tmp_path / "bad.csv"
    bad.write_text("concurrency,n_active\n4,two\n")
    with pytest.raises(ValueError, match="row 0"):
        parse_workload(f"trace:{bad}")


def test_jsonl_mixing_null_and_minus_one_reads_both_as_base(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"adapter": 3}\n{"adapter": -1}\n{"adapter": null}\n{"adapter": 3}\n')
    wl = parse_workload(f"trace:{path}")
    assert wl.adapter_ids.tolist() == [0, -1, -1, 0]
