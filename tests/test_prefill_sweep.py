"""Prefill points end to end on the CPU: planned per prompt size and active count, their steps
chunked at --context-len, served by PIECEWISE graphs up to --max-cudagraph-capture-size and
eagerly past it, checked, and written as rows; bad prefill settings get one line."""

import json
import random

import pandas as pd
import pytest

from lorabench.cli import main
from lorabench.config.batches import prefill_requests, prefill_step
from lorabench.config.flags import Machine
from lorabench.config.plan import PREFILL, plan
from lorabench.config.spec import build_spec
from lorabench.errors import UserError

CPU = Machine(cuda=False)


def spec_of(**flags):
    return build_spec({"device": "cpu", **flags}, None, CPU)[0]


def test_prefill_steps_hold_long_chunks_beside_single_tokens():
    rng = random.Random(0)
    for tokens, n, most in [(16, 0, 3), (16, 3, 3), (100, 2, 4), (100, 4, 4), (7, 4, 4), (1616, 16, 16), (8192, 4, 16)]:
        requests = prefill_requests(tokens, most, 32 if tokens < 1000 else 2048)
        assert requests == max(most, 1, -(-tokens // (32 if tokens < 1000 else 2048)))
        step = prefill_step(tokens, n, 16, requests, 32 if tokens < 1000 else 2048, rng)
        assert step.tokens == tokens and len(step.adapters) == n and len(step.pieces) == requests
        assert all(p.prefill and p.context == 0 and p.tokens <= (32 if tokens < 1000 else 2048) for p in step.pieces)
        long = [p.tokens for p in step.pieces if p.tokens > 1]
        assert max(long, default=1) - min(long, default=1) <= 1 and len(long) <= -(-tokens // 32) + 1
        if n:
            assert step.pieces[0].adapter >= 0 and {p.adapter for p in step.pieces} == step.adapters
        else:
            assert all(p.adapter == -1 for p in step.pieces)
    loop_step = prefill_step(1616, 16, 16, 16, 2048, rng)  # the serving loop's mixed step: a prompt beside 15 tokens
    assert [p.tokens for p in loop_step.pieces] == [1601] + [1] * 15
    assert [p.tokens for p in prefill_step(8192, 4, 16, 16, 2048, rng).pieces] == [2045] * 4 + [1] * 12
    with pytest.raises(ValueError):
        prefill_step(3, 3, 4, 4, 32, rng)  # four requests cannot share three tokens
    with pytest.raises(ValueError):
        prefill_step(16, 3, 4, 2, 32, rng)  # three adapters in two requests
    with pytest.raises(ValueError):
        prefill_step(100, 1, 4, 2, 32, rng)  # two chunks of at most 32 cannot hold 100 tokens


def test_prefill_points_are_planned_and_size_the_model():
    spec = spec_of(max_loras="2", concurrency="1,2", prefill_tokens="40,16", context_len="32", strategy="max")
    assert spec.prefill_tokens == [16, 40]
    assert spec.max_cudagraph_capture_size == 4 and spec.mixed_sizes == [1, 2, 4]  # vLLM's: min(2 x 2, 512, 8192)
    (job,) = plan(spec)
    prefill = [p for p in job.points if p.mode == PREFILL]
    assert [(p.prefill_tokens, p.n_active, p.concurrency) for p in prefill] == [  # every n at T: the same chunks
        (16, 0, 2), (16, 1, 2), (16, 2, 2), (40, 0, 2), (40, 1, 2), (40, 2, 2)]
    assert job.max_tokens == 40 and job.mixed_sizes == (1, 2, 4)
    assert job.cache_rows == 2 + 2 + 1 + 2  # decode rows, then the check's mixed rows
    assert spec_of(concurrency="8").max_cudagraph_capture_size == 0  # no prefill points: no PIECEWISE set
    given = spec_of(prefill_tokens="64", mixed_capture_sizes="32,8")
    assert given.mixed_sizes == [8, 32] and given.max_cudagraph_capture_size == 32


def test_beside_a_serving_run_prefill_points_stop_at_its_clients():
    """A serving run's steps hold at most its clients' requests, so at most that many adapters: its
    prefill points (which price the loop's mixed steps) need no larger n."""
    spec = spec_of(max_loras="8", concurrency="4", adapters="16", input_tokens="12", output_tokens="4",
                   prefill_tokens="16", context_len="32", strategy="max")
    (job,) = plan(spec)
    assert [p.n_active for p in job.points if p.mode == PREFILL] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("flags,says", [
    ({"prefill_tokens": "9000"}, "--max-num-batched-tokens 8192"),
    ({"prefill_tokens": "64", "max_num_batched_tokens": "32"}, "--max-num-batched-tokens 32"),
    ({"max_cudagraph_capture_size": "600"}, "at most 512"),
    ({"prefill_tokens": "64", "model": "tiny-moe"}, "dense models only"),
    ({"mixed_capture_sizes": "8,600"}, "at most 512 tokens per graph"),
    ({"mixed_capture_sizes": "8,32", "max_cudagraph_capture_size": "64"}, "give one"),
])
def test_bad_prefill_settings_get_one_line(flags, says):
    with pytest.raises(UserError, match=says):
        spec_of(**flags)


def test_a_prefill_sweep_writes_checked_rows(tmp_path, capsys):
    code = main(["sweep", "--out", str(tmp_path), "--device", "cpu", "--max-loras", "2", "--concurrency", "1,2",
                 "--strategy", "max,pow2", "--prefill-tokens", "16,40", "--max-cudagraph-capture-size", "16",
                 "--context-len", "32", "--iters", "4", "--warmup", "1", "--workload", "uniform"])
    assert code == 0
    (run,) = tmp_path.glob("*/points.parquet")
    df = pd.read_parquet(run)
    assert (df.status == "ok").all()
    pre = df[df["mode"] == PREFILL]
    assert len(pre) == 2 * 6 and set(pre.prefill_tokens) == {16, 40}
    assert set(pre[pre.prefill_tokens == 16].mixed_route) == {"piecewise"}
    assert set(pre[pre.prefill_tokens == 40].mixed_route) == {"eager"}  # past the largest PIECEWISE size
    assert (pre.tokens_per_s > 0).all() and (pre.graph_tokens == pre.prefill_tokens).all()
    assert (df.mixed_capture_sizes.map(list) == pd.Series([[1, 2, 4, 8, 16]] * len(df))).all()
    assert (df.num_mixed_graphs > 0).all() and (df.mixed_capture_s > 0).all() and df.correct.all()
    checks = json.loads((run.parent / "checks.json").read_text())
    assert all(c["correct"] and c["mixed_graphs_checked"] == c["mixed_graphs_total"] > 0 for c in checks)
    assert (pre.lora_io_bytes_per_token > 0).all()
    assert main(["report", str(run.parent)]) == 0
    md = (run.parent / "report.md").read_text()
    section = md.split("## Prefill steps: LoRA overhead by prompt tokens")[1].split("\n## ")[0]
    assert "overhead_vs_tokens.png" in section and section.count("| 40 | 2 |") == 2  # one row per strategy
    assert (run.parent / "overhead_vs_tokens.png").stat().st_size > 0
    # the recommendation counts the PIECEWISE graphs beside the FULL ones, chosen and max alike
    rec = md.split("## Recommendation")[1].split("\n## ")[0]
    assert rec.count("PIECEWISE graphs") >= 2 and "for max)" in rec
    (entry, *_) = json.loads((run.parent / "recommendation.json").read_text())["recommendations"]
    by_strategy = df.drop_duplicates("strategy").set_index("strategy").num_mixed_graphs
    assert entry["num_mixed_graphs"] == by_strategy[entry["strategy"]] and entry["num_mixed_graphs_max"] == by_strategy["max"]
    assert entry["mixed_capture_s"] > 0 and "mixed_graph_mem_bytes" in entry  # the memory: a GPU's (null here)
    capsys.readouterr()
    assert main(["recommend", str(run.parent), "--workload", "uniform"]) == 0  # strategy auto says what it leaves out
    out = " ".join(capsys.readouterr().out.split())
    assert "nor in the budgets: the mixed steps' PIECEWISE graphs" in out


def prefill_rows(kernels, speed, first_point):
    """Prefill rows of one backend at T = 128, 2048 and n = 0, 1: step = base + speed x n x T / 1000."""
    rows = []
    for i, (t, n) in enumerate([(128, 0), (128, 1), (2048, 0), (2048, 1)]):
        rows.append({"status": "ok", "mode": PREFILL, "kernels": kernels, "max_loras": 4, "strategy": "max",
                     "prefill_tokens": t, "n_active": n, "concurrency": 1, "point": first_point + i,
                     "step_ms_median": t / 100 + speed * n * t / 1000, "lora_bytes_per_slot": 2e6,
                     "lora_io_bytes_per_token": 1e5, "probe_copy_gbs": 4000.0, "probe_kernel_us": 1.5, "layers": 2})
    return rows


def test_prefill_overhead_is_against_the_same_tokens_without_adapters_and_its_floor():
    import numpy as np

    from lorabench.analysis.prefill import overhead_ratio, prefill_overhead
    from lorabench.stats import Resampler

    df = pd.DataFrame(prefill_rows("triton", 1.0, 0) + prefill_rows("vllm", 4.0, 4))
    pre = prefill_overhead(df).set_index(["kernels", "prefill_tokens", "n_active"])
    r = pre.loc[("triton", 2048, 1)]
    assert r.base_ms == pytest.approx(20.48) and r.overhead_ms == pytest.approx(2.048)
    assert r.overhead_pct == pytest.approx(10.0)
    floor = (2e6 + 2048 * 1e5) / 4000e9 * 1e3 + 4 * 2 * 1.5e-3  # bytes over the bandwidth, one kernel per LoRA linear
    assert r.floor_ms == pytest.approx(floor) and r.x_floor == pytest.approx(2.048 / floor)
    assert np.isnan(pre.loc[("triton", 2048, 0)].floor_ms)  # no LoRA, no floor
    faster = prefill_overhead(df.assign(probe_rmw_gbs=8000.0)).set_index(["kernels", "prefill_tokens", "n_active"])
    assert faster.loc[("triton", 2048, 1)].floor_ms == pytest.approx((2e6 + 2048 * 1e5) / 8000e9 * 1e3 + 4 * 2 * 1.5e-3)
    slower = prefill_overhead(df.assign(probe_rmw_gbs=1000.0)).set_index(["kernels", "prefill_tokens", "n_active"])
    assert slower.loc[("triton", 2048, 1)].floor_ms == pytest.approx(floor)  # the faster of copy and add prices bytes
    rng = np.random.default_rng(0)
    samples = Resampler({int(p.point): p.step_ms_median * (1 + 0.001 * rng.standard_normal(50))
                         for p in df.itertuples()})
    ratio, iv = overhead_ratio(samples, pre.loc[("triton", 2048, 1)], pre.loc[("vllm", 2048, 1)])
    assert ratio == pytest.approx(0.25) and iv[0] < 0.25 < iv[1]
    assert overhead_ratio(None, pre.loc[("triton", 128, 1)], pre.loc[("vllm", 128, 1)]) == (pytest.approx(0.25), None)


def test_the_prefill_section_says_whose_floor_an_extending_backend_goes_under():
    """A backend that runs prompt steps with the expand inside the GEMM's K (``Backend.extends_k``:
    ``gemm``) gets a line saying the floor is the pair's design; the pair does not."""
    from lorabench.analysis.prefill import prefill_overhead
    from lorabench.commands.report.prefill import prefill_md

    df = pd.DataFrame(prefill_rows("triton", 1.0, 0) + prefill_rows("gemm", 0.5, 4))
    pre = prefill_overhead(df.assign(context_len=2048, mixed_route="eager"))
    md = "\n".join(prefill_md(pre, "GPU ms", None))
    gemm, triton = md.split("**gemm, max_loras")[1], md.split("**triton, max_loras")[1].split("**gemm")[0]
    assert "`gemm` runs a prompt step's linears" in gemm and "the floor above is the pair's design" in gemm
    assert "runs a prompt step's linears" not in triton
