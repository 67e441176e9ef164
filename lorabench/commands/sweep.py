"""``lorabench sweep`` (and ``lorabench check``, which builds and checks the same workers but
times nothing): plans the jobs, starts one worker process per (kernels, max_loras, strategy),
writes each row the moment it arrives, and ends with a summary table.

Output: ``<out>/<run_id>/points.parquet`` (+ ``points.jsonl``), ``run.json`` (the spec, argv and
environment), ``checks.json`` (each configuration's correctness verdict) and one
``worker-<i>.log`` per worker.
"""

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from lorabench.analysis.optimise import auto_recommendations
from lorabench.commands.summary import points_table
from lorabench.config.plan import Job, auto_key, plan
from lorabench.config.spec import SweepSpec, build_spec
from lorabench.config.strategies import AUTO
from lorabench.errors import UserError
from lorabench.kernels import BACKENDS
from lorabench.runtime import env
from lorabench.storage.results import PointsWriter, load_run, read_points
from lorabench.storage.tune_files import vllm_folder

WORKER = "lorabench.runtime.worker"  # the module each worker process runs (``python -m``)


def resolve_auto(spec: SweepSpec) -> str | None:
    """Strategy auto: choose the capture set per (kernels, max_loras) from the --auto-from run's
    points, for the sweep's first workload, within the budgets; keep the model's predictions.
    Returns a one-line notice or None."""
    df = load_run(Path(spec.auto_from))
    memory = spec.graph_memory_budget * 2**20 if spec.graph_memory_budget else None
    spec.auto_sets = {}
    for k in spec.kernels:
        for m in spec.max_loras:
            try:
                recs = auto_recommendations(df, spec.workload[0], memory, spec.startup_budget, kernels=[k], max_loras=[m])
            except ValueError as e:
                raise UserError(f"--strategy auto: {e}") from None
            if not recs:
                raise UserError(f"--auto-from {spec.auto_from}: no successful {k} points at max_loras {m} to choose from")
            if recs[0]["auto"] is None:
                raise UserError(f"--strategy auto: no capture set fits the budgets at max_loras {m}, not even max")
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
    (out / run_id).mkdir(parents=True)
    return run_id, out / run_id


class Sweep:
    """A run: ``check_only`` builds and checks every configuration and times nothing."""

    def __init__(self, spec: SweepSpec, argv: str, console: Console, check_only: bool = False):
        self.spec, self.argv, self.console, self.check_only = spec, argv, console, check_only
        self.run_id, self.run_dir = new_run_dir(Path(spec.out), spec.device)
        self.writer = PointsWriter(self.run_dir)
        self.started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.jobs = plan(spec, self.run_id, self.started_at, argv)
        if check_only:
            self.jobs = [replace(job, points=()) for job in self.jobs]
        self.checks: list[dict] = []  # one verdict per configuration, also in checks.json
        self.info = {
            "run_id": self.run_id, "started_at": self.started_at, "argv": argv, "status": "running",
            "spec": spec.to_dict(), "env": env.collect("cpu"),
            "jobs": [job.config | {"points": len(job.points)} for job in self.jobs],
        }
        self.write_info()

    @property
    def points(self) -> int:
        return sum(len(j.points) for j in self.jobs)

    def write_info(self) -> None:
        tmp = self.run_dir / "run.json.tmp"
        tmp.write_text(json.dumps(self.info, indent=2) + "\n")
        os.replace(tmp, self.run_dir / "run.json")

    def run(self) -> Path:
        t0 = time.perf_counter()
        total = len(self.jobs) if self.check_only else self.points
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        try:
            with Progress(*columns, console=self.console, transient=False) as progress:
                task = progress.add_task("starting", total=total)
                for i, job in enumerate(self.jobs):
                    progress.update(task, description=f"{job.kernels} max_loras={job.max_loras} {job.strategy}")
                    self.run_worker(i, job, lambda: progress.advance(task))
        except KeyboardInterrupt:
            self.info.update(status="interrupted", wall_s=time.perf_counter() - t0)
            self.write_info()
            raise
        self.info.update(status="finished", wall_s=time.perf_counter() - t0,
                         finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
        self.write_info()
        return self.run_dir

    def add_check(self, verdict: dict, advance) -> None:
        self.checks.append(verdict)
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

    def run_worker(self, index: int, job: Job, advance) -> None:
        message = json.dumps({"job": job.to_json(), "spawned_at": time.time()})
        log_path = self.run_dir / f"worker-{index}.log"
        done: set[int] = set()
        checks_before = len(self.checks)
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", WORKER], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log, text=True, env=self.worker_env(job))
            try:
                proc.stdin.write(message)
                proc.stdin.close()
                for line in proc.stdout:
                    kind, _, body = line.partition(" ")
                    if kind == "@@row":
                        row = json.loads(body)
                        self.writer.append(row)
                        done.add(row["point"])
                        advance()
                    elif kind == "@@check":
                        self.add_check(json.loads(body), advance)
                    elif kind == "@@env":
                        self.info["env"] = json.loads(body)
                        self.write_info()
                rc = proc.wait()
            except BaseException:
                proc.kill()
                proc.wait()
                raise
        missing = [p for p in job.points if p.index not in done]
        tail = [ln for ln in log_path.read_text().splitlines() if ln.strip()][-1:] or ["(empty log)"]
        if self.spec.check and len(self.checks) == checks_before:
            self.add_check({**job.config, "correct": None,
                            "detail": f"no verdict: worker exited with status {rc}; its log ends: {tail[0][:500]}"}, advance)
        if missing:
            error = f"worker exited with status {rc} before this point; its log ends: {tail[0][:500]}"
            base = {"run_id": self.run_id, "started_at": self.started_at, "argv": self.argv, **job.config,
                    "device": job.device, "model": job.model, "rank": job.rank, "dtype": job.dtype}
            for p in missing:
                self.writer.append({**base, "point": p.index, "mode": p.mode, "concurrency": p.concurrency,
                                    "n_active": p.n_active, "workload": p.workload, "status": "failed", "error": error})
                advance()


def sweep(flags: dict, spec_file: Path | None, console: Console) -> int:
    """The command: run the sweep, print its table. Exit status 1 when no point was measured."""
    spec, notice = prepare(flags, spec_file)
    if notice:
        console.print(notice)
    run = Sweep(spec, shlex.join(["lorabench"] + sys.argv[1:]), console)
    console.print(f"run {run.run_id}: {run.points} points in {len(run.jobs)} workers -> {run.run_dir}")
    try:
        run_dir = run.run()
    except KeyboardInterrupt:
        print(f"interrupted: {len(run.writer.rows)} finished rows kept in {run.writer.path}", file=sys.stderr)
        return 130
    df = read_points(run_dir)
    console.print(points_table(df, spec.device))
    failed = int((df.status == "failed").sum())
    console.print(f"{len(df)} points ({failed} failed) in {run.info['wall_s']:.1f} s -> {run_dir / 'points.parquet'}")
    console.print(f"next: lorabench report {run_dir}")
    return 1 if failed == len(df) else 0  # 1: nothing was measured
