"""``lorabench tune``: the search, pruning, the resumable cache, and the files lorabench and vLLM
read. On the CPU the kernels run in Triton's interpreter, on the tiny preset with a tiny budget."""

import json
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from conftest import DEVICE, HAS_CUDA
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
GPU = torch.cuda.get_device_name() if HAS_CUDA else None
needs_vllm = pytest.mark.skipif(not vllm_lora.available(), reason=vllm_lora.INSTALL_HINT)


def run_tune(tmp_path, *extra):
    args = ["tune", "--model", "tiny", "--kernels", "fused", "--tokens", "1,2", "--max-loras", "2",
            "--budget-s", "0.01", "--out", str(tmp_path), "--dtype", "float16"]
    return main(args + list(extra))


def cache_rows(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "cache.jsonl").read_text().splitlines()]


def by_shape(rows) -> dict:
    shapes: dict = {}
    for r in rows:
        shapes.setdefault((r["kernel"], r["op"], tuple(r["shape"])), []).append(r)
    return shapes


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


def test_a_rerun_resumes_from_the_cache(tmp_path):
    assert run_tune(tmp_path) == 0
    before = cache_rows(tmp_path)
    (tmp_path / "tune.md").unlink()
    assert run_tune(tmp_path) == 0
    assert cache_rows(tmp_path) == before, "every shape's budget was spent: nothing new is measured"
    assert (tmp_path / "tune.md").is_file(), "the outputs are rewritten all the same"
    assert run_tune(tmp_path, "--fresh") == 0
    assert len(cache_rows(tmp_path)) == len(before) and (tmp_path / "cache.jsonl.prev").is_file()
    assert {r["session"] for r in cache_rows(tmp_path)}.isdisjoint(r["session"] for r in before)


def test_timings_of_other_kernel_sources_are_not_reused(tmp_path):
    """A cache written by other versions of lorabench's kernels (another ``kernels_rev``) is kept in
    the file but not resumed from: every shape is timed again. vLLM's rows carry no revision."""
    assert run_tune(tmp_path) == 0
    before = cache_rows(tmp_path)
    rev = TUNERS["fused"]().revision
    assert {r["kernels_rev"] for r in before} == {rev}
    (tmp_path / "cache.jsonl").write_text("".join(json.dumps({**r, "kernels_rev": "0ld"}) + "\n" for r in before))
    assert run_tune(tmp_path) == 0
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
    (["--tokens", "1024"], "--tokens"),
    (["--max-loras", "0"], "--max-loras"),
    (["--budget-s", "-1"], "--budget-s"),
    (["--budget-s", "soon"], "--budget-s"),
    (["--rank", "12"], "--rank"),
    (["--dtype", "float8"], "--dtype"),
    (["--model", "gpt-5"], "--model"),
    (["--device", "tpu"], "--device"),
    (["--kernels", "vllm", "--dtype", "float32"], "float16"),
]


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
    assert main(["sweep", "--kernels", "fused", "--tuned", str(tuned), "--strategy", "max", "--max-loras", "2",
                 "--concurrency", "1,2", "--iters", "2", "--warmup", "1", "--out", str(out),
                 "--model", "tiny", "--dtype", DTYPE]) == 0
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


def test_triton_shrink_and_expand_are_tuned_and_swept(tmp_path):
    """lorabench's unfused pair: each op tuned per shape, its entries loaded by triton_lora, and a
    sweep runs triton+tuned next to triton, correct."""
    import pandas as pd
    from lorabench.kernels import triton_lora

    out = tmp_path / "tuned"
    assert main(["tune", "--model", "tiny", "--kernels", "triton", "--tokens", "1", "--max-loras", "1",
                 "--budget-s", "2", "--out", str(out), "--dtype", DTYPE]) == 0
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
    assert main(["sweep", "--kernels", "triton", "--tuned", str(out), "--strategy", "max", "--max-loras", "1",
                 "--concurrency", "1", "--iters", "2", "--warmup", "1", "--out", str(runs), "--model", "tiny"]) == 0
    df = pd.read_parquet(next(runs.glob("*/points.parquet")))
    assert set(df.kernels) == {"triton", "triton+tuned"} and (df.status == "ok").all() and df.correct.all()
