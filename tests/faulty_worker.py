"""A sweep worker with one fault injected, for the tests (``conftest.fault_injected``):
FAULT=build | capture | check | point:I (point I raises) | kill:I (SIGKILL at point I) |
slow:S (every point takes S seconds longer: the kill tests' stages stay observable) |
loads:N (N timed adapter loads each way, not ``adapters.LOADS``: for sweeps of Triton kernels in
the CPU interpreter whose subject is not the load cost, where each load's step takes a second)."""

import functools
import os
import time

from lorabench.runtime import adapters, load_timing, worker
from lorabench.runtime.dispatch import Dispatcher


def boom(stage: str):
    raise RuntimeError(f"injected failure at {stage}")


fault = os.environ["FAULT"]
stage, _, index = fault.partition(":")
if fault == "build":
    worker.LlamaLoRA = lambda *a, **kw: boom("build")
elif fault == "capture":
    Dispatcher.capture = lambda self: boom("capture")
elif fault == "check":
    worker.check = lambda *a, **kw: boom("check")
elif stage in ("point", "kill"):
    turn = worker.Worker.turn

    def faulty_turn(self, arm, point, *args, **kwargs):
        if point.index == int(index):
            if stage == "kill":
                os.kill(os.getpid(), 9)
            boom(fault)
        return turn(self, arm, point, *args, **kwargs)

    worker.Worker.turn = faulty_turn
elif stage == "slow":
    measure = worker.Worker.measure

    def slow_measure(self, entries):
        time.sleep(float(index))
        return measure(self, entries)

    worker.Worker.measure = slow_measure
elif stage == "loads":
    load_timing.time_loads = functools.partial(adapters.time_loads, loads=int(index))
else:
    raise SystemExit(f"unknown FAULT {fault!r}")

if __name__ == "__main__":
    worker.main()
