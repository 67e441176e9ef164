"""One sweep's run (``Sweep``): its folder, its workers started by an executor, and what they send
(``lorabench.runtime.protocol``) written the moment it arrives: each point's steps into the run's
samples, its row (with its median's interval) into ``points.parquet``, each verdict into
``checks.json``, each group's timed loads, and ``run.json`` as the run goes. ``Sweep.resume``
continues a run that ended early, in its own folder (``lorabench.commands.resume`` says whether it
may)."""

import json
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lorabench.commands.resume import differences, recorded
from lorabench.config.plan import Job, groups, plan, point_groups
from lorabench.config.sweep_spec import SweepSpec
from lorabench.errors import UserError
from lorabench.kernels import BACKENDS
from lorabench.runtime import env
from lorabench.runtime.executors import Event, Executor, Kind, Lines
from lorabench.runtime.launch import Task
from lorabench.runtime.protocol import SWEEP, Measured
from lorabench.stats import median_interval
from lorabench.storage.checks import Checked, read_checks, write_checks
from lorabench.storage.results import PointsWriter
from lorabench.storage.row import Env, Row
from lorabench.storage.runs import FINISHED, INTERRUPTED, RUNNING, write_info
from lorabench.storage.samples import Loads, pack_samples, write_loads, write_samples
from lorabench.storage.tune_files import vllm_folder

PASSED_ON = ("LORABENCH_GIT_SHA", "OMP_NUM_THREADS")  # the caller's, given to every worker wherever it runs


