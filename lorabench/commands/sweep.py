"""``lorabench sweep`` (and ``lorabench check``, which builds and checks the same workers but
times nothing): plans the jobs, starts one worker process per (kernels, max_loras) that times its
strategies in alternating turns, writes each row the moment it arrives, and ends with a summary
table.

Output: ``<out>/<run_id>/points.parquet`` (+ ``points.jsonl``), ``samples/`` (every timed step of
every point), ``run.json`` (the spec, argv and environment), ``checks.json`` (each
configuration's correctness verdict) and one ``worker-<i>.log`` per worker.
"""

import json
import os
import queue
import shlex
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from lorabench.analysis.optimise import auto_decisions
from lorabench.analysis.reasons import reason
from lorabench.analysis.recommendation_json import plan_json
from lorabench.analysis.view import RunView
from lorabench.commands.summary import points_table
from lorabench.config.plan import Job, auto_key, groups, plan, point_groups
from lorabench.config.spec import SweepSpec, build_spec
from lorabench.config.strategies import AUTO
from lorabench.errors import UserError
from lorabench.kernels import BACKENDS
from lorabench.runtime import env
from lorabench.runtime.executors import Event, Executor, ExecutorKind, Kind, Lines
from lorabench.runtime.executors import make as make_executor
from lorabench.runtime.launch import Task
from lorabench.stats import median_interval
from lorabench.storage.results import PointsWriter, read_points
from lorabench.storage.runs import (
    FINISHED,
    INTERRUPTED,
    RUNNING,
    coverage,
    read_info,
    run_status,
)
from lorabench.storage.samples import pack_samples, write_loads, write_samples
from lorabench.storage.tune_files import vllm_folder

WORKER = "lorabench.runtime.worker"  # the module each worker process runs


@dataclass(frozen=True)
class Placement:
    """Where the groups run: ``--executor``, ``--gpus``, ``--scheduler`` (lorabench.runtime.executors)."""

    executor: ExecutorKind = ExecutorKind.LOCAL
    gpus: str | None = None
    scheduler: str | None = None

    @classmethod
    def parse(cls, executor: str | None, gpus: str | None, scheduler: str | None) -> "Placement":
        return cls(ExecutorKind.parse(executor), gpus, scheduler)

    def executor_for(self, device: str) -> Executor:
        return make_executor(self.executor, self.gpus, self.scheduler, device)


def resolve_auto(spec: SweepSpec) -> str | None:
    """Strategy auto: choose the capture set per (kernels, max_loras) from the --auto-from run's
    points, for the sweep's first workload, within the budgets; keep the model's predictions.
    Returns a one-line notice or None."""
    view = RunView.read(Path(spec.auto_from))  # read once; the same view and interval rule as `lorabench recommend`
    memory = spec.graph_memory_budget * 2**20 if spec.graph_memory_budget else None
    spec.auto_sets = {}
    for k in spec.kernels:
        for m in spec.max_loras:
            try:
                decisions = auto_decisions(view, spec.workload[0], memory, spec.startup_budget, kernels=[k], max_loras=[m])
            except ValueError as e:
                raise UserError(f"--strategy auto: {e}") from None
            if not decisions:
                raise UserError(f"--auto-from {spec.auto_from}: no successful {k} points at max_loras {m} to choose from")
            d = decisions[0]
            if d.chosen is None:
                raise UserError(f"--strategy auto at max_loras {m}: {reason(d)}")
            if list(d.capture_sizes) != spec.capture_sizes or not set(spec.concurrency) <= set(d.concurrency):
                raise UserError(f"--strategy auto: the set is priced for the --auto-from run's capture sizes "
                                f"{list(d.capture_sizes)} and concurrencies {list(d.concurrency)}; sweep with those "
                                f"(this sweep: sizes {spec.capture_sizes}, concurrency {spec.concurrency})")
            spec.auto_sets[auto_key(k, m)] = {"counts": d.chosen.counts, "predicted_ms": plan_json(d.chosen)["expected_ms_by_c"],
                                              "workload": spec.workload[0], "from": spec.auto_from}
    if len(spec.workload) > 1:
        return f"strategy auto is chosen for the first workload, {spec.workload[0]}"
    return None


def prepare(flags: dict, spec_file: Path | None) -> tuple[SweepSpec, str | None]:
    """The checked spec of a sweep or check on this machine, auto's sets chosen; and a notice."""
    spec, notice = build_spec(flags, spec_file, env.machine())
    if any(k.vllm for k in spec.labels):
        env.require_vllm()
    if AUTO in spec.strategy:
        notice = resolve_auto(spec) or notice
    return spec, notice


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


