"""Where a sweep's worker groups run (``--executor local|dask``): the grouping rule (what is
compared runs on one GPU), the local executor's pinning (each worker on its GPU by UUID with its own
Triton cache, one group per GPU at a time: GPUs faked), and the Dask executor against a
LocalCluster of two processes with a fake ``GPU`` resource each: a real CPU sweep, a killed Dask
worker, Ctrl-C, and --resume. Stand-in workers (tests/stub_worker.py) where the sweep around the
worker is under test."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from lorabench.cli import main
from lorabench.commands import sweep as sweep_module
from lorabench.config.flags import Machine
from lorabench.config.plan import group_key, groups, plan, point_groups
from lorabench.config.spec import build_spec
from lorabench.runtime import gpus
from lorabench.runtime.executors import LocalExecutor
from lorabench.runtime.gpus import Device
from lorabench.storage.results import read_points
from lorabench.storage.runs import FINISHED, INTERRUPTED, coverage

TESTS = Path(__file__).parent
pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds worker processes through /proc")
STUB = "stub_worker"
SMALL = ["--concurrency", "1", "--layers", "1", "--iters", "2", "--warmup", "1", "--device", "cpu", "--strategy", "max,pow2"]
FAKE = [Device(0, "GPU-aaaa", "NVIDIA H200"), Device(1, "GPU-bbbb", "NVIDIA H200")]
LAUNCH = ("import sys; from lorabench.commands import sweep; sweep.WORKER = sys.argv.pop(1); "
          "from lorabench.cli import main; sys.exit(main(sys.argv[1:]))")


@pytest.fixture(autouse=True)
def stub_env(monkeypatch):
    monkeypatch.setenv("LORABENCH_GIT_SHA", "tests-of-executors")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))


def run_dir(out: Path) -> Path | None:
    runs = list(out.glob("*/run.json"))
    return runs[0].parent if runs else None


def children(pid: int) -> list[int]:
    """Child processes of ``pid``, started by any of its threads."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def workers(pid: int) -> list[int]:
    """The lorabench workers among ``pid``'s children (not, say, the resource tracker a Dask
    LocalCluster started earlier in this process leaves behind)."""
    out = []
    for c in children(pid):
        try:
            if b"lorabench.runtime.lifeline" in Path(f"/proc/{c}/cmdline").read_bytes():
                out.append(c)
        except OSError:
            pass
    return out


