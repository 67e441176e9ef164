"""Python's cyclic garbage collector around timed steps.

A worker holds its points' schedules: a serving loop of 16 000 steps is hundreds of thousands of
objects, and one full collection walks them all (~130 ms on a 2-core VM). vLLM freezes its heap
after startup (``gc.freeze()`` in its engine core) so that collections while serving walk only
what serving made since; ``frozen_heap`` does the same around timed steps, so a step is not timed
with a walk over the harness's own schedule. ``CollectorClock`` records the time collections take,
so that each step's samples say how much of its host time was the collector's (``gc_us``).
"""

import gc
import time
from contextlib import contextmanager


@contextmanager
def frozen_heap():
    """Every object the collector tracks now is left out of its collections until the block
    ends (``gc.freeze``: a list moved), then handed back (``gc.unfreeze``). The young generations
    are collected first (about a millisecond): garbage frozen with them would rejoin the oldest
    generation after, uncounted, and wait for a full collection. Under a freeze already made
    (``gc.get_freeze_count()``), nothing is done: unfreezing would thaw the outer one's objects."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect(1)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class CollectorClock:
    """The nanoseconds the collector ran since the clock was made, read with ``ns()``; a
    ``gc.callbacks`` entry while the ``with`` block runs."""

    def __init__(self):
        self.total = 0
        self._started: int | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter_ns()
        elif self._started is not None:
            self.total += time.perf_counter_ns() - self._started
            self._started = None

    def ns(self) -> int:
        return self.total

    def __enter__(self) -> "CollectorClock":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)
