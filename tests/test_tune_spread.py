"""A tune spread over GPUs (``lorabench tune --gpus 0,1``, ``--executor dask``): the shapes are dealt
out to one worker per GPU, every measurement comes back to the one process that writes the folder,
the tables and vLLM's files are written once and a rerun resumes; GPUs of different models are
refused. GPUs are faked (two workers on this machine, each pinned to a fake GPU's UUID); the real
thing needs a host with two GPUs."""

import json
import os
from pathlib import Path

import pytest
from conftest import HAS_CUDA

import lorabench.commands.tune as tune_command
from lorabench.cli import main
from lorabench.commands.tune.spread import deal, one_model
from lorabench.errors import UserError
from lorabench.runtime.executors import LocalExecutor
from lorabench.runtime.gpus import Device

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="fakes two GPUs on a machine without one (the GPU machine tunes for real)")
FAKE = [Device(0, "GPU-aaaa", "NVIDIA H200"), Device(1, "GPU-bbbb", "NVIDIA H200")]
TUNE = ["tune", "--model", "tiny", "--kernels", "fused", "--tokens", "1,2", "--max-loras", "2", "--budget-s", "0.01",
        "--dtype", "float16", "--device", "cpu"]


@pytest.fixture
def two_gpus(monkeypatch):
    made = []

    def make(kind, gpus_text, scheduler, device):
        made.append((kind, gpus_text))
        return LocalExecutor(list(FAKE))

    monkeypatch.setattr(tune_command, "make_executor", make)
    return made


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "cache.jsonl").read_text().splitlines()]


def test_shapes_are_dealt_round_robin_and_none_is_empty():
    assert deal(list(range(5)), 2) == [[0, 2, 4], [1, 3]]
    assert deal([1], 4) == [[1]]


def test_a_tune_spreads_its_shapes_over_two_gpus_and_one_process_writes_the_folder(tmp_path, two_gpus, capsys):
    out = tmp_path / "tuned"
    assert main([*TUNE, "--out", str(out), "--gpus", "0,1"]) == 0
    assert two_gpus and "on local: " in capsys.readouterr().out
    found = rows(out)
    shapes = {}
    for r in found:
        shapes.setdefault((r["kernel"], r["op"], tuple(r["shape"])), set()).add(r["where"].split()[-1])
    assert len(shapes) == 12  # as one process tunes them (test_tune's first test)
    assert all(len(w) == 1 for w in shapes.values())  # each shape on one GPU
    assert {w for ws in shapes.values() for w in ws} == {"GPU-aaaa", "GPU-bbbb"}
    assert all(r["default"] for rs in [[r for r in found if (r["kernel"], r["op"], tuple(r["shape"])) == k][:1]
                                       for k in shapes] for r in rs)
    table = json.loads((out / "lorabench_tuned.json").read_text())
    assert len(table["entries"]) == 12 and (out / "tune.md").is_file()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("tune-worker")) == ["tune-worker-0.log", "tune-worker-1.log"]
    before = len(found)
    assert main([*TUNE, "--out", str(out), "--gpus", "0,1"]) == 0  # resumes: every shape's budget is spent
    assert len(rows(out)) == before


def test_workers_on_gpus_of_different_models_are_refused():
    one_model({-1: "NVIDIA H200", 0: "NVIDIA H200", 1: None})
    with pytest.raises(UserError, match=r"different models \(NVIDIA H100 80GB HBM3, NVIDIA H200\)"):
        one_model({-1: "NVIDIA H200", 0: "NVIDIA H200", 1: "NVIDIA H100 80GB HBM3"})


def test_tune_executor_flags_are_checked_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "tuned"
    assert main([*TUNE, "--out", str(out), "--executor", "nope"]) == 2
    assert main([*TUNE, "--out", str(out), "--scheduler", "tcp://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: --executor nope: choose local or dask", "error: --scheduler goes with --executor dask"]
    assert not out.exists()


def test_a_tune_with_one_gpu_of_this_host_runs_in_this_process(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tune_command, "make_executor", lambda *a: LocalExecutor([FAKE[0]]))
    out = tmp_path / "tuned"
    assert main([*TUNE, "--out", str(out), "--gpus", "0"]) == 0
    assert "on local" not in capsys.readouterr().out
    assert all("where" not in r for r in rows(out)) and not list(out.glob("tune-worker-*.log"))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Dask's LocalCluster")
def test_a_tune_on_a_dask_cluster(tmp_path, monkeypatch, capsys):
    distributed = pytest.importorskip("distributed")
    from lorabench.runtime import executors

    local = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, resources={"GPU": 1},
                                     dashboard_address=None)
    try:
        monkeypatch.setattr(tune_command, "make_executor",
                            lambda kind, g, s, d: executors.DaskExecutor(local.scheduler_address))
        out = tmp_path / "tuned"
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])))
        assert main([*TUNE, "--out", str(out), "--executor", "dask"]) == 0
        assert "on dask: " in capsys.readouterr().out
        found = rows(out)
        assert len({(r["kernel"], r["op"], tuple(r["shape"])) for r in found}) == 12
        assert len(json.loads((out / "lorabench_tuned.json").read_text())["entries"]) == 12
    finally:
        local.close()
