"""Timing on the device, and the statistics every row reports.

One CUDA-graph timer serves the sweep, the tune, the roofline probe and linear_bench: CUDA
events around graph replays, read after the last one. (Written here rather than taken from
``triton.testing.do_bench``: a decode step is timed as a server runs it, the metadata copied in
and the stream synced after every step, and the host's share of each step measured beside it.)

Sweep steps (``time_steps``): a CUDA event before and after each launch, the stream synchronised
after every step (as a server that reads back sampled tokens does), so each sample is one step's
device time including its graph launch latency. Host time, per step, in three parts: ``host`` =
building the batch metadata and choosing the graph; ``copy`` = the call that queues the
metadata's copy to the device; ``launch`` = the graph replay call. On the CPU the step time is
the eager step's wall time.

Mixed steps (``MixedBatch``: prefill points) replay their PIECEWISE graphs with attention run
eagerly between them, or run eagerly past the largest mixed size; ``launch`` then covers the whole
step's host work, attention's launches included, and the step's events enclose it.

Residency steps (``loads`` given) load adapters into slots before the replay, as vLLM does before a
step that needs them: their CUDA events enclose the loads and the replay (the metadata's copy is
queued before, as for every step), so each sample is the whole step a request waits for; ``copy``
then includes queueing the loads.
"""

import time
from dataclasses import dataclass

import numpy as np
import torch

from lorabench.runtime.dispatch import Dispatcher, MixedBatch

NOISY_IQR = 0.10  # IQR / median at or above this flags a point as noisy


class Events:
    """``n`` pairs of CUDA events: ``start(i)`` / ``stop(i)`` around sample i, ``ms()`` reads all."""

    def __init__(self, n: int):
        self.pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]

    def start(self, i: int) -> None:
        self.pairs[i][0].record()

    def stop(self, i: int) -> None:
        self.pairs[i][1].record()

    def wait(self, i: int) -> None:
        """Block the host until the device has reached sample i's end."""
        self.pairs[i][1].synchronize()

    def ms(self) -> np.ndarray:
        torch.cuda.synchronize()
        return np.array([s.elapsed_time(e) for s, e in self.pairs])


def replay_times(graph: "torch.cuda.CUDAGraph", replays: int, warmup: int = 0, wait_each: bool = False) -> np.ndarray:
    """Milliseconds of each of ``replays`` replays after ``warmup`` untimed ones. ``wait_each``:
    the host waits for every replay before the next (its launch latency in every sample);
    otherwise replays queue back to back."""
    for _ in range(warmup):
        graph.replay()
    events = Events(replays)
    for i in range(replays):
        events.start(i)
        graph.replay()
        events.stop(i)
        if wait_each:
            events.wait(i)
    return events.ms()


def replay_ms(graph: "torch.cuda.CUDAGraph") -> float:
    """One replay of a CUDA graph between CUDA events, waited for (ms)."""
    return float(replay_times(graph, 1, wait_each=True)[0])


def alternating_replays(graphs: dict, turns: int, warmup: int = 3) -> dict:
    """Each graph's times (ms) over ``turns`` turns, one waited-for replay of every graph per turn,
    after ``warmup`` untimed turns: graphs compared side by side see the same GPU state (clocks,
    L2) turn by turn. The benches' comparison loop (``scripts/gemm_bench.py``, ``catk_probe.py``)."""
    for g in list(graphs.values()) * warmup:
        g.replay()
    times = {name: [] for name in graphs}
    for _ in range(turns):
        for name, g in graphs.items():
            times[name].append(replay_ms(g))
    return {name: np.array(t) for name, t in times.items()}


@dataclass
class StepSamples:
    step_ms: np.ndarray
    host_us: np.ndarray
    copy_us: np.ndarray
    launch_us: np.ndarray
    n_active: np.ndarray
    launch_counts: np.ndarray
    tokens: np.ndarray
    loads: np.ndarray
    reads: np.ndarray
    read_bytes: np.ndarray


