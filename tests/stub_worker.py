"""A stand-in for the sweep's worker that imports no torch and measures nothing: it speaks the
worker's protocol (``lorabench.runtime.protocol.SWEEP``: its ``Env``, a ``Checked`` per strategy,
one ``Measured`` row per point, each after STUB_SLOW seconds), started as the real one is, under
``lorabench.runtime.lifeline``. The kill tests use it where what is under test is the sweep around
the worker, not the worker's timing. Its rows say where it ran (``host``; ``gpu_uuid`` from
CUDA_VISIBLE_DEVICES, as an executor pinned it) and ``triton_cache`` holds the TRITON_CACHE_DIR it
was given."""

import json
import os
import socket
import sys
import time

from lorabench.config.plan import Job
from lorabench.runtime.protocol import SWEEP, Measured
from lorabench.storage.checks import Checked
from lorabench.storage.row import Env, Row


def main() -> None:
    message = json.loads(sys.stdin.read())
    jobs = [Job.from_json(j) for j in message["jobs"]]
    SWEEP.emit(Env(device=jobs[0].device, git_sha=os.environ.get("LORABENCH_GIT_SHA")))
    for job in jobs:
        if job.check:
            SWEEP.emit(Checked(**job.config, correct=True, detail="stub"))
    for job in jobs:
        for p in job.points:
            time.sleep(float(os.environ.get("STUB_SLOW", "0")))
            SWEEP.emit(Measured(Row(
                run_id=job.run_id, started_at=job.started_at, argv=job.argv, **job.config, device=job.device,
                model=job.model.name, rank=job.rank, dtype=job.dtype, git_sha=os.environ.get("LORABENCH_GIT_SHA"),
                point=p.index, mode=p.mode, concurrency=p.concurrency, n_active=p.n_active, workload=p.workload,
                captured_counts=list(job.counts), capture_sizes=list(job.capture_sizes), num_graphs=len(job.counts),
                build_s=0.0, compile_s=0.0, capture_s=0.0, startup_s=0.0, status="ok", step_ms_median=1.0 + p.index,
                correct=True, host=socket.gethostname(), gpu_uuid=os.environ.get("CUDA_VISIBLE_DEVICES"),
                triton_cache=os.environ.get("TRITON_CACHE_DIR"))))


if __name__ == "__main__":
    main()
