"""Serving runs: a closed loop whose requests carry prompts, scheduled with chunked prefill from
max_loras slots (``config.serving``): a case worked by hand, the loop's rules on random loops, the
timed window's latencies, and a sweep end to end on the CPU with its report and bad input."""

import random

import numpy as np
import pandas as pd
import pytest
from conftest import H200_CARD

from lorabench.cli import main
from lorabench.config.chunked import Request, Served, Step
from lorabench.config.flags import Machine
from lorabench.config.lengths import Lengths, as_lengths, parse_lengths
from lorabench.config.residency import Adapters, Requests
from lorabench.config.serving import default_burn_in, simulate_prompts
from lorabench.config.serving_latency import latencies
from lorabench.config.spec import build_spec
from lorabench.config.workload import parse_workload
from lorabench.errors import UserError


def test_one_client_worked_by_hand():
    """Prompts of 3 tokens, 2 output tokens, 2 tokens per step: a prompt takes two steps (the
    second makes the first token), one decode makes the second; the next request arrives after."""
    s = simulate_prompts(parse_workload("single"), Adapters(4, None, 2), 1, 1, 7, Lengths(3, 3), 2, burn_in=0)
    assert [[(p.request, p.tokens, p.context, p.prefill, p.emits) for p in st.pieces] for st in s.pieces] == [
        [(0, 2, 0, True, False)], [(0, 1, 2, True, True)], [(0, 1, 3, False, True)],
        [(1, 2, 0, True, False)], [(1, 1, 2, True, True)], [(1, 1, 3, False, True)], [(2, 2, 0, True, False)]]
    assert s.batches[0] == [0, 0] and s.loads[0] == [(0, 0)] and not any(s.loads[1:])  # loaded once, kept
    assert all(rows == {st.pieces[0].request: 0} for rows, st in zip(s.rows, s.pieces))  # one row, reused
    assert list(s.tokens) == [2, 1, 1, 2, 1, 1, 2] and not s.waiting.any()
    lat = latencies(s.served, np.ones(7))  # steps of 1 ms: TTFT 2 steps, ITL 1
    assert list(lat.ttft_ms) == [2.0, 2.0] and list(lat.itl_ms) == [1.0, 1.0] and lat.ttft_pending == 1


@pytest.mark.parametrize("seed", range(6))
def test_the_loop_keeps_its_rules(seed):
    rng = random.Random(seed)
    clients, max_loras, budget = rng.randint(1, 6), rng.randint(1, 3), rng.choice([4, 16, 64])
    prompts, out = Lengths(rng.randint(1, 8), rng.randint(8, 40)), rng.randint(1, 12)
    wl = parse_workload(rng.choice(["uniform", "zipf:1", "zipf:1+base:0.3"]))
    s = simulate_prompts(wl, Adapters(6, 4 if max_loras <= 4 else None, out), clients, max_loras, 300, prompts, budget,
                         seed=seed)
    held, row_of = list(s.first_slots), {}
    for step, rows, batch, loads in zip(s.pieces, s.rows, s.batches, s.loads):
        assert 1 <= step.tokens <= budget and len(step.adapters) <= max_loras
        assert len(set(rows.values())) == len(rows) and all(0 <= r < clients for r in rows.values())
        for request, row in rows.items():  # a request keeps its row while it runs
            assert row_of.setdefault(request, row) == row
        for p in step.pieces:
            assert p.context + p.tokens <= prompts.high + out
        for slot, adapter in loads:
            held[slot] = adapter
        assert [held[b] if b >= 0 else -1 for b in batch] == step.token_adapters  # every token's slot holds its adapter
        done = {r for r in rows if s.served.requests[r].done}  # rows of finished requests are handed on
        row_of = {r: v for r, v in row_of.items() if r not in done}
    assert (s.waiting >= 0).all()


