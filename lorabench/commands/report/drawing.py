"""The report's figures drawn side by side: a figure takes a few tenths of a second of matplotlib
(its layout, its text, its pixels), so where CPUs are to spare each is drawn in a process of its
own, forked from the report's once its inputs are ready (the imports, frames and decisions are
already there: nothing is pickled), one per spare CPU, while the report goes on with its tables.

A forked figure costs more CPU than one drawn here (its process copies the pages it touches and
warms matplotlib's caches again: 2.3 s against 1.8 s for results/card's six), so with fewer than
two CPUs to spare (one is the report's), or where processes do not start by fork (not Linux),
the figures are drawn here, one by one.
"""

import gc
import multiprocessing
import os
import sys
from collections.abc import Callable
from pathlib import Path


def spare_cpus() -> int:
    """The CPUs this process may use, less the report's own."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cpus - 1


class Drawing:
    """Figures being drawn: ``draw(plot, *args)`` starts one, ``wait()`` returns once every one
    is written. ``workers``: how many at once beside the report (default: the spare CPUs); below
    two, each is drawn when asked, here."""

    def __init__(self, workers: int | None = None):
        self.workers = spare_cpus() if workers is None else workers
        self._forked = sys.platform == "linux" and self.workers >= 2
        self._running: list[tuple[multiprocessing.Process, Callable, tuple]] = []

    def draw(self, plot: Callable, *args) -> Path:
        """``plot(*args)``, here or in a process of its own; returns the file it writes, ``args[-1]``."""
        if not self._forked:
            return Path(plot(*args))
        if not self._running:
            gc.freeze()  # the collector leaves the report's objects alone in the children: their pages stay shared
        while len(self._running) >= self.workers:
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
        try:
            while self._running:
                self._wait_first()
        finally:
            gc.unfreeze()
