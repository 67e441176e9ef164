"""A sweep that ends early loses nothing and can be finished: the kill matrix (SIGINT, SIGTERM,
SIGKILL to the sweep's parent process or to its worker, early, in the middle and late), each
followed by ``lorabench sweep --resume``, which must end with the rows an uninterrupted run has.
The matrix runs the real sweep around stand-in workers (tests/stub_worker.py: the worker's
protocol and its lifeline, no torch, so a cell takes seconds); one cell runs the real worker end
to end. Then what --resume refuses, and what it measures again."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from lorabench.cli import main
from lorabench.storage.results import read_points
from lorabench.storage.runs import FINISHED, INTERRUPTED, KILLED, coverage
from lorabench.storage.samples import read_samples

TESTS = Path(__file__).parent
pytestmark = [pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds worker processes through /proc"),
              pytest.mark.e2e]

# One worker per max_loras (a worker times every strategy of one (kernels, max_loras)), each with
# strategy max: 3 points (c = 1: n = 0, 1 and the workload run); each point takes SLOW s more, so
# that a stage lasts long enough to be hit.
SMALL = ["--concurrency", "1", "--layers", "1", "--iters", "2", "--warmup", "1", "--device", "cpu"]
SLOW = 0.4
STUB, REAL = "stub_worker", "faulty_worker"  # REAL: the real worker, slowed (tests/faulty_worker.py)
LAUNCH = ("import sys; from lorabench.commands import sweep; sweep.WORKER = sys.argv.pop(1); "
          "from lorabench.cli import main; sys.exit(main(sys.argv[1:]))")
IDENTITY = ["point", "kernels", "max_loras", "strategy", "mode", "concurrency", "n_active", "workload"]


@pytest.fixture(autouse=True, scope="module")
def same_code():
    """One code version for the whole module, whatever is committed meanwhile: --resume compares it."""
    saved = os.environ.get("LORABENCH_GIT_SHA")
    os.environ["LORABENCH_GIT_SHA"] = "tests-of-resume"
    yield
    if saved is None:
        os.environ.pop("LORABENCH_GIT_SHA")
    else:
        os.environ["LORABENCH_GIT_SHA"] = saved


@pytest.fixture(autouse=True, scope="module")
def stub_workers():
    """In-process sweeps (the resumes, the uninterrupted runs) run the stand-in worker too."""
    from lorabench.commands import sweep

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sweep, "WORKER", STUB)
        mp.setenv("STUB_SLOW", "0")
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
        yield


def start(out: Path, max_loras: str, worker: str = STUB) -> subprocess.Popen:
    """A sweep in its own process (and session: a signal sent to it reaches it alone), whose
    workers take SLOW s more per point."""
    env = {**os.environ, "FAULT": f"slow:{SLOW}", "STUB_SLOW": str(SLOW),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    argv = [sys.executable, "-c", LAUNCH, worker, "sweep", *SMALL, "--max-loras", max_loras, "--strategy", "max",
            "--out", str(out)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,  # SIGINT handled as under a terminal, even when pytest
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # runs with it ignored


def run_dir(out: Path) -> Path:
    runs = list(out.glob("*/run.json"))
    return runs[0].parent if runs else None


def rows_written(out: Path) -> int:
    d = run_dir(out)
    path = d / "points.jsonl" if d else None
    return len(path.read_text().splitlines()) if path and path.is_file() else 0


def children(pid: int) -> list[int]:
    """The child processes of ``pid``, started by any of its threads (the executor's start workers)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the sweep ended (status {proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def worker_of(proc: subprocess.Popen, index: int, out: Path) -> int:
    """The pid of the sweep's worker number ``index`` once it runs."""
    wait_for(lambda: run_dir(out) and (run_dir(out) / f"worker-{index}.log").exists() and children(proc.pid),
             proc, f"worker {index}")
    return children(proc.pid)[0]


def identity(df: pd.DataFrame) -> set:
    return set(df[IDENTITY].astype(str).itertuples(index=False, name=None))


def resume(run: Path) -> int:
    return main(["sweep", "--resume", str(run)])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, stub_workers) -> dict[str, set]:
    """The rows a run with nothing killed has, per max_loras list (stand-in workers)."""
    out = {}
    for max_loras in ("1,2", "1,2,3"):
        root = tmp_path_factory.mktemp("whole")
        assert main(["sweep", *SMALL, "--max-loras", max_loras, "--strategy", "max", "--out", str(root)]) == 0
        df = read_points(run_dir(root))
        assert (df.status == "ok").all()
        out[max_loras] = identity(df)
    return out