def _stop(signum, frame) -> None:
    raise Stopped(signum)


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Sweep:
    """A run: ``check_only`` builds and checks every configuration and times nothing.
    ``Sweep.resume`` continues a run that ended early, in its own folder."""

    def __init__(self, spec: SweepSpec, argv: str, console: Console, run_dir: Path, info: dict,
                 writer: PointsWriter, check_only: bool = False):
        """A run whose folder and run.json exist (``start`` makes them, ``resume`` reads them)."""
        self.spec, self.argv, self.console, self.check_only = spec, argv, console, check_only
        self.run_dir, self.info, self.writer = Path(run_dir), info, writer
        self.run_id, self.started_at = info["run_id"], info["started_at"]
        self.jobs = [Job.from_json(json.dumps(j)) for j in info["jobs"]]
        self.todo = list(enumerate(self.jobs))  # (index, job) this process runs: all, or a resumed run's unfinished points
        checks = self.run_dir / "checks.json"
        self.checks: list[dict] = json.loads(checks.read_text()) if checks.is_file() else []  # one verdict per configuration
        self.wall_before = float(info.get("wall_s") or 0.0)  # wall time of earlier parts of a resumed run

    @classmethod
    def start(cls, spec: SweepSpec, argv: str, console: Console, check_only: bool = False) -> "Sweep":
        """A new run in a new folder under ``spec.out``."""
        run_id, run_dir = new_run_dir(Path(spec.out), spec.device)
        started_at = now()
        jobs = plan(spec, run_id, started_at, argv)
        if check_only:
            jobs = [replace(job, points=()) for job in jobs]
        info = {"run_id": run_id, "command": "check" if check_only else "sweep", "started_at": started_at,
                "argv": argv, "status": RUNNING, "spec": spec.to_dict(), "env": env.collect("cpu"),
                "jobs": [asdict(job) for job in jobs]}
        run = cls(spec, argv, console, run_dir, info, PointsWriter(run_dir, part_of=point_groups(jobs)), check_only)
        run.write_info()
        return run

    @classmethod
    def resume(cls, run_dir: Path, argv: str, console: Console, force: bool = False) -> "Sweep":
        """The sweep that measures ``run_dir``'s missing and failed points into it, under the plan
        recorded in its run.json. Refuses in one line, unless ``force``, when this lorabench would
        plan it differently, runs other code, or this machine has another GPU."""
        info = read_info(run_dir)
        if not info:
            raise UserError(f"--resume {run_dir}: no readable run.json there (is it a sweep's output folder?)")
        if info.get("command") == "check":
            raise UserError(f"--resume {run_dir}: a check run times nothing; run lorabench check again")
        jobs_raw = info.get("jobs") or []
        if not jobs_raw or any(not isinstance(j.get("points"), list) for j in jobs_raw):
            raise UserError(f"--resume {run_dir}: its run.json has no plan to resume (written by an older lorabench)")
        status = run_status(info)
        if status == RUNNING and not force:
            where = f"process {info.get('pid')} on {info.get('host')}"
            raise UserError(f"--resume {run_dir}: its sweep is still running ({where}); "
                            "if that process is gone, add --force")
        try:
            parts = point_groups([Job.from_json(json.dumps(j)) for j in jobs_raw])
            run = cls(SweepSpec(**info["spec"]), argv, console, run_dir, info, PointsWriter(run_dir, True, parts))
        except (TypeError, KeyError) as e:
            raise UserError(f"--resume {run_dir}: its run.json is not one this lorabench can read ({e})") from None
        differences = run.differences()
        if differences and not force:
            raise UserError(f"--resume {run_dir}: {'; '.join(differences)} (--force resumes it anyway)")
        ok = {r["point"] for r in run.writer.rows if r["status"] == "ok"}
        lacking = [(i, replace(j, points=tuple(p for p in j.points if p.index not in ok))) for i, j in run.todo]
        run.todo = [(i, j) for i, j in lacking if j.points]
        info.setdefault("resumes", []).append({"at": now(), "argv": argv, "points": run.points,
                                               "previous_status": status, "forced": differences if force else []})
        info.update(status=RUNNING)
        run.write_info()
        return run

    def differences(self) -> list[str]:
        """What makes this resume differ from the run: the plan, the code, the GPU (empty: none)."""
        out = []
        replanned = plan(self.spec, self.run_id, self.started_at, self.jobs[0].argv if self.jobs else "")
        if [asdict(j) for j in replanned] != [asdict(j) for j in self.jobs]:
            out.append(f"this lorabench plans the run's spec differently ({sum(len(j.points) for j in replanned)} "
                       f"points in {len(replanned)} workers; the run has {sum(len(j.points) for j in self.jobs)} "
                       f"in {len(self.jobs)})")
        if self.spec.device == "cuda" and not env.machine().cuda:
            raise UserError(f"--resume {self.run_dir}: the run was measured on a GPU; this machine has none")
        rows = [r for r in self.writer.rows if r["status"] == "ok"]
        here = env.collect(self.spec.device)
        for key, what in (("git_sha", "code"), ("torch", "torch"), ("triton", "triton"), ("gpu_name", "GPU")):
            theirs = {r[key] for r in rows if r.get(key)} or ({self.info["env"][key]} if self.info.get("env", {}).get(key) else set())
            if key == "gpu_name" and self.spec.device == "cpu":
                continue
            if theirs and theirs != {here[key]}:
                out.append(f"other {what}: the run has {', '.join(sorted(map(str, theirs)))}, this machine {here[key]}")
        return out

    @property
    def points(self) -> int:
        return sum(len(j.points) for _, j in self.todo)

    def write_info(self) -> None:
        self.info.update(pid=os.getpid(), host=socket.gethostname())
        tmp = self.run_dir / "run.json.tmp"
        tmp.write_text(json.dumps(self.info, indent=2) + "\n")
        os.replace(tmp, self.run_dir / "run.json")

    def run(self, executor: "Executor") -> Path:
        """Measure ``self.todo``, its groups spread by ``executor``. SIGTERM and SIGHUP stop it as
        Ctrl-C does (``Stopped``): the run is marked interrupted, every task cancelled and its
        worker killed, every finished row kept."""
        t0 = time.perf_counter()
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGHUP)}
        total = len(self.todo) if self.check_only else self.points
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        self.info["executor"] = executor.describe()
        try:
            with Progress(*columns, console=self.console, transient=False) as progress:
                task = progress.add_task("starting", total=total)

                def advance() -> None:
                    progress.advance(task)
                    self.info["wall_s"] = self.wall_before + time.perf_counter() - t0
                    self.write_info()

                self.progress = lambda text: progress.update(task, description=text)
                self.execute(executor, advance)
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
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
        pack_samples(self.run_dir)
        self.info.update(status=FINISHED, wall_s=self.wall_before + time.perf_counter() - t0, finished_at=now())
        self.info.pop("signal", None)
        self.write_info()
        return self.run_dir

    def group_numbers(self) -> dict[int, int]:
        """A job's index in the plan -> its group's place among the whole plan's groups (its
        worker-<g>.log and part-<g>.parquet: a resumed group continues the same ones)."""
        return {i: g for g, members in enumerate(groups(list(enumerate(self.jobs)))) for i, _ in members}

    def execute(self, executor: "Executor", advance) -> None:
        """Hand every group of ``self.todo`` to the executor, then write what its workers send,
        in this thread, until every group has ended."""
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
            tasks.append(Task(g, WORKER, message, self.worker_env(jobs[0]), sum(len(j.points) for j in jobs)))
        events: queue.Queue[Event] = queue.Queue()
        executor.start(tasks, events, self.worker_log)
        while any(not state.ended for state in states.values()):
            try:
                event = events.get(timeout=0.5)  # a timeout: signals reach this thread between waits
            except queue.Empty:
                continue
            self.handle(event, states, advance)

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
                self.take_line(line, state, advance)
        elif event.kind is Kind.END and not state.ended:
            for line in state.lines.fresh(event):  # what the stream has not brought yet
                self.take_line(line, state, advance)
            if event.lines or (event.text and event.status is not None):  # a Dask task's log comes back with it
                with open(self.worker_log(event.group), "a") as log:
                    log.write(event.text)
            state.ended = True
            self.end_group(event, state, advance)

    def take_line(self, line: str, state: "GroupRun", advance) -> None:
        kind, _, body = line.partition(" ")
        if kind == "@@row":
            row = json.loads(body)
            self.add_row(row)
            state.done.add(row["point"])
            if row["point"] not in state.counted:
                state.counted.add(row["point"])
                advance()
        elif kind == "@@check":
            verdict = json.loads(body)
            self.add_check(verdict, advance)
            state.verdicts.add(verdict.get("strategy"))
        elif kind == "@@loads":
            loads = json.loads(body)
            write_loads(self.run_dir, state.group, loads["kernels"], loads["max_loras"], loads)
        elif kind == "@@env":
            self.info["env"] = json.loads(body)
            self.write_info()

    def add_check(self, verdict: dict, advance) -> None:
        key = {k: verdict.get(k) for k in ("kernels", "max_loras", "strategy")}
        self.checks = [c for c in self.checks if {k: c.get(k) for k in key} != key] + [verdict]
        (self.run_dir / "checks.json").write_text(json.dumps(self.checks, indent=2) + "\n")
        if self.check_only:
            advance()

    def worker_env(self, job: Job) -> dict[str, str | None]:
        """What the worker's environment gets on top of its host's (None: removed)."""
        changes: dict[str, str | None] = {}
        label = job.label
        if self.spec.device == "cpu" and BACKENDS[label.backend].triton:
            changes["TRITON_INTERPRET"] = "1"  # Triton kernels on the CPU run in its interpreter
        if label.vllm and label.tuned:  # vLLM reads its tuned configs from here, and only then
            changes["VLLM_TUNED_CONFIG_FOLDER"] = str(Path(vllm_folder(self.spec.tuned)).resolve())
        elif label.vllm:
            changes["VLLM_TUNED_CONFIG_FOLDER"] = None  # the defaults, whatever the shell says
        if os.environ.get("LORABENCH_GIT_SHA"):  # a worker on another host reports this code's version
            changes["LORABENCH_GIT_SHA"] = os.environ["LORABENCH_GIT_SHA"]
        return changes

    def worker_log(self, g: int) -> Path:
        """worker-<g>.log: g is the group's place among the run's whole plan's groups, so a
        resumed worker appends to the log of the one before it."""
        return self.run_dir / f"worker-{g}.log"

    def add_row(self, row: dict) -> None:
        """A worker's row: its samples into their file first, their median's interval into the row."""
        samples = row.pop("samples", None)
        if samples is not None:
            write_samples(self.run_dir, row["point"], samples)
            interval = median_interval(np.asarray(samples["step_ms"], dtype=float))
            if interval is not None:
                row.update(step_ms_ci_low=interval.low, step_ms_ci_high=interval.high)
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
                self.add_check({**job.config, "correct": None, "detail": f"no verdict: {how}"}, advance)
            base = {"run_id": self.run_id, "started_at": self.started_at, "argv": job.argv, **job.config,
                    "device": job.device, "model": job.model.name, "tp": job.tp, "rank": job.rank, "dtype": job.dtype}
            for p in missing:
                self.writer.append({**base, "point": p.index, "mode": p.mode, "concurrency": p.concurrency,
                                    "n_active": p.n_active, "workload": p.workload, "status": "failed",
                                    "error": how.replace("; its log", " before this point; its log", 1)
                                    if event.status is not None else f"{how} (before this point)"})
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