def wait_for(condition, what: str, proc: subprocess.Popen | None = None, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the sweep ended (status {proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_groups_keep_what_is_compared_together():
    """Every strategy of one (kernels, max_loras) is in one group (one worker, one GPU); no group
    holds two (kernels, max_loras); a point's part file is its group's."""
    spec, _ = build_spec({"kernels": "torch,triton", "max_loras": "2,4", "strategy": "max,pow2,dense", "concurrency": "1,2",
                          "device": "cpu"}, None, Machine(cuda=False))
    jobs = plan(spec)
    found = groups(list(enumerate(jobs)))
    assert len(found) == 4
    for members in found:
        assert len({group_key(job) for _, job in members}) == 1
        assert {job.strategy for _, job in members} == {"max", "pow2", "dense"}
    parts = point_groups(jobs)
    for g, members in enumerate(found):
        assert {parts[p.index] for _, job in members for p in job.points} == {g}


@pytest.mark.e2e
def test_local_executor_pins_each_group_to_one_gpu(tmp_path, monkeypatch):
    """Four groups over two (fake) GPUs: each worker gets its GPU's UUID in CUDA_VISIBLE_DEVICES
    and that GPU's own Triton cache, every row of a group names one GPU, both GPUs work, at most
    one group per GPU at a time, and the rows are one part file per group read back as a dataset."""
    monkeypatch.setattr(sweep_module, "WORKER", STUB)
    monkeypatch.setenv("STUB_SLOW", "0.2")
    monkeypatch.setattr(gpus, "visible", lambda: FAKE)
    monkeypatch.setattr(sweep_module.Placement, "executor_for", lambda self, device: LocalExecutor(gpus.select(self.gpus, FAKE)))
    result, most = [], 0
    sweep = threading.Thread(target=lambda: result.append(main(["sweep", *SMALL, "--max-loras", "1,2,3,4", "--gpus", "0,1",
                                                                 "--out", str(tmp_path)])))
    sweep.start()
    while sweep.is_alive():
        most = max(most, len(workers(os.getpid())))
        time.sleep(0.02)
    assert result == [0] and most == 2  # never more workers at once than GPUs
    run = run_dir(tmp_path)
    df = read_points(run)
    assert (df.status == "ok").all() and len(df) == 4 * 2 * 3
    by_group = df.groupby(["kernels", "max_loras"]).gpu_uuid.unique()
    assert all(len(u) == 1 for u in by_group) and set(df.gpu_uuid) == {"GPU-aaaa", "GPU-bbbb"}
    for uuid, rows in df.groupby("gpu_uuid"):
        assert set(rows.triton_cache) == {gpus.triton_cache(next(d for d in FAKE if d.uuid == uuid))}
    assert df.host.notna().all()
    parts = sorted(p.name for p in (run / "points.parquet").iterdir())
    assert parts == [f"part-{g:04d}.parquet" for g in range(4)]
    assert ds.dataset(run / "points.parquet").count_rows() == len(df)
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == FINISHED and "GPU-aaaa" in info["executor"] and "GPU-bbbb" in info["executor"]


# -- Dask ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    """Two Dask worker processes with one (fake) GPU each, as `dask worker --resources GPU=1
    --nworkers 2` starts them; a task whose worker is lost runs once more elsewhere."""
    distributed = pytest.importorskip("distributed")
    import dask

    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "STUB_SLOW", "LORABENCH_GIT_SHA")}
    os.environ.update(PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), saved["PYTHONPATH"]])), STUB_SLOW="0.3",
                      LORABENCH_GIT_SHA="tests-of-executors")  # the Dask workers' environment, set as they start
    with dask.config.set({"distributed.scheduler.allowed-failures": 1}):
        local = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, resources={"GPU": 1},
                                         dashboard_address=None)
    client = distributed.Client(local)
    yield local, client
    client.close()
    local.close()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def dask_args(cluster) -> list[str]:
    return ["--executor", "dask", "--scheduler", cluster[0].scheduler_address]


@pytest.mark.e2e
def test_dask_runs_a_real_cpu_sweep(tmp_path, cluster):
    """The real worker on the Dask workers: every point ok, one part per group, host and the
    executor recorded."""
    assert main(["sweep", *SMALL, "--max-loras", "1,2", *dask_args(cluster), "--out", str(tmp_path)]) == 0
    run = run_dir(tmp_path)
    df = read_points(run)
    assert (df.status == "ok").all() and len(df) == 2 * 2 * 3 and df.step_ms_median.gt(0).all()
    assert df.host.notna().all() and df.git_sha.eq("tests-of-executors").all()
    assert len(list((run / "points.parquet").glob("part-*.parquet"))) == 2
    assert json.loads((run / "run.json").read_text())["executor"].startswith("dask: tcp://")


def start(out: Path, cluster, max_loras: str) -> subprocess.Popen:
    argv = [sys.executable, "-c", LAUNCH, STUB, "sweep", *SMALL, "--max-loras", max_loras, *dask_args(cluster),
            "--out", str(out)]
    return subprocess.Popen(argv, env={**os.environ}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def rows_written(out: Path) -> int:
    d = run_dir(out)
    path = d / "points.jsonl" if d else None
    return len(path.read_text().splitlines()) if path and path.is_file() else 0


def busy_workers(client) -> dict[str, int]:
    """Dask worker address -> its pid, for the workers running a lorabench worker now."""
    pids = client.run(os.getpid)
    return {addr: pid for addr, pid in pids.items() if children(pid)}


@pytest.mark.e2e
def test_a_killed_dask_worker_reruns_its_group_once_elsewhere(tmp_path, cluster):
    """SIGKILL to the Dask worker running a group (its lorabench worker goes with it): the group
    runs again, whole, on a worker still there, the sweep says so and ends with every point ok."""
    _, client = cluster
    proc = start(tmp_path, cluster, "1,2")
    wait_for(lambda: rows_written(tmp_path) >= 1 and busy_workers(client), "a first row", proc)
    addr, pid = next(iter(busy_workers(client).items()))
    os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "its Dask worker was lost; its group runs again, whole" in out.replace("\n", " ")
    df = read_points(run_dir(tmp_path))
    assert len(df) == 2 * 2 * 3 and (df.status == "ok").all()
    assert coverage(run_dir(tmp_path)).complete


@pytest.mark.e2e
def test_ctrl_c_cancels_every_dask_task_and_keeps_finished_rows_then_resume(tmp_path, cluster, monkeypatch):
    """SIGINT to the sweep: exit 130, the run says interrupted, its finished rows stay, no
    lorabench worker is left on the Dask workers; --resume with the Dask executor finishes it."""
    _, client = cluster
    wait_for(lambda: len(client.scheduler_info()["workers"]) == 2, "two Dask workers")
    proc = start(tmp_path, cluster, "1,2,3")
    wait_for(lambda: rows_written(tmp_path) >= 2, "two rows", proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    run = run_dir(tmp_path)
    cov = coverage(run)
    assert cov.status == INTERRUPTED and 2 <= cov.finished < 18
    assert (read_points(run).status == "ok").all()
    wait_for(lambda: not busy_workers(client), "the Dask workers' lorabench workers to be gone", timeout=20)
    wait_for(lambda: not any(client.processing().values()), "no task left on the Dask workers", timeout=20)
    monkeypatch.setattr(sweep_module, "WORKER", STUB)
    assert main(["sweep", "--resume", str(run), *dask_args(cluster)]) == 0
    df = read_points(run)
    assert len(df) == 18 and (df.status == "ok").all() and coverage(run).complete
