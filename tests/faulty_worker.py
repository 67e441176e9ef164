"""A sweep worker with one fault injected, for the tests (``conftest.fault_injected``):
FAULT=build | capture | check | point:I (point I raises) | kill:I (SIGKILL at point I) |
slow:S (every point takes S seconds longer: the kill tests' stages stay observable)."""

import os
import time

from lorabench.runtime import worker
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
    measure = worker.Worker.measure

    def faulty_measure(self, d, point):
        if point.index == int(index):
            if stage == "kill":
                os.kill(os.getpid(), 9)
            boom(fault)
        return measure(self, d, point)

    worker.Worker.measure = faulty_measure
elif stage == "slow":
    measure = worker.Worker.measure

    def slow_measure(self, d, point):
        time.sleep(float(index))
        return measure(self, d, point)

    worker.Worker.measure = slow_measure
else:
    raise SystemExit(f"unknown FAULT {fault!r}")

if __name__ == "__main__":
    worker.main()