def test_the_timed_window_counts_only_what_began_in_it():
    served = Served([Step(())] * 4, [Request(0, 1, 3, 0, 1, [0, 1, 2]), Request(0, 1, 2, 2, 1, [3])])
    window = served.after(2)
    assert [(r.arrival, r.emitted_at) for r in window.requests] == [(-2, [0]), (0, [1])]
    assert [r.done for r in window.requests] == [True, False]  # the first finished in the window
    lat = latencies(window, [1.0, 1.0])
    assert list(lat.ttft_ms) == [2.0] and lat.itl_ms.size == 0 and lat.output_tokens == 2


def test_lengths_parse():
    assert parse_lengths("1600", "--x") == Lengths(1600, 1600) and str(parse_lengths(" 8-24", "--x")) == "8-24"
    for bad in ("0", "a", "9-3", "1-x"):
        with pytest.raises(UserError, match="--x"):
            parse_lengths(bad, "--x")
    assert parse_lengths("8", "--x", most=8) == Lengths(8, 8)
    with pytest.raises(UserError, match="above 8 tokens"):
        parse_lengths("2-9", "--x", most=8)
    # a row's: a count, a whole float beside nulls, or the text; a ValueError otherwise
    assert as_lengths(600) == as_lengths(600.0) == as_lengths("600") == Lengths(600, 600)
    assert as_lengths("300-900") == Lengths(300, 900) and Adapters(4, None, "2-5").output_tokens == Lengths(2, 5)
    for bad in (None, 2.5, "nan"):
        with pytest.raises(ValueError):
            as_lengths(bad)


def test_output_lengths_drawn_from_a_range_decode_as_drawn():
    """--output-tokens LO-HI: every request's length uniform over the range, both ends reached, and
    every request that finishes has made exactly its tokens; the default burn-in covers the longest."""
    s = simulate_prompts(parse_workload("zipf:1"), Adapters(6, None, "3-9"), 4, 2, 600, Lengths(4, 10), 16, seed=1,
                         burn_in=0)
    lengths = [r.output_tokens for r in s.served.requests]
    assert min(lengths) == 3 and max(lengths) == 9 and len(set(lengths)) == 7
    assert all(len(r.emitted_at) == r.output_tokens for r in s.served.requests if r.done)
    assert sum(r.done for r in s.served.requests) > 100
    assert default_burn_in(Adapters(6, None, "3-9"), 4, Lengths(4, 10), 16) == 2 * (9 + 3)


def test_a_fixed_output_length_draws_nothing():
    """A fixed length leaves the generator alone: the requests' adapters are those a loop of another
    fixed length draws (so runs recorded before ranges existed re-simulate as they ran)."""
    def adapters(out):
        nxt = Requests(parse_workload("zipf:1+base:0.2"), Adapters(16, None, out), 5)
        return [nxt.with_prompt(Lengths(8, 24))[0] for _ in range(200)]

    assert adapters(7) == adapters(600) != adapters("7-9")


def test_a_committed_serving_run_re_simulates_as_it_ran():
    """The frozen H100 serving run (fixed 600 output tokens, recorded as an integer column): its
    loops, simulated again from their rows, have the very mix and loads its steps were timed with."""
    df = pd.read_parquet(DATA / "h100-serving" / "points.parquet")
    for r in df[df["mode"] == "serving"].itertuples():
        s = simulate_prompts(parse_workload(r.workload), Adapters(int(r.adapters), int(r.max_cpu_loras), r.output_tokens),
                             int(r.concurrency), int(r.max_loras), int(r.timed_steps),
                             parse_lengths(r.input_tokens, "input_tokens"), int(r.max_num_batched_tokens), int(r.seed))
        steps = s.served.steps
        assert s.tokens.mean() == pytest.approx(r.tokens_per_step, abs=1e-9)
        assert s.n_loads.mean() == pytest.approx(r.loads_per_step, abs=1e-9)
        assert np.mean([st.prefill_tokens > 0 for st in steps]) == pytest.approx(r.mixed_step_share, abs=1e-9)