def sweep(flags: dict, spec_file: Path | None, console: Console, resume: Path | None = None,
          force: bool = False, placement: Placement = Placement()) -> int:
    """The command: run the sweep (or resume one), print its table. Exit status 1 when no point
    was measured; 128 + the signal's number when a signal stopped it."""
    argv = shlex.join(["lorabench"] + sys.argv[1:])
    if resume is not None:
        given = [f"--{k.replace('_', '-')}" for k, v in flags.items() if v is not None] + (["--spec"] if spec_file else [])
        if given:
            raise UserError(f"--resume continues the run under its own spec; drop {', '.join(given)}")
        executor = placement.executor_for((read_info(resume).get("spec") or {}).get("device", "cpu"))
    else:
        if force:
            raise UserError("--force goes with --resume")
        spec, notice = prepare(flags, spec_file)
        if notice:
            console.print(notice)
        executor = placement.executor_for(spec.device)
    try:
        if resume is not None:
            run = Sweep.resume(resume, argv, console, force)
            if any(j.label.vllm for _, j in run.todo):
                env.require_vllm()
            planned = sum(len(j.points) for j in run.jobs)
            if run.todo:
                console.print(f"resume {run.run_id}: {run.points} of {planned} points to measure in "
                              f"{len(groups(run.todo))} workers -> {run.run_dir}")
            else:
                console.print(f"{run.run_dir}: every one of its {planned} planned points has an ok row; nothing to measure")
        else:
            run = Sweep.start(spec, argv, console)
            console.print(f"run {run.run_id}: {run.points} points in {len(groups(run.todo))} workers -> {run.run_dir}")
        run_dir = run.run(executor)
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        print(f"interrupted ({signal.Signals(signum).name}): {len(run.writer.rows)} finished rows kept in "
              f"{run.writer.path}; finish it with: lorabench sweep --resume {shlex.quote(str(run.run_dir))}",
              file=sys.stderr)
        return 128 + signum
    finally:
        executor.close()
    df = read_points(run_dir)
    console.print(points_table(df, run.spec.device, coverage(run_dir, df)))
    failed = int((df.status == "failed").sum())
    console.print(f"{len(df)} points ({failed} failed) in {run.info['wall_s']:.1f} s -> {run_dir / 'points.parquet'}")
    if failed:
        console.print(f"re-measure the failed points with: lorabench sweep --resume {shlex.quote(str(run_dir))}")
    console.print(f"next: lorabench report {shlex.quote(str(run_dir))}")
    return 1 if failed == len(df) else 0  # 1: nothing was measured