STAGES = {"early": 0, "middle": 3, "late": 5}  # rows written when the parent is hit (of 6)
EXIT = {signal.SIGINT: 130, signal.SIGTERM: 128 + signal.SIGTERM, signal.SIGKILL: -signal.SIGKILL}


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_parent_killed_then_resumed(tmp_path, uninterrupted, sig, stage):
    """The sweep's own process is hit: the worker goes with it, every finished row stays readable,
    the run says interrupted (SIGINT, SIGTERM) or killed (SIGKILL), and --resume finishes it."""
    proc = start(tmp_path, "1,2")
    rows = STAGES[stage]
    worker = worker_of(proc, 0 if rows < 3 else 1, tmp_path)
    wait_for(lambda: rows_written(tmp_path) >= rows, proc, f"{rows} rows")
    os.kill(proc.pid, sig)
    assert proc.wait(timeout=60) == EXIT[sig], proc.stderr.read()
    if sig != signal.SIGKILL:
        err = proc.stderr.read()
        assert "Traceback" not in err and "interrupted" in err, err  # one line, not a traceback
    deadline = time.monotonic() + 30
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(worker), "the worker outlived its sweep"
    run = run_dir(tmp_path)
    cov = coverage(run)
    assert cov.status == (KILLED if sig == signal.SIGKILL else INTERRUPTED)
    logged = rows_written(tmp_path)  # the signal may land between a row's Parquet write and its log line
    assert cov.planned == 6 and logged >= rows and cov.finished in (logged, logged + 1)
    if cov.finished:
        kept = read_points(run)
        assert len(kept) == cov.finished and (kept.status == "ok").all()
    assert resume(run) == 0
    df = read_points(run)
    assert (df.status == "ok").all() and identity(df) == uninterrupted["1,2"]
    assert coverage(run).complete
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == FINISHED and info["resumes"][-1]["previous_status"] == cov.status


def test_ctrl_c_to_the_sweep_and_its_last_worker_interrupts_the_run(tmp_path, uninterrupted):
    """Ctrl-C reaches the terminal's whole process group: the last group's worker ends with its
    sweep at once, and the run still says interrupted (exit 130), not finished."""
    proc = start(tmp_path, "1,2")
    worker_of(proc, 1, tmp_path)
    wait_for(lambda: rows_written(tmp_path) >= STAGES["late"], proc, "5 rows")
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 130, proc.stderr.read()
    assert "Traceback" not in proc.stderr.read()
    run = run_dir(tmp_path)
    cov = coverage(run)
    assert cov.status == INTERRUPTED and cov.failed == 0  # the worker the signal ended left its points missing
    assert (read_points(run).status == "ok").all()
    assert resume(run) == 0 and identity(read_points(run)) == uninterrupted["1,2"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_workers_killed_early_middle_late_then_resumed(tmp_path, uninterrupted, sig):
    """Three workers, three hits: the first while it starts (no row yet), the second after its
    first point, the third before its last. The sweep goes on, each lost point becomes a failed
    row, and --resume measures exactly those again."""
    proc = start(tmp_path, "1,2,3")
    for index, rows in ((0, 0), (1, 4), (2, 8)):
        worker = worker_of(proc, index, tmp_path)
        wait_for(lambda rows=rows: rows_written(tmp_path) >= rows, proc, f"{rows} rows")  # noqa: B023
        os.kill(worker, sig)
        wait_for(lambda worker=worker: not alive(worker) or worker not in children(proc.pid), proc, "the worker's end")  # noqa: B023
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    run = run_dir(tmp_path)
    df = read_points(run)
    failed = df[df.status == "failed"]
    assert len(df) == 9 and set(failed.max_loras) == {1, 2, 3}
    assert failed.error.str.contains("worker exited with status").all()
    cov = coverage(run)
    assert cov.status == FINISHED and cov.finished == 9 and cov.failed == len(failed)
    assert resume(run) == 0
    again = read_points(run)
    assert (again.status == "ok").all() and identity(again) == uninterrupted["1,2,3"]
    kept = df[df.status == "ok"].set_index("point").step_ms_median
    assert again.set_index("point").step_ms_median.reindex(kept.index).equals(kept)  # finished rows untouched


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, stub_workers) -> Path:
    root = tmp_path_factory.mktemp("done")
    assert main(["sweep", *SMALL, "--max-loras", "2", "--strategy", "max", "--out", str(root)]) == 0
    return run_dir(root)