CPU = Machine(cuda=False)
DATA = H200_CARD.parent


@pytest.mark.parametrize("flags,says", [
    ({"input_tokens": "16"}, "goes with --adapters"),
    ({"input_tokens": "16-x", "adapters": "8"}, "neither a token count"),
    ({"input_tokens": "1000", "adapters": "8", "output_tokens": "64", "context_len": "1024"}, "does not fit --context-len"),
    ({"input_tokens": "16", "adapters": "8", "model": "tiny-moe"}, "dense models only"),
])
def test_bad_serving_settings_get_one_line(flags, says):
    with pytest.raises(UserError, match=says):
        build_spec({"device": "cpu", **flags}, None, CPU)


@pytest.mark.e2e
def test_a_serving_sweep_reports_its_latencies(tmp_path):
    code = main(["sweep", "--out", str(tmp_path), "--device", "cpu", "--max-loras", "2", "--concurrency", "4",
                 "--adapters", "8", "--input-tokens", "8-24", "--output-tokens", "6-10", "--context-len", "64",
                 "--iters", "60", "--warmup", "2", "--workload", "zipf:1,base:1", "--max-num-batched-tokens", "32",
                 "--strategy", "max,pow2"])
    assert code == 0
    (run,) = tmp_path.glob("*/points.parquet")
    df = pd.read_parquet(run)
    srv = df[df["mode"] == "serving"]
    assert len(srv) == 4 and (srv.status == "ok").all() and set(srv.input_tokens) == {"8-24"}
    assert set(srv.output_tokens) == {"6-10"}
    assert (srv.ttft_requests > 0).all() and (srv.ttft_ms_p50 > 0).all() and (srv.itl_ms_p50 > 0).all()
    assert (srv.ttft_ms_p50_low <= srv.ttft_ms_p50).all() and (srv.ttft_ms_p50 <= srv.ttft_ms_p50_high).all()
    assert ((srv.prefill_token_share > 0) & (srv.mixed_step_share > 0) & (srv.mixed_step_share < 1)).all()
    assert (srv.output_tokens_per_s < srv.tokens_per_s).all()
    assert (srv[srv.workload == "base:1"].loads_per_step == 0).all()
    assert main(["report", str(run.parent)]) == 0
    md = (run.parent / "report.md").read_text()
    assert "## Serving with prompts" in md and "**zipf:1**" in md and "**base:1**" in md
    assert "keep the phases" not in md  # output lengths drawn: no lockstep note
    assert "| ITL p50 | ITL p90 | ITL p99 |" in md


def serving_row(max_loras, tokens_s, p99, low, high, point):
    return {"status": "ok", "mode": "serving", "workload": "zipf:1", "kernels": "triton", "max_loras": max_loras,
            "strategy": "max", "max_cudagraph_capture_size": 32, "point": point, "output_tokens_per_s": tokens_s,
            "ttft_ms_p99": p99, "ttft_ms_p99_low": low, "ttft_ms_p99_high": high, "itl_ms_p99": 12.0, "ttft_pending": 0,
            "graph_mem_bytes": 2**30, "mixed_graph_mem_bytes": 2**29, "startup_s": 10.0, "mixed_capture_s": 2.0,
            "ttft_requests": 400 if low is not None else 20, "iters": 3000, "ttft_ms_p50": p99 / 4, "itl_ms_p50": 8.0}


