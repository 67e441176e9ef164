"""Where a sweep's worker groups run: ``local``, every chosen GPU of this host, one group per GPU
at a time; ``dask``, the workers of a ``dask.distributed`` cluster that hold a ``GPU`` resource
(a ``LocalCluster`` over this host's GPUs, or a cluster on several hosts by ``--scheduler``).

A group (every strategy of one (kernels, max_loras): what the report compares) is the unit: it
runs whole on one GPU; groups spread over GPUs and hosts. Either executor runs the same worker
process (``lorabench.runtime.launch``) and reports what happens as ``Event``s on a queue, which
the sweep's own thread reads: the sweep alone writes the run's files.
"""

import os
import queue
import socket
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from itertools import count
from pathlib import Path
from uuid import uuid4

from lorabench.errors import UserError
from lorabench.runtime import gpus, launch
from lorabench.runtime.gpus import Device
from lorabench.runtime.launch import Task


class ExecutorKind(str, Enum):
    LOCAL = "local"
    DASK = "dask"

    @classmethod
    def parse(cls, text: str | None) -> "ExecutorKind":
        try:
            return cls(text or cls.LOCAL.value)
        except ValueError:
            raise UserError(f"--executor {text}: choose {' or '.join(k.value for k in cls)}") from None


class Kind(str, Enum):
    START = "start"  # a task's worker starts (``text``: where)
    LINE = "line"  # a line of its protocol
    END = "end"  # it ended (``status``: its exit status; None when it never finished)


@dataclass(frozen=True)
class Event:
    group: int
    kind: Kind
    attempt: str = ""  # one execution of the task: a rerun elsewhere has another
    seq: int = 0  # LINE: its place among the attempt's lines
    text: str = ""  # LINE: the line; START: where it runs; END: the log (Dask) or why it never finished
    status: int | None = None
    lines: tuple[str, ...] = ()  # END (Dask): the attempt's every line, those the stream has not brought yet


@dataclass
class Lines:
    """One task's protocol lines as its events bring them, each handed on once: a Dask task's come
    streamed and again, whole, with its END; a START (a rerun elsewhere: another attempt) starts
    over, and lines of any other attempt are dropped."""

    attempt: str = ""  # the attempt listened to: the last START's
    seen: int = -1  # its last line handed on

    def fresh(self, event: Event) -> list[str]:
        """The event's lines not handed on yet (a START's: none, and it starts over)."""
        if event.kind is Kind.START:
            self.attempt, self.seen = event.attempt, -1
            return []
        if not event.attempt or event.attempt != self.attempt:
            return []
        numbered = [(event.seq, event.text)] if event.kind is Kind.LINE else list(enumerate(event.lines))
        out = []
        for seq, line in numbered:
            if seq > self.seen:
                self.seen = seq
                out.append(line)
        return out


def where(device: Device | None) -> str:
    return f"{socket.gethostname()} {device.uuid if device else 'cpu'}"


class LocalExecutor:
    """The groups on this host: one worker per slot (a GPU, or None: the CPU) at a time, each
    pinned to its GPU by UUID with its own Triton cache; logs written live into ``log_path``."""

    def __init__(self, slots: list[Device | None]):
        self.slots = slots
        self.procs: list = []
        self.cancelled = False
        self.pool = ThreadPoolExecutor(len(slots), thread_name_prefix="lorabench-worker")  # no thread until a task

    def describe(self) -> str:
        return f"local: {', '.join(where(slot) for slot in self.slots)}"

    @property
    def width(self) -> int:
        """Workers that run at once."""
        return len(self.slots)

    def start(self, tasks: list[Task], events: queue.Queue, log_path: Callable[[int], Path]) -> None:
        self.log_path = log_path
        self.free: queue.Queue = queue.Queue()
        for slot in self.slots:
            self.free.put(slot)
        for task in tasks:
            self.pool.submit(self._run, task, events)

    def _run(self, task: Task, events: queue.Queue) -> None:
        device = self.free.get()
        try:
            if self.cancelled:
                return
            attempt, seq = uuid4().hex, count()
            events.put(Event(task.group, Kind.START, attempt, text=where(device)))
            with open(self.log_path(task.group), "a") as log:
                status = launch.run(task, os.getpid(), gpus.pinned_env(device), log,
                                    lambda line: events.put(Event(task.group, Kind.LINE, attempt, next(seq), line)),
                                    started=self.procs.append)
            events.put(Event(task.group, Kind.END, attempt, status=status))
        except Exception as e:  # noqa: BLE001 - the group's points become failed rows; the others go on
            events.put(Event(task.group, Kind.END, text=f"{type(e).__name__}: {e}"))
        finally:
            self.free.put(device)

    def cancel(self) -> None:
        """Ctrl-C: no new worker starts, every running one is killed."""
        self.cancelled = True
        self.pool.shutdown(wait=False, cancel_futures=True)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _require_distributed():
    try:
        import distributed
    except ImportError:
        raise UserError("--executor dask needs dask.distributed: pip install 'lorabench[dask]'") from None
    return distributed