def new_run_dir(out: Path, device: str) -> tuple[str, Path]:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_id, i = f"{stamp}-{device}", 1
    while (out / run_id).exists():
        i += 1
        run_id = f"{stamp}-{device}-{i}"
    try:
        (out / run_id).mkdir(parents=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create the run folder there ({e.strerror or e})") from None
    return run_id, out / run_id


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP reached the sweep: it stops as Ctrl-C stops it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP noted while the sweep waits on its workers, raised as
    ``Stopped`` by ``raise_if_stopped`` between waits: raised from inside the handler, the
    exception can land in a lock's release in ``queue.get`` and leave a RuntimeError in its place
    (the run left marked running). A second signal stops at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.note) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h)

    def note(self, signum, frame) -> None:
        if self.signum is not None:
            raise Stopped(signum)
        self.signum = signum

    def raise_if_stopped(self) -> None:
        if self.signum is not None:
            raise Stopped(self.signum)


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Sweep:
    """A run: ``check_only`` builds and checks every configuration and times nothing. ``worker``
    is the module each worker process runs (``lorabench.commands.sweep.WORKER``)."""

    def __init__(self, spec: SweepSpec, argv: str, console: Console, run_dir: Path, info: dict,
                 writer: PointsWriter, worker: str, check_only: bool = False):
        """A run whose folder and run.json exist (``start`` makes them, ``resume`` reads them)."""
        self.spec, self.argv, self.console, self.check_only = spec, argv, console, check_only
        self.run_dir, self.info, self.writer, self.worker = Path(run_dir), info, writer, worker
        self.run_id, self.started_at = info["run_id"], info["started_at"]
        self.jobs = [Job.from_json(json.dumps(j)) for j in info["jobs"]]
        self.todo = list(enumerate(self.jobs))  # (index, job) this process runs: all, or a resumed run's unfinished points
        self.checks: list[Checked] = read_checks(self.run_dir)  # one verdict per configuration
        self.wall_before = float(info.get("wall_s") or 0.0)  # wall time of earlier parts of a resumed run

    @classmethod
    def start(cls, spec: SweepSpec, argv: str, console: Console, worker: str, check_only: bool = False) -> "Sweep":
        """A new run in a new folder under ``spec.out``."""
        run_id, run_dir = new_run_dir(Path(spec.out), spec.device)
        started_at = now()
        jobs = plan(spec, run_id, started_at, argv)
        if check_only:
            jobs = [replace(job, points=()) for job in jobs]
        info = {"run_id": run_id, "command": "check" if check_only else "sweep", "started_at": started_at,
                "argv": argv, "status": RUNNING, "spec": spec.to_dict(), "env": asdict(env.host(spec.device)),
                "jobs": [asdict(job) for job in jobs]}
        run = cls(spec, argv, console, run_dir, info, PointsWriter(run_dir, part_of=point_groups(jobs)), worker, check_only)
        run.write_info()
        return run

    @classmethod
    def resume(cls, run_dir: Path, argv: str, console: Console, worker: str, force: bool = False) -> "Sweep":
        """The sweep that measures ``run_dir``'s missing and failed points into it, under the plan
        recorded in its run.json (``lorabench.commands.resume``: refused in one line, unless
        ``force``, when the run may not be resumed here as it is)."""
        info, jobs = recorded(run_dir, force)
        try:
            parts = point_groups(jobs)
            run = cls(SweepSpec(**info["spec"]), argv, console, run_dir, info, PointsWriter(run_dir, True, parts), worker)
        except (TypeError, KeyError) as e:
            raise UserError(f"--resume {run_dir}: its run.json is not one this lorabench can read ({e})") from None
        found = differences(run)
        if found and not force:
            raise UserError(f"--resume {run_dir}: {'; '.join(found)} (--force resumes it anyway)")
        ok = {r.point for r in run.writer.rows if r.status == "ok"}
        lacking = [(i, replace(j, points=tuple(p for p in j.points if p.index not in ok))) for i, j in run.todo]
        run.todo = [(i, j) for i, j in lacking if j.points]
        info.setdefault("resumes", []).append({"at": now(), "argv": argv, "points": run.points,
                                               "previous_status": info["previous_status"],
                                               "forced": found if force else []})
        info.pop("previous_status")
        info.update(status=RUNNING)
        run.write_info()
        return run

    @property
    def points(self) -> int:
        return sum(len(j.points) for _, j in self.todo)

    def write_info(self) -> None:
        self.info.update(pid=os.getpid(), host=socket.gethostname())
        write_info(self.run_dir, self.info)

    def run(self, executor: Executor) -> Path:
        """Measure ``self.todo``, its groups spread by ``executor``. SIGINT, SIGTERM and SIGHUP
        stop it (``Stopped``, between waits): the run is marked interrupted, every task cancelled
        and its worker killed, every finished row kept."""
        t0 = time.perf_counter()
        total = len(self.todo) if self.check_only else self.points
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        self.info["executor"] = executor.describe()
        try:
            with StopSignals() as stops, Progress(*columns, console=self.console, transient=False) as progress:
                task = progress.add_task("starting", total=total)

                def advance() -> None:
                    progress.advance(task)
                    self.info["wall_s"] = self.wall_before + time.perf_counter() - t0
                    self.write_info()

                self.progress = lambda text: progress.update(task, description=text)
                self.execute(executor, advance, stops)
        except KeyboardInterrupt as e:
            executor.cancel()
            signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
            self.writer.flush()
            self.info.update(status=INTERRUPTED, signal=signal.Signals(signum).name,
                             wall_s=self.wall_before + time.perf_counter() - t0)
            self.write_info()
            raise
        except BaseException:  # a failure of the sweep itself: no worker left running
            executor.cancel()
            raise
        pack_samples(self.run_dir)
        self.info.update(status=FINISHED, wall_s=self.wall_before + time.perf_counter() - t0, finished_at=now())
        self.info.pop("signal", None)
        self.write_info()
        return self.run_dir

    def group_numbers(self) -> dict[int, int]:
        """A job's index in the plan -> its group's place among the whole plan's groups (its
        worker-<g>.log and part-<g>.parquet: a resumed group continues the same ones)."""
        return {i: g for g, members in enumerate(groups(list(enumerate(self.jobs)))) for i, _ in members}

    def execute(self, executor: Executor, advance, stops: StopSignals) -> None:
        """Hand every group of ``self.todo`` to the executor, then write what its workers send,
        in this thread, until every group has ended or ``stops`` has noted a signal."""
        number = self.group_numbers()
        states: dict[int, GroupRun] = {}
        tasks = []
        for group in groups(self.todo):
            g = number[group[0][0]]
            jobs = [job for _, job in group]
            states[g] = GroupRun(g, jobs)
            log = self.worker_log(g)
            if log.is_file() and log.stat().st_size:
                with open(log, "a") as f:
                    f.write(f"--- resumed {now()}: {sum(len(j.points) for j in jobs)} points ---\n")
            message = json.dumps({"jobs": [job.to_json() for job in jobs], "spawned_at": time.time()})
            tasks.append(Task(g, self.worker, message, self.worker_env(jobs[0]), sum(len(j.points) for j in jobs)))
        events: queue.Queue[Event] = queue.Queue()
        executor.start(tasks, events, self.worker_log)
        while any(not state.ended for state in states.values()):
            try:
                event: Event | None = events.get(timeout=0.5)  # a timeout: a noted signal is seen between waits
            except queue.Empty:
                event = None
            if stops.signum is not None:
                self.drain(event, events, states, advance)
                stops.raise_if_stopped()
            if event is not None:
                self.handle(event, states, advance)
        stops.raise_if_stopped()  # Ctrl-C reaches the workers too: their groups may all end before the next wait

    def drain(self, event: Event | None, events: "queue.Queue[Event]", states: "dict[int, GroupRun]",
              advance) -> None:
        """After a signal: ``event`` and the rest the workers sent before it, their rows kept; a
        worker's end is not handled, for Ctrl-C reaches the workers too and a worker it ended
        leaves its points missing (to resume), not failed."""
        while event is not None:
            if event.kind is not Kind.END:
                self.handle(event, states, advance)
            try:
                event = events.get_nowait()
            except queue.Empty:
                event = None

    def handle(self, event: Event, states: "dict[int, GroupRun]", advance) -> None:
        state = states[event.group]
        if event.kind is Kind.START:
            if state.lines.attempt:
                self.console.print(f"worker-{event.group}: its Dask worker was lost; its group runs again, whole, "
                                   f"on {event.text}")
                state.done.clear()  # the group's rows all come from one GPU: the rerun's
            state.lines.fresh(event)
            lead = state.jobs[0]
            self.progress(f"{lead.kernels} max_loras={lead.max_loras} {','.join(j.strategy for j in state.jobs)}"
                          f" on {event.text}")
        elif event.kind is Kind.LINE:
            for line in state.lines.fresh(event):
                self.take(line, state, advance)
        elif event.kind is Kind.END and not state.ended:
            for line in state.lines.fresh(event):  # what the stream has not brought yet
                self.take(line, state, advance)
            if event.lines or (event.text and event.status is not None):  # a Dask task's log comes back with it
                with open(self.worker_log(event.group), "a") as log:
                    log.write(event.text)
            state.ended = True
            self.end_group(event, state, advance)

    def take(self, line: str, state: "GroupRun", advance) -> None:
        """One line of a worker's: the message it carries, written where it goes."""
        try:
            message = SWEEP.decode(line)
        except ValueError as e:  # a line cut short (a worker killed mid-write): its point ends failed
            with open(self.worker_log(state.group), "a") as log:
                log.write(f"lorabench sweep: {e}\n")
            return
        match message:
            case Measured(row=row):
                self.add_row(message)
                state.done.add(row.point)
                if row.point not in state.counted:
                    state.counted.add(row.point)
                    advance()
            case Checked():
                self.add_check(message, advance)
                state.verdicts.add(message.strategy)
            case Loads():
                write_loads(self.run_dir, state.group, message)
            case Env():
                self.info["env"] = asdict(message)
                self.write_info()

    def add_check(self, verdict: Checked, advance) -> None:
        self.checks = [c for c in self.checks if c.config != verdict.config] + [verdict]
        write_checks(self.run_dir, self.checks)
        if self.check_only:
            advance()

    def worker_env(self, job: Job) -> dict[str, str | None]:
        """What the worker's environment gets on top of its host's (None: removed): the caller's
        OMP_NUM_THREADS among them (torch sizes its CPU thread pool by it; a Dask worker sets its
        own, 1, otherwise)."""
        changes: dict[str, str | None] = {}
        label = job.label
        if self.spec.device == "cpu" and BACKENDS[label.backend].triton:
            changes["TRITON_INTERPRET"] = "1"  # Triton kernels on the CPU run in its interpreter
        if label.vllm and label.tuned:  # vLLM reads its tuned configs from here, and only then
            changes["VLLM_TUNED_CONFIG_FOLDER"] = str(Path(vllm_folder(self.spec.tuned)).resolve())
        elif label.vllm:
            changes["VLLM_TUNED_CONFIG_FOLDER"] = None  # the defaults, whatever the shell says
        for name in PASSED_ON:  # a worker on another host too: this code's version, the caller's threads
            if os.environ.get(name):
                changes[name] = os.environ[name]
        return changes

    def worker_log(self, g: int) -> Path:
        """worker-<g>.log: g is the group's place among the run's whole plan's groups, so a
        resumed worker appends to the log of the one before it."""
        return self.run_dir / f"worker-{g}.log"

    def add_row(self, measured: Measured) -> None:
        """A worker's row: its steps into their file first, their median's interval into the row."""
        row = measured.row
        if measured.steps is not None:
            write_samples(self.run_dir, row.point, measured.steps)
            interval = median_interval(np.asarray(measured.steps.step_ms, dtype=float))
            if interval is not None:
                row = replace(row, step_ms_ci_low=interval.low, step_ms_ci_high=interval.high)
        self.writer.append(row)

    def end_group(self, event: Event, state: "GroupRun", advance) -> None:
        """A group's worker ended: its points without a row become failed rows, its strategies
        without a verdict get none, each saying how it ended."""
        if event.status is not None:
            lines = [ln for ln in self.worker_log(event.group).read_text().splitlines() if ln.strip()]
            how = f"worker exited with status {event.status}; its log ends: {(lines[-1:] or ['(empty log)'])[0][:500]}"
        else:
            how = f"worker never finished: {event.text[:500]}"
        for job in state.jobs:
            missing = [p for p in job.points if p.index not in state.done]
            if self.spec.check and job.strategy not in state.verdicts:
                self.add_check(Checked(**job.config, correct=None, detail=f"no verdict: {how}"), advance)
            error = (how.replace("; its log", " before this point; its log", 1) if event.status is not None
                     else f"{how} (before this point)")
            for p in missing:
                self.writer.append(Row(run_id=self.run_id, started_at=self.started_at, argv=job.argv, **job.config,
                                       device=job.device, model=job.model.name, tp=job.tp, rank=job.rank, dtype=job.dtype,
                                       point=p.index, mode=p.mode, concurrency=p.concurrency, n_active=p.n_active,
                                       workload=p.workload, status="failed", error=error))
                if p.index not in state.counted:
                    state.counted.add(p.index)
                    advance()


@dataclass
class GroupRun:
    """What the sweep knows of one group while it runs: its jobs, the attempt it listens to (a
    Dask task rerun elsewhere is another), the points with a row and the strategies with a verdict."""

    group: int  # its place among the run's groups (worker-<group>.log)
    jobs: list[Job]
    lines: Lines = field(default_factory=Lines)  # the attempt listened to, and its lines taken
    done: set[int] = field(default_factory=set)
    counted: set[int] = field(default_factory=set)  # points the progress bar has counted (once, whatever reruns)
    verdicts: set[str] = field(default_factory=set)
    ended: bool = False