def test_the_serving_choice_is_the_fastest_shown_within_the_target():
    from lorabench.analysis.serving import MET, MISSED, UNCLEAR, choices

    rows = pd.DataFrame([serving_row(32, 900.0, 520.0, 505.0, 540.0, 0),  # fastest, shown above 500 ms
                         serving_row(16, 800.0, 480.0, 400.0, 510.0, 1),  # spans it
                         serving_row(4, 500.0, 300.0, 280.0, 330.0, 2),  # shown within
                         serving_row(8, 700.0, 250.0, None, None, 3)])  # too few requests for an interval
    (c,) = choices(rows, 500.0)
    assert [s.against(500.0) for s in c.runs] == [MISSED, UNCLEAR, UNCLEAR, MET]  # most tokens/s first
    assert c.chosen.max_loras == 4 and "3 faster" in c.why
    # the one without an interval: what it served, and a loop long enough for one (3000 x 368 / 20 steps)
    assert "1 of them served 20 requests, a p99 interval needs 368: --iters 56000" in c.why
    assert c.chosen.graph_mem_bytes == 1.5 * 2**30 and c.chosen.startup_s == 12.0  # FULL and PIECEWISE together
    assert choices(rows)[0].chosen.max_loras == 32  # no target: the most tokens/s
    (none,) = choices(rows, 100.0)
    assert none.chosen is None and "none is shown to meet" in none.why


@pytest.mark.e2e
def test_recommend_under_a_ttft_target(tmp_path, capsys):
    import json

    run = tmp_path / "run"
    run.mkdir()
    rows = pd.DataFrame([serving_row(32, 900.0, 520.0, 505.0, 540.0, 0), serving_row(4, 500.0, 300.0, 280.0, 330.0, 1)])
    rows = rows.assign(run_id="run", device="cpu", gpu_uuid=None, rank=16, tp=1, fully_sharded_loras=False,
                       concurrency=16, n_active=None, output_tokens="600")
    from conftest import with_schema

    from lorabench.storage.results import SCHEMA

    with_schema(rows).to_parquet(run / "points.parquet", schema=SCHEMA)
    assert main(["recommend", str(run), "--ttft-p99-ms", "500"]) == 0
    out = capsys.readouterr().out
    assert "max_loras 4, max" in out and "--max-loras 4" in out and "--max-cudagraph-capture-size 32" in out
    entry = json.loads((run / "recommendation.json").read_text())["serving"]["ttft_p99_ms=500"][0]
    assert entry["chosen"]["max_loras"] == 4 and [r["against_target"] for r in entry["runs"]] == ["missed", "met"]
    assert "note: triton under zipf:1: every request decodes 600 tokens" in out and "keep the phases" in entry["note"]
    assert [(r["ttft_p50_ms"], r["itl_p50_ms"]) for r in entry["runs"]] == [(130.0, 8.0), (75.0, 8.0)]
    assert main(["recommend", str(run), "--ttft-p99-ms", "100"]) == 2
    assert main(["recommend", str(run), "--ttft-p99-ms", "500", "--adapters", "8"]) == 2


def test_recommend_chooses_among_runs_of_other_capture_sizes(tmp_path, capsys):
    """A sweep has one --max-cudagraph-capture-size; --also adds another run's serving runs (its own
    size) to the choice, of the same GPU model only."""
    import json

    from conftest import with_schema

    from lorabench.storage.results import SCHEMA

    def write(name, size, tokens_s, gpu):
        run = tmp_path / name
        run.mkdir()
        row = serving_row(32, tokens_s, 300.0, 280.0, 330.0, 0)
        rows = pd.DataFrame([row]).assign(run_id=name, device="cuda", gpu_name=gpu, gpu_uuid=f"GPU-{name}", rank=16,
                                          tp=1, fully_sharded_loras=False, concurrency=16, n_active=None,
                                          max_cudagraph_capture_size=size, output_tokens="300-900")
        with_schema(rows).to_parquet(run / "points.parquet", schema=SCHEMA)
        return run

    a, b = write("a", 32, 900.0, "NVIDIA H100"), write("b", 64, 950.0, "NVIDIA H100")
    assert main(["recommend", str(a), "--ttft-p99-ms", "500", "--also", str(b)]) == 0
    entry = json.loads((a / "recommendation.json").read_text())["serving"]["ttft_p99_ms=500"][0]
    assert entry["chosen"]["max_cudagraph_capture_size"] == 64 and entry["chosen"]["run_id"] == "b"
    assert [r["run_id"] for r in entry["runs"]] == ["b", "a"] and "--max-cudagraph-capture-size 64" in capsys.readouterr().out
    other = write("c", 64, 990.0, "NVIDIA H200")
    assert main(["recommend", str(a), "--ttft-p99-ms", "500", "--also", str(other)]) == 2
    assert "measured on NVIDIA H100" in capsys.readouterr().err
    assert main(["recommend", str(a), "--also", str(b)]) == 2
    assert "--also: goes with --ttft-p99-ms" in capsys.readouterr().err


