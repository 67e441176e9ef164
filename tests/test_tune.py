"""``lorabench tune``: the search, pruning, the resumable cache, and the files lorabench and vLLM
read. On the CPU the kernels run in Triton's interpreter, on the tiny preset with a tiny budget."""

import json
import os
import pty
import re
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from conftest import DEVICE, HAS_CUDA, fault_injected
from lorabench.kernels import fused_lora, vllm_lora

import lorabench.commands.tune as tune_command
from lorabench.cli import main
from lorabench.commands.tune import search
from lorabench.commands.tune.backends import TUNERS
from lorabench.commands.tune.shapes import Shape
from lorabench.config.flags import Machine
from lorabench.config.tune_spec import build_tune_spec
from lorabench.storage import tune_files

DTYPE = "float16" if HAS_CUDA else "float32"  # what a sweep runs by default here
# The sweeps here check tuned configs, not the adapter-load timing every worker also does: on the CPU
# two loads each way (tests/faulty_worker.py), not 30 steps of interpreted Triton kernels each way.
FEW_LOADS = None if HAS_CUDA else "loads:2"
GPU = torch.cuda.get_device_name() if HAS_CUDA else None
needs_vllm = pytest.mark.skipif(not vllm_lora.available(), reason=vllm_lora.INSTALL_HINT)


def run_tune(tmp_path, *extra, tokens="1,2"):
    args = ["tune", "--model", "tiny", "--kernels", "fused", "--tokens", tokens, "--max-loras", "2",
            "--budget-s", "0.01", "--out", str(tmp_path), "--dtype", "float16"]
    return main(args + list(extra))


def cache_rows(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "cache.jsonl").read_text().splitlines()]


def by_shape(rows) -> dict:
    shapes: dict = {}
    for r in rows:
        shapes.setdefault((r["kernel"], r["op"], tuple(r["shape"])), []).append(r)
    return shapes


@pytest.mark.e2e
def test_each_shape_times_its_default_and_a_candidate(tmp_path):
    assert run_tune(tmp_path) == 0
    shapes = by_shape(cache_rows(tmp_path))
    # 4 linears x (1 token: launch 1; 2 tokens: launches 1 and 2)
    assert len(shapes) == 12 and {k[2][5] for k in shapes} == {1, 2}
    for rows in shapes.values():
        assert [r["default"] for r in rows].count(True) == 1 and rows[0]["default"]
        assert rows[0]["status"] == "ok" and len(rows) >= 2
        assert all(r["device"] == ("cuda" if HAS_CUDA else "cpu") and r["dtype"] == "float16" for r in rows)
        assert all(r["timing"] == ("cuda_graph" if HAS_CUDA else "cpu_wall") for r in rows if r["status"] == "ok")
    table = json.loads((tmp_path / "lorabench_tuned.json").read_text())
    assert table["device"] == ("cuda" if HAS_CUDA else "cpu") and len(table["entries"]) == 12
    for e in table["entries"]:
        assert e["default_us"] > 0 and e["tuned_us"] <= e["default_us"] and e["speedup"] >= 1.0
    md = (tmp_path / "tune.md").read_text()
    assert "## fused" in md and md.count("| qkv |") == 3
    assert HAS_CUDA or "not GPU results" in md


@pytest.mark.e2e
def test_a_rerun_resumes_from_the_cache(tmp_path):
    assert run_tune(tmp_path, tokens="1") == 0  # its 4 shapes (the 12 of two token counts: above)
    before = cache_rows(tmp_path)
    (tmp_path / "tune.md").unlink()
    assert run_tune(tmp_path, tokens="1") == 0
    assert cache_rows(tmp_path) == before, "every shape's budget was spent: nothing new is measured"
    assert (tmp_path / "tune.md").is_file(), "the outputs are rewritten all the same"
    assert run_tune(tmp_path, "--fresh", tokens="1") == 0
    assert len(cache_rows(tmp_path)) == len(before) and (tmp_path / "cache.jsonl.prev").is_file()
    assert {r["session"] for r in cache_rows(tmp_path)}.isdisjoint(r["session"] for r in before)


