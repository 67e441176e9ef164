"""What a worker's environment gets from the sweep: the caller's OMP_NUM_THREADS (torch sizes its CPU
thread pool by it; a Dask worker would otherwise impose its own, 1) and the code's version, whichever
executor starts it."""

import os
import subprocess
import sys

from rich.console import Console

from lorabench.commands.sweep import WORKER
from lorabench.commands.sweep_run import Sweep
from lorabench.config.flags import Machine
from lorabench.config.spec import build_spec


def test_the_callers_omp_num_threads_reaches_every_worker(tmp_path, monkeypatch):
    spec, _ = build_spec({"device": "cpu", "out": str(tmp_path), "concurrency": "1", "max_loras": "1",
                          "strategy": "max"}, None, Machine(cuda=False))
    run = Sweep.start(spec, "lorabench sweep", Console(file=open(os.devnull, "w")), WORKER)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert run.worker_env(run.jobs[0])["OMP_NUM_THREADS"] == "3"
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert "OMP_NUM_THREADS" not in run.worker_env(run.jobs[0])  # torch's own default: every core


def test_torch_takes_its_cpu_threads_from_omp_num_threads():
    code = "import torch; print(torch.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
    assert out.strip() == "1"