class DaskExecutor:
    """The groups as Dask tasks, each needing one ``GPU`` resource: on the cluster at
    ``scheduler``, or on a LocalCluster of ``local_workers`` processes (one per GPU) this
    executor starts and stops. Lines stream back as the workers' events (``log_event``); a task
    whose Dask worker is lost is rerun elsewhere as the scheduler allows (``allowed-failures``:
    once on the LocalCluster), or ends without a status. The LocalCluster's workers see only the
    chosen GPUs (``devices``)."""

    def __init__(self, scheduler: str | None, local_workers: int = 1, devices: list[Device] = ()):
        distributed = _require_distributed()
        import dask

        self.cluster = None
        try:
            if scheduler:
                self.client = distributed.Client(scheduler, timeout="5s", set_as_default=False)
            else:
                with dask.config.set({"distributed.scheduler.allowed-failures": 1}):
                    seen = {"CUDA_VISIBLE_DEVICES": ",".join(d.uuid for d in devices)} if devices else {}
                    self.cluster = distributed.LocalCluster(n_workers=local_workers, threads_per_worker=1, processes=True,
                                                            resources={"GPU": 1}, dashboard_address=None, env=seen)
                self.client = distributed.Client(self.cluster, set_as_default=False)
        except (OSError, TimeoutError, ValueError) as e:
            raise UserError(f"--scheduler {scheduler}: cannot connect ({type(e).__name__}: {e})") from None
        workers = self.client.scheduler_info(n_workers=-1)["workers"]
        if not any(w.get("resources", {}).get("GPU") for w in workers.values()):
            self.close()
            raise UserError(f"--scheduler {scheduler}: no Dask worker holds a GPU resource "
                            "(start them with: dask worker ADDRESS --resources GPU=1 --nworkers <GPUs per host>)")
        self.width = int(sum(w.get("resources", {}).get("GPU", 0) for w in workers.values()))  # tasks at once
        self.futures: list = []
        self.stop_name = f"lorabench-stop-{uuid4().hex}"

    def describe(self) -> str:
        return f"dask: {self.client.scheduler.address}" + (" (a LocalCluster)" if self.cluster is not None else "")

    def start(self, tasks: list[Task], events: queue.Queue, log_path: Callable[[int], Path]) -> None:
        topic = f"lorabench-{uuid4().hex}"
        self.client.subscribe_topic(topic, lambda event: events.put(Event(*_event(event[1]))))
        for task in tasks:
            future = self.client.submit(run_remote, task, topic, self.stop_name, resources={"GPU": 1}, pure=False,
                                        key=f"lorabench-worker-{task.group}-{uuid4().hex[:8]}")
            future.add_done_callback(lambda f, group=task.group: events.put(_ended(group, f)))
            self.futures.append(future)

    def cancel(self) -> None:
        """Ctrl-C: every task cancelled; those running kill their workers (a Dask event they watch)."""
        import distributed

        distributed.Event(self.stop_name, client=self.client).set()
        self.client.cancel(self.futures, force=True)

    def close(self) -> None:
        self.client.close()
        if self.cluster is not None:
            self.cluster.close()


def _event(message) -> tuple:
    group, kind, attempt, seq, text = message
    return group, Kind(kind), attempt, seq, text


def _ended(group: int, future) -> Event:
    if future.cancelled():
        return Event(group, Kind.END, text="cancelled")
    error = future.exception()
    if error is not None:
        return Event(group, Kind.END, text=f"its Dask task failed ({type(error).__name__}: {error})")
    status, attempt, log, lines = future.result()
    return Event(group, Kind.END, attempt, text=log, status=status, lines=tuple(lines))


LOG_TAIL = 200_000  # characters of a Dask task's log sent back to the sweep


def run_remote(task: Task, topic: str, stop_name: str) -> tuple[int, str, str, list[str]]:
    """A Dask task: take a free GPU of this host, run the group's worker tied to this Dask worker,
    stream its lines to ``topic``; return its status, the attempt, its log and its lines."""
    import distributed

    worker = distributed.get_worker()
    stop = distributed.Event(stop_name)
    attempt, lines, procs, finished = uuid4().hex, [], [], threading.Event()

    def send(kind: Kind, seq: int, text: str) -> None:
        worker.log_event(topic, [task.group, kind.value, attempt, seq, text])

    def on_line(line: str) -> None:
        send(Kind.LINE, len(lines), line)
        lines.append(line)

    def watch() -> None:  # the sweep was stopped: kill the worker
        while not finished.is_set():
            if stop.is_set():
                for proc in procs:
                    proc.kill()
                return
            finished.wait(0.5)

    with gpus.claim(gpus.visible()) as device, tempfile.TemporaryFile("w+") as log:
        send(Kind.START, 0, where(device))
        threading.Thread(target=watch, daemon=True).start()
        try:
            status = launch.run(task, os.getpid(), gpus.pinned_env(device), log, on_line, started=procs.append)
        finally:
            finished.set()
        log.seek(0)
        return status, attempt, log.read()[-LOG_TAIL:], lines


Executor = LocalExecutor | DaskExecutor


def make(kind: ExecutorKind, gpus_text: str | None, scheduler: str | None, device: str) -> Executor:
    """The executor ``--executor``, ``--gpus`` and ``--scheduler`` ask for, for a sweep on
    ``device``; one UserError line for a combination that cannot be (``gpus.visible`` lists this
    host's GPUs). On the CPU, local runs one group at a time, as there is one CPU."""
    if scheduler and kind is not ExecutorKind.DASK:
        raise UserError("--scheduler goes with --executor dask")
    if gpus_text and scheduler:
        raise UserError("--gpus chooses this host's GPUs; with --scheduler, the cluster's workers hold theirs")
    chosen = gpus.select(gpus_text, gpus.visible())
    slots = chosen if device == "cuda" and chosen else [None]
    if device == "cuda":
        gpus.one_model(chosen)
    if kind is ExecutorKind.LOCAL:
        return LocalExecutor(slots)
    return DaskExecutor(scheduler, len(slots), [s for s in slots if s is not None])