@pytest.mark.e2e
def test_timings_of_other_kernel_sources_are_not_reused(tmp_path):
    """A cache written by other versions of lorabench's kernels (another ``kernels_rev``) is kept in
    the file but not resumed from: every shape is timed again. vLLM's rows carry no revision."""
    assert run_tune(tmp_path, tokens="1") == 0
    before = cache_rows(tmp_path)
    rev = TUNERS["fused"]().revision
    assert {r["kernels_rev"] for r in before} == {rev}
    (tmp_path / "cache.jsonl").write_text("".join(json.dumps({**r, "kernels_rev": "0ld"}) + "\n" for r in before))
    assert run_tune(tmp_path, tokens="1") == 0
    after = cache_rows(tmp_path)
    assert after[: len(before)] == [{**r, "kernels_rev": "0ld"} for r in before]
    fresh = after[len(before):]
    assert by_shape(fresh).keys() == by_shape(before).keys() and all(r["kernels_rev"] == rev for r in fresh)
    cache = search.Cache(tmp_path / "other.jsonl", {}, False, {"fused": "abc"})
    cache.append({"kernel": "vllm", "op": "shrink", "shape": [1], "config": {}})
    assert cache.rows[0]["kernels_rev"] is None


@pytest.fixture
def rigged_fused(monkeypatch):
    """A four-config search space where split_k=2 raises, block_n=64 gives wrong sums and block_n=32
    runs correctly; the default's time is inflated so that the tuned config is not the default."""
    monkeypatch.setattr(fused_lora, "SEARCH_SPACE", {"block_m": [16], "block_n": [32, 64], "block_k": [64],
                                                     "split_k": [1, 2], "num_warps": [4], "num_stages": [2]})
    real_apply, real_measure = fused_lora.lora_apply, search.measure

    def apply(y, *args, config=None, **kw):
        if config.split_k == 2:
            raise RuntimeError("rigged: this config fails to compile")
        real_apply(y, *args, config=config, **kw)
        if config.block_n == 64:
            y.add_(1.0)

    def measure(backend, problem, cfg, *args):
        result, out = real_measure(backend, problem, cfg, *args)
        if cfg == backend.default(problem.shape) and result["status"] == "ok":
            result.update({k: result[k] + 1e6 for k in ("us", "p10_us", "p90_us")})
        return result, out

    monkeypatch.setattr(fused_lora, "lora_apply", apply)
    monkeypatch.setattr(search, "measure", measure)


@pytest.mark.e2e
def test_failing_and_wrong_configs_are_pruned_and_tuned_configs_load(tmp_path, rigged_fused, monkeypatch):
    shape = Shape("fused", "fused", "o", fused_lora.shape_key(1, 128, 128, 16, 1, 1), 128, (128,), 1, 1, 1)
    code = main(["tune", "--model", "tiny", "--kernels", "fused", "--tokens", "1", "--max-loras", "1",
                 "--budget-s", "100", "--out", str(tmp_path), "--dtype", "float16"])
    assert code == 0
    rows = by_shape(cache_rows(tmp_path))[("fused", "fused", shape.key)]
    status = Counter((r["config"]["block_n"], r["config"]["split_k"], r["status"]) for r in rows if not r["default"])
    assert status == {(32, 1, "ok"): 1, (64, 1, "wrong"): 1, (32, 2, "pruned"): 1, (64, 2, "pruned"): 1}
    assert all("rigged" in r["error"] for r in rows if r["status"] == "pruned")
    entries = tune_files.tuned_table(tmp_path)
    try:
        fused_lora.load_tuned(entries)
        e = next(e for e in entries if tuple(e["shape"]) == shape.key)
        assert e["config"]["block_n"] == 32 and e["speedup"] > 1
        assert fused_lora.config_for(*shape.key) == fused_lora.FusedConfig(**e["config"])
        assert fused_lora.config_for(*shape.key) != fused_lora.default_config(*shape.key)
    finally:
        fused_lora.load_tuned([])