def test_real_worker_dies_with_its_sweep_and_the_run_resumes(tmp_path, monkeypatch):
    """End to end with the real worker: the sweep is SIGKILLed while its first worker still
    starts (imports torch); the worker is gone within a second or two, the run says killed, and
    --resume measures every point."""
    monkeypatch.setattr("lorabench.commands.sweep.WORKER", "lorabench.runtime.worker")
    proc = start(tmp_path, "2", worker=REAL)
    worker = worker_of(proc, 0, tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 3
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(worker), "the worker outlived its sweep"
    run = run_dir(tmp_path)
    assert coverage(run).status == KILLED and coverage(run).finished == 0
    assert resume(run) == 0
    df = read_points(run)
    info = json.loads((run / "run.json").read_text())
    planned = {(p["index"], j["strategy"]) for j in info["jobs"] for p in j["points"]}
    assert (df.status == "ok").all() and set(zip(df.point, df.strategy)) == planned
    assert df.git_sha.notna().all() and (df.device == "cpu").all() and df.step_ms_median.gt(0).all()
    assert read_samples(run).groupby("point").size().to_dict() == dict(zip(df.point, df.timed_steps))
    assert not list((run / "samples").glob("point-*.parquet")), "the finished run packs its samples"


def test_resume_of_a_finished_run_measures_nothing(finished_run, capsys):
    def parts():
        return {f.name: f.read_bytes() for f in (finished_run / "points.parquet").iterdir()}

    before = parts()
    assert resume(finished_run) == 0
    assert "nothing to measure" in capsys.readouterr().out
    assert parts() == before


@pytest.mark.parametrize("change, says", [
    ({"git_sha": "0" * 40}, "other code"),
    ({"torch": "0.0.1"}, "other torch"),
    ({"iters": 7}, "plans the run's spec differently"),
])
def test_resume_refuses_a_changed_run_unless_forced(finished_run, tmp_path, capsys, change, says):
    run = tmp_path / finished_run.name
    run.mkdir()
    shutil.copy(finished_run / "run.json", run / "run.json")
    shutil.copytree(finished_run / "points.parquet", run / "points.parquet")
    info = json.loads((run / "run.json").read_text())
    df = read_points(run)
    if "iters" in change:
        info["jobs"][0]["iters"] = change["iters"]
    else:
        key, value = next(iter(change.items()))
        df[key] = value
        shutil.rmtree(run / "points.parquet")  # one ok row of "other" code, the rest missing, in one file (an older run's)
        df.iloc[:1].to_parquet(run / "points.parquet")
    (run / "run.json").write_text(json.dumps(info))
    assert main(["sweep", "--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "--force" in err[0]
    assert main(["sweep", "--resume", str(run), "--force"]) == 0
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == FINISHED and says in " ".join(info["resumes"][-1]["forced"])


@pytest.mark.parametrize("argv, says", [
    (["--resume", "{run}", "--iters", "3"], "drop --iters"),
    (["--resume", "{tmp}"], "no readable run.json"),
    (["--resume", "{tmp}/absent"], "no readable run.json"),
    (["--force"], "--force goes with --resume"),
])
def test_resume_bad_input(finished_run, tmp_path, capsys, argv, says):
    argv = [a.format(run=finished_run, tmp=tmp_path) for a in argv]
    assert main(["sweep", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


def test_resume_refuses_a_run_still_running(finished_run, tmp_path, capsys):
    run = tmp_path / "live"
    run.mkdir()
    info = json.loads((finished_run / "run.json").read_text())
    info.update(status="running", pid=os.getpid())  # this very process: alive, on this host
    (run / "run.json").write_text(json.dumps(info))
    assert main(["sweep", "--resume", str(run)]) == 2
    assert "still running" in capsys.readouterr().err
