"""One strategy of a worker's group (an ``Arm``): its dispatcher, once built, compiled and
captured, and the columns of its startup that its rows carry; and the way each arm's compile step
is made to load its Triton kernels as a fresh server process would (``forget_compiled``)."""

import os
import sys
from pathlib import Path

from lorabench.config.plan import Job
from lorabench.config.strategies import strategy
from lorabench.runtime.dispatch import Dispatcher
from lorabench.runtime.vllm_rules import vllm_counts


class Arm:
    """One job of the group (a strategy) in the worker: its dispatcher (None until built, and
    when its build failed) and its startup and verdict columns."""

    def __init__(self, job: Job):
        self.job = job
        self.label = job.label
        self.strategy = strategy(job.strategy)
        self.counts = list(job.counts)
        if self.label.vllm:  # vLLM's keys, from its runner's rules for the strategy
            self.counts = vllm_counts(self.strategy, job.max_loras)
        self.predicted = {(w, c): ms for w, c, ms in job.predicted_ms}
        self.dispatcher: Dispatcher | None = None
        self.startup: dict = {}  # its own columns: build, compile, capture, graphs, and its check's verdict


def triton_cache_files() -> int:
    root = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return sum(1 for _ in root.rglob("*")) if root.exists() else 0


def forget_compiled() -> None:
    """Drop the Triton kernels this process has loaded (never the disk cache), so that the next
    strategy's warm-up loads and launches its kernels as a fresh server process would: the
    strategies of a group share one process, and otherwise every one after the first would show
    a compile step that found everything in memory."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("lorabench.kernels", "vllm.lora")):
            continue
        for value in list(vars(module).values()):
            fn = value if isinstance(value, JITFunction) else getattr(value, "fn", None)
            caches = getattr(fn, "device_caches", None) if isinstance(fn, JITFunction) else None
            if caches is not None:
                caches.clear()
