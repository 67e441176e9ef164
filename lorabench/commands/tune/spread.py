"""A tune spread over GPUs (``lorabench tune --gpus 0,1`` or ``--executor dask``): the shapes are
dealt out to one worker per GPU (``lorabench.commands.tune.worker``, started by the sweep's
executors: pinned to its GPU by UUID, its own Triton cache), each tuning its share within the same
budget per shape; every measurement comes back as a line and this process alone writes the folder:
``cache.jsonl`` as rows arrive, then the tables and vLLM's files, once. Shapes are independent (each
is timed against its own default on one GPU), so spreading them changes no comparison; GPUs of
different models are refused (vLLM's config files are named per GPU)."""

import json
import queue
from dataclasses import asdict

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lorabench.commands.tune.search import Tuner
from lorabench.commands.tune.worker import TUNE, Measurement, ShapeDone, WorkerGpu
from lorabench.errors import UserError
from lorabench.runtime.executors import Executor, Kind, Lines
from lorabench.runtime.launch import Task

WORKER = "lorabench.commands.tune.worker"


def deal(shapes: list, workers: int) -> list[list]:
    """The shapes, round robin, one share per worker (none empty)."""
    return [share for share in (shapes[i::workers] for i in range(workers)) if share]


def one_model(seen: dict[int, str | None]) -> None:
    """Refuse, in one line, a tune whose workers ran on GPUs of different models."""
    names = sorted({name for name in seen.values() if name})
    if len(names) > 1:
        raise UserError(f"the tune's workers ran on GPUs of different models ({', '.join(names)}): their timings "
                        "and vLLM's config files (named per GPU) are not one GPU's; tune each model into its own --out")


def spread(tuner: Tuner, executor: Executor, console) -> list[dict]:
    """Run ``tuner``'s shapes over ``executor``'s GPUs; returns ``tuner.write()``'s summaries.
    A worker that fails loses only the shapes it had not finished (its rows so far are kept, and a
    rerun of the same command resumes them); KeyboardInterrupt stops every worker, the folder
    written from what arrived."""
    shares = deal(tuner.shapes, executor.width)
    tasks = []
    for g, share in enumerate(shares):
        message = {"spec": asdict(tuner.spec), "shapes": [asdict(s) for s in share], "command": tuner.meta["command"],
                   "session": tuner.session, "rows": [r for s in share for r in tuner.cache.of(s)]}
        env = {"TRITON_INTERPRET": "1"} if tuner.spec.device == "cpu" else {}  # as the in-process tune on the CPU
        tasks.append(Task(g, WORKER, json.dumps(message), env, len(share)))
    events: queue.Queue = queue.Queue()
    seen: dict[int, str | None] = {-1: tuner.cache.identity.get("gpu")}  # -1: this process's GPU, whose rows the tables take
    lines = {g: Lines() for g in range(len(tasks))}  # each worker's lines, taken once
    failed: list[str] = []
    ended: set[int] = set()

    def take(group: int, line: str, progress, bar) -> None:
        """A worker's line."""
        match TUNE.decode(line):
            case Measurement(row=row):
                tuner.cache.take(row)
            case ShapeDone(label=label, timed=timed):
                progress.advance(bar)
                if not console.is_terminal:
                    console.print(f"worker {group}: {label}: {timed} timed", highlight=False, markup=False)
            case WorkerGpu(gpu=gpu):
                seen[group] = gpu
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    executor.start(tasks, events, lambda g: tuner.out / f"tune-worker-{g}.log")
    try:
        with Progress(*columns, console=console, transient=False) as progress:
            bar = progress.add_task(f"tune on {executor.describe()}", total=len(tuner.shapes))
            while len(ended) < len(tasks):
                try:
                    event = events.get(timeout=0.5)
                except queue.Empty:
                    continue
                if event.kind is Kind.END and event.group in ended:
                    continue
                for line in lines[event.group].fresh(event):  # at END: what the stream has not brought yet (Dask)
                    take(event.group, line, progress, bar)
                if event.kind is Kind.END:
                    ended.add(event.group)
                    if event.status != 0:
                        how = f"exit status {event.status}" if event.status is not None else event.text[:300]
                        failed.append(f"worker {event.group} ({len(shares[event.group])} shapes) ended with {how}; "
                                      f"its log: {tuner.out / f'tune-worker-{event.group}.log'}")
    except BaseException:  # Ctrl-C: no worker left running; the tune writes the folder from what arrived
        executor.cancel()
        raise
    results = tuner.write()
    for line in failed:
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    one_model(seen)
    return results