def test_steps_with_a_prompt_are_priced_between_the_points_at_their_active_count():
    from lorabench.analysis.serving_price import _interpolate

    xs, ys = np.array([4.0, 20.0]), np.array([1.0, 5.0])
    assert _interpolate(12, xs, ys) == pytest.approx(3.0) and _interpolate(4, xs, ys) == pytest.approx(1.0)
    assert _interpolate(28, xs, ys) == pytest.approx(7.0)  # past the largest: along the last two
    assert _interpolate(12, xs[:1], ys[:1]) is None and _interpolate(4, xs[:1], ys[:1]) == 1.0


def test_a_serving_run_is_priced_on_its_own_schedule():
    from lorabench.analysis.serving_price import predict

    spec = dict(workload="zipf:1", adapters=8, max_cpu_loras=8, output_tokens=6, concurrency=4, max_loras=2,
                timed_steps=120, input_tokens="6-14", max_num_batched_tokens=16, seed=3)
    steps = simulate_prompts(parse_workload("zipf:1"), Adapters(8, 8, 6), 4, 2, 120, Lengths(6, 14), 16, seed=3)
    points = [{"status": "ok", "mode": mode, "kernels": "torch", "max_loras": 2, "strategy": "max", "concurrency": 4,
               "n_active": n, "prefill_tokens": t, "step_ms_median": ms}
              for n in range(3) for mode, t, ms in (("fixed", None, 1.0 + n), ("prefill", 16, 1.0 + n))]
    row = {"status": "ok", "mode": "serving", "kernels": "torch", "strategy": "max", "point": 99, "capture_sizes": [4],
           "load_ms_median": 0.5, **spec, **{f: 1.0 for f in ("output_tokens_per_s", "step_ms_mean", "ttft_ms_p50",
                                                               "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99")}}
    rows = pd.DataFrame(points + [row])
    p = predict(rows, next(rows[rows["mode"] == "serving"].itertuples()))
    want = 1.0 + steps.n_active + 0.5 * steps.n_loads  # every point at n takes 1 + n ms, every load 0.5
    assert p.why is None and p.predicted["step_ms_mean"] == pytest.approx(want.mean())
    assert p.predicted["output_tokens_per_s"] == pytest.approx(latencies(steps.served, want).tokens_per_s)
    assert p.error_pct("step_ms_mean") == pytest.approx(100 * (want.mean() - 1))
    no_prefill = predict(rows[rows["mode"] != "prefill"], next(rows[rows["mode"] == "serving"].itertuples()))
    assert no_prefill.predicted == {} and "with a prompt" in no_prefill.why


def test_a_loop_of_fixed_output_lengths_says_what_its_ttft_tail_is():
    from lorabench.analysis.serving import choices, lockstep_note

    rows = pd.DataFrame([serving_row(32, 900.0, 300.0, 280.0, 330.0, 0)])
    for fixed in ("600", 600, 600.0):
        assert "every request decodes 600 tokens" in lockstep_note(rows.assign(output_tokens=fixed))
    assert lockstep_note(rows.assign(output_tokens="300-900")) is None
    assert lockstep_note(rows.assign(output_tokens="600", workload="trace:t.csv")) is None  # a trace's own lengths
    (c,) = choices(rows.assign(output_tokens="600"), 500.0)
    assert c.chosen is not None and "--output-tokens LO-HI" in c.note
    (c,) = choices(rows.assign(output_tokens="300-900"), 500.0)
    assert c.note is None


