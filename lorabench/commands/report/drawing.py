"""The report's figures drawn side by side: a figure takes a few tenths of a second of matplotlib
(its layout, its text, its pixels), so each is drawn in a process of its own, forked from the
report's once its inputs are ready (the imports, frames and decisions are already there: nothing
is pickled), at most one per CPU, while the report goes on with its tables. Where fork is not
the way processes start (not Linux) or there is one CPU, they are drawn here, one by one.
"""

import multiprocessing
import os
import sys
from collections.abc import Callable
from pathlib import Path


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Drawing:
    """Figures being drawn: ``draw(plot, *args)`` starts one, ``wait()`` returns once every one
    is written."""

    def __init__(self):
        self._forked = sys.platform == "linux" and _cpus() > 1
        self._running: list[tuple[multiprocessing.Process, Callable, tuple]] = []

    def draw(self, plot: Callable, *args) -> Path:
        """``plot(*args)``, here or in a process of its own; returns the file it writes, ``args[-1]``."""
        if not self._forked:
            return Path(plot(*args))
        while len(self._running) >= _cpus():
            self._wait_first()
        proc = multiprocessing.get_context("fork").Process(target=plot, args=args, daemon=True)
        proc.start()
        self._running.append((proc, plot, args))
        return Path(args[-1])

    def _wait_first(self) -> None:
        proc, plot, args = self._running.pop(0)
        proc.join()
        if proc.exitcode != 0:  # drawn again here, so that its error is raised where the report runs
            plot(*args)

    def wait(self) -> None:
        while self._running:
            self._wait_first()
