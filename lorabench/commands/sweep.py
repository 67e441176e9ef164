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
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
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

from lorabench.analysis.optimise import auto_recommendations
from lorabench.analysis.points import run_samples
from lorabench.commands.summary import points_table
from lorabench.config.plan import Job, auto_key, groups, plan
from lorabench.config.spec import SweepSpec, build_spec
from lorabench.config.strategies import AUTO
from lorabench.errors import UserError
from lorabench.kernels import BACKENDS
from lorabench.runtime import env
from lorabench.stats import median_interval
from lorabench.storage.results import PointsWriter, load_run, read_points
from lorabench.storage.runs import (
    FINISHED,
    INTERRUPTED,
    RUNNING,
    coverage,
    read_info,
    run_status,
)
from lorabench.storage.samples import write_samples
from lorabench.storage.tune_files import vllm_folder

WORKER = "lorabench.runtime.worker"  # the module each worker process runs
LIFELINE = "lorabench.runtime.lifeline"  # runs WORKER, tied to this process (it ends when the sweep does)


def resolve_auto(spec: SweepSpec) -> str | None:
    """Strategy auto: choose the capture set per (kernels, max_loras) from the --auto-from run's
    points, for the sweep's first workload, within the budgets; keep the model's predictions.
    Returns a one-line notice or None."""
    df = load_run(Path(spec.auto_from))
    samples = run_samples(Path(spec.auto_from))  # the same interval rule as `lorabench recommend`
    memory = spec.graph_memory_budget * 2**20 if spec.graph_memory_budget else None
    spec.auto_sets = {}
    for k in spec.kernels:
        for m in spec.max_loras:
            try:
                recs = auto_recommendations(df, spec.workload[0], memory, spec.startup_budget, kernels=[k], max_loras=[m],
                                            samples=samples)
            except ValueError as e:
                raise UserError(f"--strategy auto: {e}") from None
            if not recs:
                raise UserError(f"--auto-from {spec.auto_from}: no successful {k} points at max_loras {m} to choose from")
            if recs[0]["auto"] is None:
                raise UserError(f"--strategy auto at max_loras {m}: {recs[0]['reason']}")
            if recs[0]["capture_sizes"] != spec.capture_sizes or not set(spec.concurrency) <= set(recs[0]["concurrency"]):
                raise UserError(f"--strategy auto: the set is priced for the --auto-from run's capture sizes "
                                f"{recs[0]['capture_sizes']} and concurrencies {recs[0]['concurrency']}; sweep with those "
                                f"(this sweep: sizes {spec.capture_sizes}, concurrency {spec.concurrency})")
            a = recs[0]["auto"]
            spec.auto_sets[auto_key(k, m)] = {"counts": a["counts"], "predicted_ms": a["expected_ms_by_c"],
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
        run = cls(spec, argv, console, run_dir, info, PointsWriter(run_dir), check_only)
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
            run = cls(SweepSpec(**info["spec"]), argv, console, run_dir, info, PointsWriter(run_dir, resume=True))
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

    def run(self) -> Path:
        """Measure ``self.todo``. SIGTERM and SIGHUP stop it as Ctrl-C does (``Stopped``): the
        run is marked interrupted, the worker killed, every finished row kept."""
        t0 = time.perf_counter()
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGHUP)}
        total = len(self.todo) if self.check_only else self.points
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        try:
            with Progress(*columns, console=self.console, transient=False) as progress:
                task = progress.add_task("starting", total=total)

                def advance() -> None:
                    progress.advance(task)
                    self.info["wall_s"] = self.wall_before + time.perf_counter() - t0
                    self.write_info()

                for group in groups(self.todo):
                    lead = group[0][1]
                    progress.update(task, description=f"{lead.kernels} max_loras={lead.max_loras} "
                                                      f"{','.join(j.strategy for _, j in group)}")
                    self.run_worker(group, advance)
        except KeyboardInterrupt as e:
            signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
            self.writer.flush()
            self.info.update(status=INTERRUPTED, signal=signal.Signals(signum).name,
                             wall_s=self.wall_before + time.perf_counter() - t0)
            self.write_info()
            raise
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
        self.info.update(status=FINISHED, wall_s=self.wall_before + time.perf_counter() - t0, finished_at=now())
        self.info.pop("signal", None)
        self.write_info()
        return self.run_dir

    def add_check(self, verdict: dict, advance) -> None:
        key = {k: verdict.get(k) for k in ("kernels", "max_loras", "strategy")}
        self.checks = [c for c in self.checks if {k: c.get(k) for k in key} != key] + [verdict]
        (self.run_dir / "checks.json").write_text(json.dumps(self.checks, indent=2) + "\n")
        if self.check_only:
            advance()

    def worker_env(self, job: Job) -> dict:
        child_env = dict(os.environ)
        label = job.label
        if self.spec.device == "cpu" and BACKENDS[label.backend].triton:
            child_env["TRITON_INTERPRET"] = "1"  # Triton kernels on the CPU run in its interpreter
        if label.vllm and label.tuned:  # vLLM reads its tuned configs from here, and only then
            child_env["VLLM_TUNED_CONFIG_FOLDER"] = str(vllm_folder(self.spec.tuned))
        elif label.vllm:
            child_env.pop("VLLM_TUNED_CONFIG_FOLDER", None)  # the defaults, whatever the shell says
        return child_env

    def worker_log(self, group: list[tuple[int, Job]]) -> Path:
        """worker-<g>.log: g is the group's place among the run's whole plan's groups, so a
        resumed worker appends to the log of the one before it."""
        number = {i: g for g, members in enumerate(groups(list(enumerate(self.jobs)))) for i, _ in members}
        return self.run_dir / f"worker-{number[group[0][0]]}.log"

    def add_row(self, row: dict) -> None:
        """A worker's row: its samples into their file first, their median's interval into the row."""
        samples = row.pop("samples", None)
        if samples is not None:
            write_samples(self.run_dir, row["point"], samples)
            interval = median_interval(np.asarray(samples["step_ms"], dtype=float))
            if interval is not None:
                row.update(step_ms_ci_low=interval.low, step_ms_ci_high=interval.high)
        self.writer.append(row)

    def run_worker(self, group: list[tuple[int, Job]], advance) -> None:
        jobs = [job for _, job in group]
        message = json.dumps({"jobs": [job.to_json() for job in jobs], "spawned_at": time.time()})
        log_path = self.worker_log(group)
        done: set[int] = set()
        verdicts: set[tuple] = set()
        with open(log_path, "a") as log:
            if log.tell():
                log.write(f"--- resumed {now()}: {sum(len(j.points) for j in jobs)} points ---\n")
                log.flush()
            proc = subprocess.Popen([sys.executable, "-m", LIFELINE, str(os.getpid()), WORKER], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log, text=True, env=self.worker_env(jobs[0]))
            try:
                proc.stdin.write(message)
                proc.stdin.close()
                for line in proc.stdout:
                    kind, _, body = line.partition(" ")
                    if kind == "@@row":
                        row = json.loads(body)
                        self.add_row(row)
                        done.add(row["point"])
                        advance()
                    elif kind == "@@check":
                        verdict = json.loads(body)
                        self.add_check(verdict, advance)
                        verdicts.add(verdict.get("strategy"))
                    elif kind == "@@env":
                        self.info["env"] = json.loads(body)
                        self.write_info()
                rc = proc.wait()
            except BaseException:
                proc.kill()
                proc.wait()
                raise
        tail = [ln for ln in log_path.read_text().splitlines() if ln.strip()][-1:] or ["(empty log)"]
        for job in jobs:
            missing = [p for p in job.points if p.index not in done]
            if self.spec.check and job.strategy not in verdicts:
                self.add_check({**job.config, "correct": None,
                                "detail": f"no verdict: worker exited with status {rc}; its log ends: {tail[0][:500]}"},
                               advance)
            if missing:
                error = f"worker exited with status {rc} before this point; its log ends: {tail[0][:500]}"
                base = {"run_id": self.run_id, "started_at": self.started_at, "argv": job.argv, **job.config,
                        "device": job.device, "model": job.model.name, "tp": job.tp, "rank": job.rank, "dtype": job.dtype}
                for p in missing:
                    self.writer.append({**base, "point": p.index, "mode": p.mode, "concurrency": p.concurrency,
                                        "n_active": p.n_active, "workload": p.workload, "status": "failed",
                                        "error": error})
                    advance()


