"""Running one worker group's process, wherever an executor puts it: ``python -m
lorabench.runtime.lifeline PARENT MODULE`` (tied to PARENT: the sweep, or the Dask worker that runs
the task), the jobs on its stdin, its protocol lines (``lorabench.runtime.protocol``) handed on as
they come, its stderr into a log. Imports no torch."""

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

LIFELINE = "lorabench.runtime.lifeline"


@dataclass(frozen=True)
class Task:
    """One worker group, as executors run it: ``group`` numbers it in the run's plan (its
    ``worker-<group>.log`` and ``part-<group>.parquet``); ``message`` is the worker's stdin (the
    group's jobs); ``env`` what the worker's environment gets on top of the host's (None: removed)."""

    group: int
    module: str  # the worker module (lorabench.runtime.worker; a stand-in in tests)
    message: str
    env: dict[str, str | None] = field(default_factory=dict)
    points: int = 0  # planned points (for progress)


def environment(task: Task, pinned: dict[str, str]) -> dict[str, str]:
    """This host's environment with the task's changes and the GPU pinning applied."""
    child = dict(os.environ)
    for key, value in {**task.env, **pinned}.items():
        if value is None:
            child.pop(key, None)
        else:
            child[key] = value
    return child


def run(task: Task, parent: int, pinned: dict[str, str], log: IO[str], on_line: Callable[[str], None],
        started: Callable[[subprocess.Popen], None] = lambda proc: None) -> int:
    """Run the task's worker to its end and return its exit status; ``on_line`` gets each line
    it writes on stdout, ``started`` the process once it runs (to be killed from elsewhere). Any
    exception, KeyboardInterrupt included, kills the worker first."""
    proc = subprocess.Popen([sys.executable, "-m", LIFELINE, str(parent), task.module], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, text=True, env=environment(task, pinned))
    try:
        started(proc)
        try:
            proc.stdin.write(task.message)
            proc.stdin.close()
        except BrokenPipeError:  # it died before reading its jobs: its exit status says how
            pass
        for line in proc.stdout:
            on_line(line.rstrip("\n"))
        return proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