def test_a_configuration_found_wrong_is_never_chosen():
    from lorabench.analysis.serving import choices

    rows = pd.DataFrame([serving_row(32, 900.0, 300.0, 280.0, 330.0, 0), serving_row(4, 500.0, 300.0, 280.0, 330.0, 1)])
    rows["correct"] = [False, True]
    (c,) = choices(rows, 500.0)
    assert c.chosen.max_loras == 4 and [s.max_loras for s in c.runs] == [4]


def test_a_trace_s_own_lengths_must_fit_the_context(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("adapter,input_tokens,output_tokens\n0,100,8\n1,10,8\n")
    with pytest.raises(UserError, match=r"a request of 100 prompt and 8 output tokens \(trace trace:.*\) does not fit"):
        build_spec({"device": "cpu", "adapters": "8", "input_tokens": "8-24", "context_len": "64",
                    "workload": f"trace:{trace}"}, None, CPU)
    with pytest.raises(UserError, match="--workload"):  # a bad workload still gets its own line
        build_spec({"device": "cpu", "adapters": "8", "input_tokens": "8", "workload": "zipf:x"}, None, CPU)


def test_a_serving_runs_prefill_points_stop_at_their_own_cap(tmp_path):
    """The loop takes the spec's iters; its prefill points, which only price its mixed steps, at
    most PREFILL_STEPS (3000 steps of a ~65 ms prompt step were 3 minutes a point)."""
    from lorabench.config.plan import plan
    from lorabench.runtime.worker import PREFILL_STEPS, Worker

    flags = dict(max_loras="2", concurrency="4", adapters="8", input_tokens="8-24", output_tokens="8", context_len="64",
                 iters="3000", max_num_batched_tokens="32", prefill_tokens="24", strategy="max", kernels="triton",
                 device="cpu", out=str(tmp_path))
    spec, _ = build_spec(flags, None, CPU)
    job = plan(spec)[0]
    w = Worker([job], 0.0)
    wanted = {p.mode: w.steps_wanted(p) for p in job.points}
    assert wanted == {"fixed": 3000, "prefill": PREFILL_STEPS, "serving": 3000} and PREFILL_STEPS < 3000


def test_the_what_if_script_prices_a_run_at_its_own_lengths_as_the_report_does():
    """scripts/serving_what_if.py at the run's own lengths gives the report's prediction; at other
    lengths it prices the loop again (here: the frozen H100 run, outputs drawn from a range)."""
    import subprocess
    import sys
    from pathlib import Path

    from lorabench.analysis.serving_price import predictions
    from lorabench.storage.results import load_run

    root = Path(__file__).resolve().parent.parent
    run = DATA / "h100-serving"
    script = [sys.executable, str(root / "scripts" / "serving_what_if.py"), str(run), "--max-loras", "32",
              "--workload", "zipf:1"]
    out = subprocess.run(script, capture_output=True, text=True, timeout=300, check=True).stdout.splitlines()
    rows = load_run(run)
    want = {rows.set_index("point").loc[p.point].kernels: p.predicted for p in predictions(rows)
            if rows.set_index("point").loc[p.point].max_loras == 32 and rows.set_index("point").loc[p.point].workload == "zipf:1"}
    assert len(out) == 2
    for line in out:
        kernels = line.split()[0]
        assert f"p99 {want[kernels]['ttft_ms_p99']:.1f}," in line and "(80 requests)" in line
    ranged = subprocess.run(script + ["--output-tokens", "300-900", "--steps", "1000"], capture_output=True, text=True,
                            timeout=300, check=True).stdout
    assert ranged.count("out 300-900 steps   1000") == 2