def sweep(flags: dict, spec_file: Path | None, console: Console, resume: Path | None = None,
          force: bool = False) -> int:
    """The command: run the sweep (or resume one), print its table. Exit status 1 when no point
    was measured; 128 + the signal's number when a signal stopped it."""
    argv = shlex.join(["lorabench"] + sys.argv[1:])
    if resume is not None:
        given = [f"--{k.replace('_', '-')}" for k, v in flags.items() if v is not None] + (["--spec"] if spec_file else [])
        if given:
            raise UserError(f"--resume continues the run under its own spec; drop {', '.join(given)}")
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
        if force:
            raise UserError("--force goes with --resume")
        spec, notice = prepare(flags, spec_file)
        if notice:
            console.print(notice)
        run = Sweep.start(spec, argv, console)
        console.print(f"run {run.run_id}: {run.points} points in {len(groups(run.todo))} workers -> {run.run_dir}")
    try:
        run_dir = run.run()
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        print(f"interrupted ({signal.Signals(signum).name}): {len(run.writer.rows)} finished rows kept in "
              f"{run.writer.path}; finish it with: lorabench sweep --resume {shlex.quote(str(run.run_dir))}",
              file=sys.stderr)
        return 128 + signum
    df = read_points(run_dir)
    console.print(points_table(df, run.spec.device, coverage(run_dir, df)))
    failed = int((df.status == "failed").sum())
    console.print(f"{len(df)} points ({failed} failed) in {run.info['wall_s']:.1f} s -> {run_dir / 'points.parquet'}")
    if failed:
        console.print(f"re-measure the failed points with: lorabench sweep --resume {shlex.quote(str(run_dir))}")
    console.print(f"next: lorabench report {shlex.quote(str(run_dir))}")
    return 1 if failed == len(df) else 0  # 1: nothing was measured
