"""``lorabench sweep`` (and ``lorabench check``, which builds and checks the same workers but
times nothing): plans the jobs, starts one worker process per (kernels, max_loras) that times its
strategies in alternating turns, writes each row the moment it arrives
(``lorabench.commands.sweep_run``), and ends with a summary table.

Output: ``<out>/<run_id>/points.parquet`` (+ ``points.jsonl``), ``samples/`` (every timed step of
every point), ``run.json`` (the spec, argv and environment), ``checks.json`` (each
configuration's correctness verdict) and one ``worker-<i>.log`` per worker.

This process imports no torch (nor scipy, unless strategy auto is priced): it only plans, starts
workers and writes what they send, so the first worker starts as early as it can.
"""

import shlex
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from lorabench.commands.sweep_run import Stopped, Sweep
from lorabench.config.plan import auto_key, groups
from lorabench.config.spec import build_spec
from lorabench.config.strategies import AUTO
from lorabench.config.sweep_spec import SweepSpec
from lorabench.errors import UserError
from lorabench.runtime import env
from lorabench.runtime.executors import Executor, ExecutorKind
from lorabench.runtime.executors import make as make_executor
from lorabench.storage.runs import read_info

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
    from lorabench.analysis.optimise import auto_decisions  # pandas: only for auto
    from lorabench.analysis.reasons import reason
    from lorabench.analysis.recommendation_json import plan_json
    from lorabench.analysis.view import RunView

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


def interrupted_line(run: Sweep, signum: int) -> str:
    """What the console says of a sweep a signal stopped: what it kept, and how to finish it."""
    resume = f"lorabench sweep --resume {shlex.quote(str(run.run_dir))}"
    name = signal.Signals(signum).name
    if not run.writer.rows:  # no point finished: no points.parquet was written
        return (f"interrupted ({name}) before any point finished: nothing measured yet (no points.parquet) in "
                f"{run.run_dir}; finish it with: {resume}")
    return f"interrupted ({name}): {len(run.writer.rows)} finished rows kept in {run.writer.path}; finish it with: {resume}"


def workers(count: int) -> str:
    return f"{count} worker" + ("" if count == 1 else "s")


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
        executor = placement.executor_for(spec.device)  # refuses a placement before any notice
        if notice:
            console.print(notice)
    try:
        if resume is not None:
            run = Sweep.resume(resume, argv, console, WORKER, force)
            if any(j.label.vllm for _, j in run.todo):
                env.require_vllm()
            planned = sum(len(j.points) for j in run.jobs)
            if run.todo:
                console.print(f"resume {run.run_id}: {run.points} of {planned} points to measure in "
                              f"{workers(len(groups(run.todo)))} -> {run.run_dir}")
            else:
                console.print(f"{run.run_dir}: every one of its {planned} planned points has an ok row; nothing to measure")
        else:
            run = Sweep.start(spec, argv, console, WORKER)
            console.print(f"run {run.run_id}: {run.points} points in {workers(len(groups(run.todo)))} -> {run.run_dir}")
        run_dir = run.run(executor)
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        print(interrupted_line(run, signum), file=sys.stderr)
        return 128 + signum
    finally:
        executor.close()
    from lorabench.commands.summary import points_table  # pandas: once the workers are done
    from lorabench.storage.results import read_points
    from lorabench.storage.runs import coverage

    df = read_points(run_dir)
    console.print(points_table(df, run.spec.device, coverage(run_dir, df)))
    failed = int((df.status == "failed").sum())
    console.print(f"{len(df)} points ({failed} failed) in {run.info['wall_s']:.1f} s -> {run_dir / 'points.parquet'}")
    if failed:
        console.print(f"re-measure the failed points with: lorabench sweep --resume {shlex.quote(str(run_dir))}")
    console.print(f"next: lorabench report {shlex.quote(str(run_dir))}")
    return 1 if failed == len(df) else 0  # 1: nothing was measured