def time_steps(d: Dispatcher, batches: list[list[int]] | list[MixedBatch], iters: int, warmup: int, first: int = 0,
               loads: list[list[tuple[int, int]]] | None = None, loader=None,
               start_slots: list[int] | None = None, reads: list[list[int]] | None = None,
               storage=None) -> StepSamples:
    """Run ``warmup`` untimed steps, then ``iters`` timed ones over ``batches[first:]``, cycling
    (``first``: where a strategy's previous turn at this point left off). ``loads``: per batch,
    the (slot, adapter) pairs ``loader`` (``lorabench.runtime.adapters.AdapterLoader``, or a
    load path's) loads within that step, after its metadata's copy and before its replay;
    ``start_slots``: what the slots hold when the timed steps start (``loader.place``, untimed,
    after the warm-up). ``reads``: per batch, the adapters whose files ``storage``
    (``lorabench.runtime.load_paths.StorageReads``) reads before the step's loads, inside its
    events, their pages dropped from the page cache before the step (untimed): the timed steps'
    CPU-cache misses (the warm-up reads nothing)."""
    cuda = d.use_graphs
    for i in range(warmup):
        k = (first + i) % len(batches)
        for slot, adapter in loads[k] if loads else ():
            loader.load(slot, adapter)
        d.launch(d.prepare_step(batches[k]))
    if start_slots is not None:
        loader.place(start_slots)
    if cuda:
        torch.cuda.synchronize()
        events = Events(iters)
    step_ms, host_us, copy_us, launch_us = (np.empty(iters) for _ in range(4))
    n_active, launches, tokens, loaded, read, read_bytes = (np.zeros(iters, dtype=np.int64) for _ in range(6))
    clock = time.perf_counter_ns
    for i in range(iters):
        k = (first + i) % len(batches)
        missed = reads[k] if reads else ()
        for adapter in missed:
            storage.drop(adapter)
        t0 = clock()
        prep = d.prepare_step(batches[k])
        tc = clock()
        d.load(prep)
        if cuda:
            events.start(i)
        t_start = clock()
        for adapter in missed:  # read from storage first, as vLLM reads a missed adapter before activating it
            read_bytes[i] += storage.read(adapter)
        t_read = clock()
        for slot, adapter in loads[k] if loads else ():  # the step's loads: inside its events, as it waits for them
            loader.load(slot, adapter)
        t1 = clock()
        d.run(prep.route, prep.layout)
        if cuda:
            events.stop(i)
        t2 = clock()
        if cuda:
            events.wait(i)
        else:
            step_ms[i] = (t2 - t_start) / 1e6
        host_us[i], launch_us[i] = (tc - t0) / 1e3, (t2 - t1) / 1e3
        copy_us[i] = (t1 - tc - (t_read - t_start)) / 1e3  # the metadata's copy and the loads, not the storage reads
        n_active[i], launches[i], tokens[i] = prep.n_active, d.grid_of(prep.route), prep.batch_tokens
        loaded[i], read[i] = len(loads[k]) if loads else 0, len(missed)
    if cuda and iters:
        step_ms[:] = events.ms()
    return StepSamples(step_ms, host_us, copy_us, launch_us, n_active, launches, tokens, loaded, read, read_bytes)


def summarize(step_ms: np.ndarray) -> dict:
    """The row's statistics of one point's step times; ``noisy_iqr`` says why the point is noisy
    (an IQR at or above NOISY_IQR of the median), None when it is not."""
    p10, p25, p50, p75, p90, p99 = np.percentile(step_ms, [10, 25, 50, 75, 90, 99])
    iqr = p75 - p25
    wide = iqr / p50 >= NOISY_IQR if p50 > 0 else True
    return {
        "step_ms_median": float(p50),
        "step_ms_p10": float(p10),
        "step_ms_p90": float(p90),
        "step_ms_p99": float(p99),
        "step_ms_mean": float(step_ms.mean()),
        "step_ms_std": float(step_ms.std(ddof=1)) if len(step_ms) > 1 else 0.0,
        "step_ms_iqr": float(iqr),
        "noisy_iqr": (f"IQR {100 * iqr / p50:.0f} % of the median" if p50 > 0 else "median 0") if wide else None,
    }