BAD = [
    (["--kernels", "cutlass"], "--kernels"),
    (["--kernels", "torch"], "--kernels"),
    (["--tokens", "0"], "--tokens"),
    (["--tokens", "1,x"], "--tokens"),
    (["--tokens", "20000"], "--tokens"),
    (["--max-loras", "0"], "--max-loras"),
    (["--budget-s", "-1"], "--budget-s"),
    (["--budget-s", "soon"], "--budget-s"),
    (["--rank", "12"], "--rank"),
    (["--dtype", "float8"], "--dtype"),
    (["--model", "gpt-5"], "--model"),
    (["--device", "tpu"], "--device"),
    (["--kernels", "vllm", "--dtype", "float32"], "float16"),
    (["--model", "qwen2.5-7b", "--tp", "8"], "--tp 8: qwen2.5-7b's 28 attention heads"),
]


def test_a_tp_rank_is_tuned_at_its_own_shapes():
    """--tp: the shapes are one rank's (qkv's outputs and down's inputs a quarter at TP 4)."""
    from lorabench.commands.tune.backends import TritonPair
    from lorabench.commands.tune.shapes import build_shapes
    from lorabench.config.tune_spec import TuneSpec

    spec = TuneSpec(kernels=["triton"], model="llama-3.1-70b", rank=16, dtype="float16", max_loras=[4], tokens=[1],
                    budget_s=1, out="unused", device="cpu", tp=4)
    shapes = {s.linear: s for s in build_shapes(spec, {"triton": TritonPair()})}
    assert any(s.k == 28672 // 4 for s in shapes.values())  # down's inputs: the rank's intermediate features
    assert any(s.slices == (2048, 256, 256) for s in shapes.values())  # qkv: 16 heads, 2 KV heads of 128


@pytest.mark.parametrize("args,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line(capsys, tmp_path, args, needle):
    code = main(["tune", "--out", str(tmp_path / "out")] + args)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_vllm_without_vllm_says_how_to_get_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_lora, "_OPS", None)
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    code = main(["tune", "--kernels", "fused,vllm", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "lorabench[vllm]" in err[0]


def test_on_the_cpu_the_tune_runs_in_an_interpreter_child(tmp_path, monkeypatch):
    """Triton's interpreter must be on before triton is imported: the CLI reruns itself with it."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls = []
    monkeypatch.setattr(tune_command.subprocess, "run", lambda argv, env: calls.append((argv, env)) or SimpleNamespace(returncode=3))
    assert main(["tune", "--device", "cpu", "--tokens", "1", "--fresh", "--out", str(tmp_path)]) == 3
    (argv, env), = calls
    assert env["TRITON_INTERPRET"] == "1"
    assert argv[1:] == ["-m", "lorabench", "tune", "--tokens=1", f"--out={tmp_path}", "--device=cpu", "--fresh"]


def vllm_tuner(tmp_path):
    spec, _ = build_tune_spec({"kernels": "vllm", "model": "tiny", "tokens": "1,2", "max_loras": "2",
                               "budget_s": "1", "out": str(tmp_path)}, Machine(cuda=HAS_CUDA), vllm_available=lambda: True)
    from rich.console import Console

    return search.Tuner(spec, "test", Console(quiet=True))


@needs_vllm
def test_vllm_files_are_read_by_vllms_own_loader(tmp_path, monkeypatch):
    """vLLM's shrink is slow in the interpreter, so the cache rows here are synthetic; the files
    come from the writer a real tune uses, and vLLM's own get_lora_op_configs reads them."""
    from vllm.lora.ops.triton_ops import utils

    tuner = vllm_tuner(tmp_path)
    tuned = {}
    for shape in tuner.shapes:
        default = tuner.backends["vllm"].default(shape)
        best = {**default, "block_m": 16, "block_n": 32, "num_warps": 8}
        tuned[shape] = best
        for cfg, us in ((default, 10.0), (best, 5.0), ({**default, "block_m": 128}, 7.0)):
            tuner.cache.append({"kernel": "vllm", "op": shape.op, "linear": shape.linear, "shape": list(shape.key),
                                "config": cfg, "default": cfg is default, "status": "ok", "us": us, "p10_us": us,
                                "p90_us": us, "timing": "cpu_wall", "spent_s": 0.1, "session": "s"})
    tuner.write()
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tune_files.vllm_folder(tmp_path)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: tuner.meta["gpu"] or "CPU")  # "CPU": files of a CPU tune
    utils.load_lora_op_config.cache_clear()
    utils.get_lora_op_configs.cache_clear()
    try:
        for shape, best in tuned.items():
            max_loras, slices, m, k, n = shape.key
            if shape.op == "shrink":
                got = [utils.get_lora_op_configs("shrink", max_loras, m, k, n, slices)]
            else:
                got = [utils.get_lora_op_configs("expand", max_loras, m, n, k, slices, add_inputs=a) for a in (True, False)]
            assert all(g == best for g in got), (shape, got, best)
            assert "max_nreg" in best and "num_ctas" in best
    finally:
        utils.load_lora_op_config.cache_clear()
        utils.get_lora_op_configs.cache_clear()


@needs_vllm
def test_vllm_expand_candidates_reach_vllms_kernel(tmp_path):
    """The config under test is the one vLLM's expand runs: another tiling matches the default's
    output, and a config missing a key vLLM's op reads fails there and is pruned."""
    tuner = vllm_tuner(tmp_path)
    shape = next(s for s in tuner.shapes if s.op == "expand" and s.tokens == 2 and s.slices == (128,))
    backend = tuner.backends["vllm"]
    problem = backend.problem(shape, 16, torch.float16, tuner.spec.device, 0)
    default = backend.default(shape)
    timer = search.time_cuda if HAS_CUDA else search.time_cpu
    first, ref = search.measure(backend, problem, default, None, 1e-2, timer)
    assert first["status"] == "ok" and ref.abs().max() > 0
    good, _ = search.measure(backend, problem, {**default, "block_m": 16, "block_n": 32, "block_k": 16}, ref, 1e-2, timer)
    assert good["status"] == "ok", good
    missing = {k: v for k, v in default.items() if k != "num_ctas"}
    assert search.measure(backend, problem, missing, ref, 1e-2, timer)[0]["status"] == "pruned"


@pytest.mark.e2e
def test_a_sweep_given_tuned_runs_the_tuned_configs_next_to_the_defaults(tmp_path):
    """--tuned DIR adds fused+tuned beside fused, and its workers really run DIR's configs: here
    one that cannot launch (block_n 0) for the o linear, so fused+tuned fails and fused does not."""
    import pandas as pd

    tuned = tmp_path / "tuned"
    tuned.mkdir()
    bad = {**fused_lora.config_dict(fused_lora.FusedConfig()), "block_n": 0}
    meta = {"device": DEVICE, "gpu": GPU, "dtype": DTYPE}  # what the sweep below runs on this machine
    (tuned / "lorabench_tuned.json").write_text(json.dumps({**meta, "entries": [
        {"shape": list(fused_lora.shape_key(1, 128, 128, 16, 1, 1)), "config": bad}]}))  # tiny's o linear
    out = tmp_path / "runs"
    with fault_injected(FEW_LOADS):
        assert main(["sweep", "--kernels", "fused", "--tuned", str(tuned), "--strategy", "max", "--max-loras", "2",
                     "--concurrency", "1", "--iters", "2", "--warmup", "1", "--out", str(out),
                     "--model", "tiny", "--layers", "1", "--dtype", DTYPE]) == 0
    df = pd.read_parquet(next(out.glob("*/points.parquet")))
    assert set(df.kernels) == {"fused", "fused+tuned"}
    plain, tuned_rows = df[df.kernels == "fused"], df[df.kernels == "fused+tuned"]
    assert (plain.status == "ok").all() and plain.correct.all() and plain.tuned.isna().all()
    assert (tuned_rows.status == "failed").all() and tuned_rows.error.str.contains("ZeroDivisionError").all()
    assert tuned_rows.tuned.eq(str(tuned.resolve())).all()


def test_a_tune_folder_is_used_only_where_it_was_tuned(tmp_path, capsys):
    tuned = tmp_path / "tuned"
    tuned.mkdir()
    entry = {"shape": [1, 128, 128, 16, 1, 1], "config": fused_lora.config_dict(fused_lora.FusedConfig())}
    (tuned / "lorabench_tuned.json").write_text(json.dumps({"device": "cuda", "gpu": "NVIDIA H200", "dtype": "float16",
                                                            "entries": [entry]}))
    assert main(["sweep", "--kernels", "fused", "--tuned", str(tuned), "--device", "cpu", "--out", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tuned for device cuda" in err[0]
    (tuned / "lorabench_tuned.json").write_text("{not json")
    assert main(["sweep", "--kernels", "fused", "--tuned", str(tuned), "--out", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a lorabench tune file" in err[0]


def test_tune_into_a_file_is_one_line(tmp_path, capsys):
    target = tmp_path / "a-file"
    target.write_text("")
    assert main(["tune", "--model", "tiny", "--kernels", "fused", "--tokens", "1", "--max-loras", "1",
                 "--budget-s", "1", "--out", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0] and "Traceback" not in err[0]


@pytest.mark.parametrize("args,needle", [
    (["--tuned", "no/such/dir"], "not a folder"),
    (["--kernels", "fused+tuned"], "needs --tuned"),
    (["--kernels", "torch+tuned"], "unknown backend"),
])
def test_bad_tuned_sweeps_are_one_line(tmp_path, capsys, args, needle):
    assert main(["sweep", "--out", str(tmp_path / "runs")] + args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


@pytest.mark.e2e
def test_triton_shrink_and_expand_are_tuned_and_swept(tmp_path):
    """lorabench's unfused pair: each op tuned per shape, its entries loaded by triton_lora, and a
    sweep runs triton+tuned next to triton, correct."""
    import pandas as pd
    from lorabench.kernels import triton_lora

    out = tmp_path / "tuned"
    assert main(["tune", "--model", "tiny", "--kernels", "triton", "--tokens", "1", "--max-loras", "1",
                 "--budget-s", "0.01", "--out", str(out)]) == 0  # the tune's default dtype is the sweep's
    entries = tune_files.tuned_table(out)
    ops = sorted(e["shape"][0] for e in entries)
    assert ops == ["expand"] * 3 + ["shrink"] * 4 and all(e["kernel"] == "triton" for e in entries)  # o and down share an expand
    try:
        triton_lora.load_tuned(entries)
        for e in entries:
            assert triton_lora.config_for(*e["shape"]) == triton_lora.CONFIGS[e["shape"][0]](**e["config"])
    finally:
        triton_lora.load_tuned([])
    runs = tmp_path / "runs"
    with fault_injected(FEW_LOADS):
        assert main(["sweep", "--kernels", "triton", "--tuned", str(out), "--strategy", "max", "--max-loras", "1",
                     "--concurrency", "1", "--iters", "2", "--warmup", "1", "--out", str(runs), "--model", "tiny",
                     "--layers", "1"]) == 0
    df = pd.read_parquet(next(runs.glob("*/points.parquet")))
    assert set(df.kernels) == {"triton", "triton+tuned"} and (df.status == "ok").all() and df.correct.all()


IDENTITY = {"device": DEVICE, "gpu": GPU, "dtype": "float16", "timing": "cuda_graph" if HAS_CUDA else "cpu_wall",
            "launches_per_graph": search.LAUNCHES if HAS_CUDA else 1}  # what a float16 tune here keys its rows by


def cache_row(kernel, op, shape, config, us, default=False, **extra) -> dict:
    return {"kernel": kernel, "op": op, "linear": "o", "shape": list(shape), "config": config, "default": default,
            "status": "ok", "us": us, "p10_us": us, "p90_us": us, "spent_s": 0.1, "session": "s", **IDENTITY,
            "kernels_rev": None, **extra}


@pytest.fixture
def instant_measure(monkeypatch):
    """Every config runs at once and takes 1 us (the default 2 us): the search's files without
    running a kernel."""
    def measure(backend, problem, cfg, ref, tol, timer):
        us = 2.0 if cfg == backend.default(problem.shape) else 1.0
        return {"status": "ok", "us": us, "p10_us": us, "p90_us": us, "timing": IDENTITY["timing"]}, torch.zeros(1)

    monkeypatch.setattr(search, "measure", measure)


def test_a_tune_of_other_kernels_adds_to_the_folders_tables(tmp_path, instant_measure, capsys, monkeypatch):
    """A second tune with other --kernels into the same folder keeps what the first found: its
    tables come from every shape its cache.jsonl holds for this machine and dtype, whichever tune
    measured it. vLLM's rows are written here (its ops need vLLM); rows of another dtype stay out."""
    args = ["tune", "--model", "tiny", "--tokens", "1", "--max-loras", "1", "--budget-s", "0.01", "--out", str(tmp_path),
            "--dtype", "float16"]  # vLLM's ops take half precision only
    monkeypatch.setattr(sys, "argv", ["lorabench", *args, "--kernels", "fused"])  # what tune.md names the command by
    assert main(args + ["--kernels", "fused"]) == 0
    fused = tune_files.tuned_table(tmp_path)
    assert len(fused) == 4 and {e["kernel"] for e in fused} == {"fused"}
    default = {"block_m": 16, "block_n": 32, "block_k": 32, "split_k": 1, "num_warps": 4, "num_stages": 2}
    vllm_key, best = (2, 1, 1, 128, 16), {**default, "block_n": 16}
    with (tmp_path / "cache.jsonl").open("a") as f:
        for row in (cache_row("vllm", "shrink", vllm_key, default, 10.0, default=True), cache_row("vllm", "shrink", vllm_key, best, 5.0),
                    cache_row("fused", "fused", [1, 64, 64, 16, 1, 1], default, 3.0, default=True, dtype="bfloat16")):
            f.write(json.dumps(row) + "\n")
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["lorabench", *args, "--kernels", "triton"])
    assert main(args + ["--kernels", "triton"]) == 0
    out = capsys.readouterr().out
    entries = tune_files.tuned_table(tmp_path)
    assert Counter(e["kernel"] for e in entries) == {"fused": 4, "triton": 7}
    assert [e for e in entries if e["kernel"] == "fused"] == fused, "the first tune's entries, as they were"
    assert all(e["config"] != e.get("default_config") and e["speedup"] == 2.0 for e in entries)
    prefix = (GPU or "CPU").replace(" ", "_").replace("-", "_")
    shrink = json.loads((tune_files.vllm_folder(tmp_path) / f"{prefix}_SHRINK.json").read_text())
    assert shrink == {"2": {"1": {"1": {"128": {"16": best}}}}}
    md = (tmp_path / "tune.md").read_text()
    assert "## fused" in md and "## triton shrink" in md and "## vllm shrink" in md
    assert "- command: `lorabench tune " in md and md.count("--kernels triton`") == 1
    assert "also 5 shapes measured by earlier tunes into this folder" in md and md.count("--kernels fused`") == 1
    assert f"the tables leave out 1 timed on {DEVICE} {GPU + ' ' if GPU else ''}bfloat16" in out, "the rows left out are counted"
    assert f"sweep with them: lorabench sweep --kernels triton,fused,vllm --tuned {tmp_path} --max-loras 1 --concurrency 1" in out


GOOD = json.dumps(cache_row("fused", "fused", [1, 128, 128, 16, 1, 1], {"block_m": 16}, 1.0, default=True))
CORRUPT = [
    ("garbage", f"{GOOD}\nnot json at all\n{GOOD}\n", "line 2"),
    ("a line cut short, then more", f"{GOOD[:40]}\n{GOOD}\n", "line 1"),
    ("a JSON list", f"[1, 2]\n{GOOD}\n", "not an object"),
    ("a string for a number", GOOD.replace('"us": 1.0', '"us": "fast"') + "\n", "'us'"),
    ("no shape", json.dumps({k: v for k, v in json.loads(GOOD).items() if k != "shape"}) + "\n", "'shape'"),
    ("a nested shape", GOOD.replace("[1, 128, 128, 16, 1, 1]", "[[1], 128]") + "\n", "'shape'"),
]


@pytest.mark.parametrize("content,needle", [c[1:] for c in CORRUPT], ids=[c[0] for c in CORRUPT])
def test_a_corrupt_cache_is_one_line(tmp_path, capsys, content, needle):
    (tmp_path / "cache.jsonl").write_text(content)
    assert run_tune(tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "cache.jsonl" in err[0] and needle in err[0], err
    assert "--fresh" in err[0] and (tmp_path / "cache.jsonl").read_text() == content, "the file is left as it was"


def test_a_last_line_cut_short_by_an_interrupt_is_dropped(tmp_path, capsys, instant_measure):
    (tmp_path / "cache.jsonl").write_text(f"{GOOD}\n{GOOD[:-20]}")
    assert run_tune(tmp_path) == 0
    out = capsys.readouterr().out
    assert "dropped its last line, cut short (an interrupted tune); 1 measurements kept" in out
    rows = cache_rows(tmp_path)
    assert rows[0] == json.loads(GOOD) and len(rows) > 1, "the file goes on from its last whole line"


def in_a_terminal(argv: list[str], env: dict) -> str:
    """What ``argv`` shows in a terminal (a pseudo-terminal), escape codes stripped."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # every writer has closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=600) == 0, b"".join(chunks).decode(errors="replace")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))


@pytest.mark.e2e
def test_a_tune_shows_its_progress_and_the_sweep_it_prints_runs(tmp_path):
    """A terminal user sees a progress bar (shapes done / total, the current shape, elapsed), on
    the CPU drawn by the interpreter child; the sweep command the tune prints then takes its folder
    (on the CPU: float32, the CPU sweep's dtype)."""
    import pandas as pd

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # on the CPU: the CLI's own child
    out = tmp_path / "tuned"
    shown = in_a_terminal([sys.executable, "-m", "lorabench", "tune", "--kernels", "fused", "--tokens", "1", "--max-loras", "1",
                           "--budget-s", "0.01", "--out", str(out)], {**env, "COLUMNS": "200"})
    assert re.search(r"fused fused \w+ \[[0-9, ]+\]: \d+ timed", shown), shown
    assert re.search(r"4/4 \d:\d\d:\d\d", shown), shown
    [hint] = [line.strip() for line in shown.splitlines() if line.startswith("sweep with them: ")]
    argv = hint.removeprefix("sweep with them: lorabench ").split()
    assert argv[:5] == ["sweep", "--kernels", "fused", "--tuned", str(out)] and "--dtype" not in argv
    runs = tmp_path / "runs"
    with fault_injected(FEW_LOADS):
        assert main(argv + ["--strategy", "max", "--layers", "1", "--iters", "2", "--warmup", "1", "--out", str(runs)]) == 0
    df = pd.read_parquet(next(runs.glob("*/points.parquet")))
    assert set(df.kernels) == {"fused", "fused+tuned"} and (df.status == "ok").all() and df.correct.all()


@pytest.mark.e2e
def test_the_gemm_backend_tunes_its_gemm_per_tokens_k_and_n(tmp_path):
    """--kernels gemm times its GEMM per (tokens, K, N) (default first, then candidates) and writes
    entries that gemm_lora.load_tuned installs (gemm+tuned runs them)."""
    from lorabench.kernels import gemm_configs, gemm_lora  # noqa: F401

    assert main(["tune", "--model", "tiny", "--kernels", "gemm", "--tokens", "1", "--max-loras", "2",
                 "--budget-s", "0.01", "--out", str(tmp_path), "--dtype", "float16"]) == 0
    shapes = by_shape(cache_rows(tmp_path))
    assert {k[:2] for k in shapes} == {("gemm", "gemm")} and len(shapes) == 4  # qkv, o, gate_up, down
    for (_, _, key), rows in shapes.items():
        assert key[:2] == ("gemm", 1) and rows[0]["default"] and rows[0]["status"] == "ok" and len(rows) >= 2
        assert rows[0]["config"] == gemm_configs.config_dict(gemm_configs.default_config(*key[1:]))
    entries = tune_files.tuned_table(tmp_path)
    assert {e["kernel"] for e in entries} == {"gemm"} and len(entries) == 4
    try:
        gemm_lora.load_tuned(entries)
        for e in entries:
            assert gemm_configs.config_for(*e["shape"][1:]) == gemm_configs.GemmConfig(**e["config"])
    finally:
        gemm_lora.load_tuned([])
    assert "## gemm" in (tmp_path / "tune.md").read_text()


def test_prefill_sizes_are_tuned_and_taken_by_larger_steps():
    """--tokens reaches prefill sizes (up to --max-num-batched-tokens' bound); a step of more tokens
    than any tuned size takes the nearest one's config."""
    from lorabench.commands.tune.backends import TUNERS
    from lorabench.commands.tune.shapes import build_shapes
    from lorabench.kernels import lora_configs

    spec, _ = build_tune_spec({"kernels": "triton", "model": "tiny", "tokens": "512,8192", "max_loras": "2"},
                              Machine(cuda=False), vllm_available=lambda: False)
    assert spec.tokens == [512, 8192]
    shapes = build_shapes(spec, {"triton": TUNERS["triton"]()})
    assert {s.tokens for s in shapes} == {512, 8192}
    big = next(s for s in shapes if s.tokens == 8192 and s.op == "shrink")
    tuned = lora_configs.ShrinkConfig(64, 16, 64, 2)
    old = dict(lora_configs.TUNED_CONFIGS)
    try:
        lora_configs.TUNED_CONFIGS.clear()
        lora_configs.TUNED_CONFIGS[big.key] = tuned
        op, _, k, n, slices, launch = big.key
        assert lora_configs.config_for(op, 16384, k, n, slices, launch) == tuned
    finally:
        lora_configs.TUNED_CONFIGS.clear()
        lora_configs.TUNED_CONFIGS.update(old)


def test_the_gemm_tune_leaves_out_sizes_where_the_backend_runs_the_pair():
    """Above ``gemm_lora.GEMM_MAX_TOKENS`` the gemm backend runs cuBLAS and the pair: its GEMM is
    not tuned there, and a tuned size above it never serves a decode step."""
    from lorabench.commands.tune.backends import TUNERS
    from lorabench.commands.tune.shapes import build_shapes
    from lorabench.kernels import gemm_configs, gemm_lora  # noqa: F401

    spec, _ = build_tune_spec({"kernels": "gemm", "model": "tiny", "tokens": "8,512", "max_loras": "2"},
                              Machine(cuda=False), vllm_available=lambda: False)
    shapes = build_shapes(spec, {"gemm": TUNERS["gemm"]()})
    assert shapes and {s.tokens for s in shapes} == {8}
    old = dict(gemm_configs.TUNED_CONFIGS)
    try:
        gemm_configs.TUNED_CONFIGS.clear()
        k, n = 64, 96
        gemm_configs.TUNED_CONFIGS[gemm_configs.shape_key(512, k, n)] = gemm_configs.GemmConfig(128, 128, 64)
        assert gemm_configs.config_for(32, k, n) == gemm_configs.default_config(32, k, n)
    finally:
        gemm_configs.TUNED_CONFIGS.clear()
        gemm_configs.TUNED_CONFIGS.update(old)
