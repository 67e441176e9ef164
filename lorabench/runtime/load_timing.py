"""A worker's timed adapter loads: vLLM's per-slice load in a step and alone
(``lorabench.runtime.adapters.time_loads``), then every other path
(``lorabench.runtime.load_paths``); the row columns they give every row of the worker, and their
samples sent to the sweep (``Loads``). A load that cannot be timed leaves its columns out: the
fixed points still count."""

import traceback
from collections.abc import Callable, Sequence

import numpy as np

from lorabench.config.peft import PeftAdapter
from lorabench.runtime.adapters import AdapterLoader, time_loads
from lorabench.runtime.dispatch import Dispatcher
from lorabench.runtime.load_paths import columns as load_path_columns
from lorabench.runtime.load_paths import samples as load_path_samples
from lorabench.runtime.load_paths import time_load_paths
from lorabench.runtime.model import LlamaLoRA
from lorabench.runtime.protocol import SWEEP
from lorabench.stats import median_interval
from lorabench.storage.steps import Loads


def timed_loads(model: LlamaLoRA, d: Dispatcher, adapters: Sequence[PeftAdapter], kernels: str, max_loras: int,
                sync: Callable[[], None]) -> tuple[AdapterLoader | None, dict]:
    """The loader (None when it cannot load: the worker's residency points fail) and the
    ``load_*`` columns, each load timed in a step of ``d`` and alone; the slots hold adapter i
    again after."""
    try:
        loader = AdapterLoader(model, adapters=adapters)
        t = time_loads(loader, d)
        loader.restore()  # the timed loads moved the user's adapters: slot i holds adapter i again
        sync()
    except Exception:  # noqa: BLE001 - no load cost, no residency runs; the fixed points still count
        traceback.print_exc()
        return None, {}
    interval = median_interval(t["load_ms"])
    columns = dict(load_ms_median=float(np.median(t["load_ms"])), load_alone_ms_median=float(np.median(t["alone_ms"])),
                   load_host_us_median=float(np.median(t["host_us"])), load_ops=loader.ops,
                   load_ms_ci_low=interval.low if interval else None, load_ms_ci_high=interval.high if interval else None)
    SWEEP.emit(Loads(kernels, max_loras, t["load_ms"].tolist(), t["alone_ms"].tolist(), t["host_us"].tolist()))
    return loader, {**columns, **_other_paths(loader, d, adapters, kernels, max_loras, sync)}


def _other_paths(loader: AdapterLoader, d: Dispatcher, adapters: Sequence[PeftAdapter], kernels: str, max_loras: int,
                 sync: Callable[[], None]) -> dict:
    """The other load paths' columns, their samples sent. A path that cannot be timed leaves its
    columns empty; vLLM's path still prices the runs."""
    files = [a.weights for a in adapters]
    try:
        paths = time_load_paths(loader, d, files)
        sync()
        columns = load_path_columns(paths, files, loader)
        samples = load_path_samples(paths)
    except Exception:  # noqa: BLE001 - extra columns only
        traceback.print_exc()
        try:
            loader.restore()  # slots a failed load left unknown are loaded again
            sync()
        except Exception:  # noqa: BLE001 - the device itself failed: the points will say so
            traceback.print_exc()
        return {}
    for path, (load_ms, alone_ms, host_us) in samples.items():
        SWEEP.emit(Loads(kernels, max_loras, load_ms, alone_ms, host_us, path))
    return columns
