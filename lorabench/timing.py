"""Timing decode steps through the dispatcher, and the statistics every row reports.

GPU time: a CUDA event before and after each launch, the stream synchronised after every step
(as a server that reads back sampled tokens does), so each sample is one step's device time
including its graph launch latency. Host time, per step, in three parts: ``host`` = building the
batch metadata and choosing the graph; ``copy`` = the call that queues the metadata's copy to the
device; ``launch`` = the graph replay call. On the CPU the step time is the eager step's wall time.
"""

import time
from dataclasses import dataclass

import numpy as np
import torch

from lorabench.dispatch import Dispatcher

NOISY_IQR = 0.10  # IQR / median at or above this flags a point as noisy


@dataclass
class StepSamples:
    step_ms: np.ndarray
    host_us: np.ndarray
    copy_us: np.ndarray
    launch_us: np.ndarray
    n_active: np.ndarray
    launch_counts: np.ndarray


def time_steps(d: Dispatcher, batches: list[list[int]], iters: int, warmup: int) -> StepSamples:
    """Run ``warmup`` then ``iters`` steps, cycling through ``batches``."""
    cuda = d.use_graphs
    for i in range(warmup):
        d.launch(d.prepare(batches[i % len(batches)]))
    if cuda:
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    step_ms, host_us, copy_us, launch_us = (np.empty(iters) for _ in range(4))
    n_active, launches = np.empty(iters, dtype=np.int64), np.empty(iters, dtype=np.int64)
    clock = time.perf_counter_ns
    for i in range(iters):
        slots = batches[i % len(batches)]
        t0 = clock()
        prep = d.prepare(slots)
        tc = clock()
        d.load(prep)
        t1 = clock()
        if cuda:
            start, end = events[i]
            start.record()
            d.run(prep.route)
            end.record()
            t2 = clock()
            end.synchronize()
        else:
            d.run(prep.route)
            t2 = clock()
            step_ms[i] = (t2 - t1) / 1e6
        host_us[i], copy_us[i], launch_us[i] = (tc - t0) / 1e3, (t1 - tc) / 1e3, (t2 - t1) / 1e3
        n_active[i], launches[i] = prep.n_active, d.grid_of(prep.route)
    if cuda:
        step_ms[:] = [s.elapsed_time(e) for s, e in events]
    return StepSamples(step_ms, host_us, copy_us, launch_us, n_active, launches)


def summarize(step_ms: np.ndarray) -> dict:
    p10, p25, p50, p75, p90, p99 = np.percentile(step_ms, [10, 25, 50, 75, 90, 99])
    iqr = p75 - p25
    return {
        "step_ms_median": float(p50),
        "step_ms_p10": float(p10),
        "step_ms_p90": float(p90),
        "step_ms_p99": float(p99),
        "step_ms_mean": float(step_ms.mean()),
        "step_ms_std": float(step_ms.std(ddof=1)) if len(step_ms) > 1 else 0.0,
        "step_ms_iqr": float(iqr),
        "noisy": bool(iqr / p50 >= NOISY_IQR) if p50 > 0 else True,
    }
