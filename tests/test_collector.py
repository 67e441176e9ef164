"""Python's collector around timed steps (``runtime.collector``): the heap frozen while steps run
and thawed after, and the collector's time inside each step recorded as ``gc_us``."""

import gc
import time
from types import SimpleNamespace

import pytest

from lorabench.runtime.collector import CollectorClock, frozen_heap
from lorabench.runtime.timing import time_steps


def test_the_heap_is_frozen_in_the_block_and_thawed_after_even_on_error():
    before = gc.get_freeze_count()
    kept = [[i] for i in range(1000)]  # tracked containers, alive through the block
    with frozen_heap():
        assert gc.get_freeze_count() >= before + len(kept)
    assert gc.get_freeze_count() == before
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("boom")
    assert gc.get_freeze_count() == before


def test_a_freeze_made_outside_is_left_as_it_was():
    gc.freeze()
    try:
        outer = gc.get_freeze_count()
        with frozen_heap():
            assert gc.get_freeze_count() == outer
        assert gc.get_freeze_count() == outer
    finally:
        gc.unfreeze()


def test_garbage_made_between_freezes_is_still_collected():
    """Many short freezes (one a turn) with cycles made between them: the cycles are freed, not
    parked in the oldest generation until a full collection."""
    gc.collect()
    base = len(gc.get_objects())
    for _ in range(200):
        for _ in range(50):
            a = []
            a.append(a)
        with frozen_heap():
            pass
    del a
    assert len(gc.get_objects()) - base < 500


def test_the_clock_counts_collections_only_while_it_is_entered():
    callbacks = len(gc.callbacks)
    with CollectorClock() as clock:
        assert clock.ns() == 0 or clock.ns() > 0  # an automatic collection may already have run
        start = clock.ns()
        gc.collect()
        assert clock.ns() > start
    assert len(gc.callbacks) == callbacks
    after = clock.ns()
    gc.collect()
    assert clock.ns() == after


class CollectingDispatcher:
    """A dispatcher whose second step runs a full collection (as a gen-2 collection would land in a
    step's launch), noting the freeze count and how long the collection took."""

    use_graphs = False

    def __init__(self):
        self.steps, self.frozen, self.collect_us = 0, [], 0.0

    def prepare_step(self, batch):
        return SimpleNamespace(route=None, layout=None, n_active=1, batch_tokens=len(batch))

    def load(self, prep):
        pass

    def run(self, route, layout):
        self.frozen.append(gc.get_freeze_count())
        if self.steps == 1:
            for _ in range(20000):  # garbage made in the step: cycles only the collector frees
                a = []
                a.append(a)
            t = time.perf_counter_ns()
            gc.collect()
            self.collect_us = (time.perf_counter_ns() - t) / 1e3
        self.steps += 1

    def grid_of(self, route):
        return 1


def test_timed_steps_run_on_a_frozen_heap_and_record_the_collectors_time():
    kept = [[i] for i in range(1000)]
    before = gc.get_freeze_count()
    d = CollectingDispatcher()
    s = time_steps(d, [[0], [0, 1], [1]], 3, 0)
    assert all(f >= before + len(kept) for f in d.frozen) and gc.get_freeze_count() == before
    assert s.gc_us[1] >= d.collect_us * 0.5 > 0  # the step's collection, within its host work
    assert s.gc_us[1] <= s.launch_us[1] + 1 and (s.gc_us >= 0).all()
