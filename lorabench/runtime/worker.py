"""One worker process per (kernels, max_loras, strategy): builds the model, compiles, captures,
times every point of its job, and writes one ``@@row {json}`` line per point on stdout as soon
as the point finishes (the parent writes the Parquet). A point that fails becomes a ``failed``
row and the worker goes on; if the build or the capture fails, every point becomes a failed row.

Run as ``python -m lorabench.runtime.worker < job.json`` (a ``lorabench.config.plan.Job``); the
sweep runs it through ``python -m lorabench.runtime.lifeline SWEEP_PID lorabench.runtime.worker``.
"""

import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from lorabench.config.batches import fixed_batch
from lorabench.config.models import preset
from lorabench.config.plan import FIXED, WORKLOAD, Job, Point
from lorabench.config.strategies import strategy
from lorabench.config.workload import parse_workload
from lorabench.kernels import BACKENDS, get_backend
from lorabench.runtime import env
from lorabench.runtime.check import check
from lorabench.runtime.dispatch import Dispatcher
from lorabench.runtime.model import LlamaLoRA
from lorabench.runtime.probe import probe
from lorabench.runtime.timing import summarize, time_steps
from lorabench.runtime.vllm_rules import VllmRules, vllm_counts
from lorabench.storage.tune_files import tuned_table

FIXED_BATCH_VARIANTS = 8  # fixed-mode points cycle through this many random batches of the same (c, n)

_STDOUT = sys.stdout


def emit(kind: str, payload: dict) -> None:
    _STDOUT.write(f"@@{kind} {json.dumps(payload)}\n")
    _STDOUT.flush()


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()[:2000]


def _triton_cache_files() -> int:
    root = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return sum(1 for _ in root.rglob("*")) if root.exists() else 0


class Worker:
    def __init__(self, job: Job, spawned_at: float):
        self.job, self.spawned_at = job, spawned_at
        self.cuda = job.device == "cuda"
        self.cfg = cfg = preset(job.model, job.layers)
        self.label = job.label
        self.backend = get_backend(self.label.backend)
        if self.label.tuned and hasattr(self.backend, "load_tuned"):  # lorabench's kernels (vLLM reads its own folder)
            self.backend.load_tuned(tuned_table(job.tuned))
        self.counts = list(job.counts)
        if self.label.vllm:  # vLLM's keys, from its runner's rules for the strategy
            self.counts = vllm_counts(strategy(job.strategy), job.max_loras)
        self.predicted = {(w, c): ms for w, c, ms in job.predicted_ms}
        self.env = env.collect(job.device)
        self.common = {
            "run_id": job.run_id, "started_at": job.started_at, "argv": job.argv, "seed": job.seed,
            **{k: self.env[k] for k in ("git_sha", "device", "gpu_name", "driver", "torch", "triton", "cuda")},
            "model": cfg.name, "layers": cfg.layers, "hidden": cfg.hidden, "rank": job.rank, "dtype": job.dtype,
            **job.config, "captured_counts": self.counts, "capture_sizes": list(job.capture_sizes),
            "context_len": job.context_len, "iters": job.iters, "warmup": job.warmup,
            "timing": "cuda_events" if self.cuda else "cpu_wall",
            "vllm": self.backend.version() if self.label.vllm else None,
            "tuned": job.tuned,
            "pdl": (self.backend.pdl_enabled(torch.device(job.device))  # lorabench's Triton kernels
                    if hasattr(self.backend, "pdl_enabled") else None),
        }
        self.startup: dict = {}

    def point_row(self, point: Point) -> dict:
        return {**self.common, **self.startup, "point": point.index, "mode": point.mode,
                "concurrency": point.concurrency, "n_active": point.n_active, "workload": point.workload}

    def fail_all(self, e: BaseException) -> None:
        for p in self.job.points:
            emit("row", {**self.point_row(p), "status": "failed", "error": _error(e)})

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def build(self) -> Dispatcher:
        job = self.job
        self.startup["process_s"] = time.time() - self.spawned_at
        t0 = time.perf_counter()
        model = LlamaLoRA(self.cfg, max_loras=job.max_loras, rank=job.rank, max_tokens=job.max_tokens,
                          context_len=job.context_len, dtype=getattr(torch, job.dtype), device=job.device, seed=job.seed)
        rules = VllmRules(strategy(job.strategy), job.max_loras, model.max_tokens, job.device) if self.label.vllm else None
        d = Dispatcher(model, self.backend, max_loras=job.max_loras, capture_sizes=list(job.capture_sizes),
                       counts=self.counts, use_graphs=self.cuda, seed=job.seed, rules=rules,
                       bucket_grid=job.bucket_grid)
        self.sync()
        build_s = time.perf_counter() - t0
        cache_before = _triton_cache_files()  # outside the timers: it walks the cache folder
        t1 = time.perf_counter()
        d.warm_up()
        compile_s = time.perf_counter() - t1
        compiled = BACKENDS[self.label.backend].triton and not os.environ.get("TRITON_INTERPRET")
        if self.cuda:
            torch.cuda.empty_cache()
            free0, reserved0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
        t2 = time.perf_counter()
        d.capture()
        capture_s = time.perf_counter() - t2
        self.startup.update(
            build_s=build_s, compile_s=compile_s, capture_s=capture_s, startup_s=build_s + compile_s + capture_s,
            num_graphs=d.num_graphs, lora_bytes_per_slot=model.lora_bytes_per_slot(),
            triton_cache=("cold" if _triton_cache_files() > cache_before else "warm") if compiled else None,
        )
        if self.cuda:
            self.startup["graph_mem_bytes"] = free0 - torch.cuda.mem_get_info()[0]
            self.startup["pool_bytes"] = torch.cuda.memory_reserved() - reserved0
            try:
                self.startup.update(probe())  # the floor's bandwidth and per-kernel cost, this worker's
            except Exception:  # noqa: BLE001 - no probe, no roofline; the points still count
                traceback.print_exc()
        return d

    def check(self, d: Dispatcher) -> None:
        """The configuration's correctness verdict, carried by every row; emitted on its own too."""
        try:
            v = check(d, self.job.dtype, self.job.seed)
            verdict = {"correct": v.correct, "check_detail": v.detail, "check_max_err": v.max_err,
                       "check_batches": v.batches, "check_s": v.seconds}
            emit("check", {**self.job.config, **v.to_dict(), "num_graphs": d.num_graphs, "captured_counts": self.counts})
        except Exception as e:  # noqa: BLE001 - a check that cannot run is no verdict, not a lost sweep
            traceback.print_exc()
            verdict = {"correct": None, "check_detail": f"check did not run: {_error(e)}"}
            emit("check", {**self.job.config, "correct": None, "detail": verdict["check_detail"]})
        self.startup.update(verdict)

    def measure(self, d: Dispatcher, point: Point) -> dict:
        job, c = self.job, point.concurrency
        rng = random.Random(f"{job.seed}-{c}-{point.n_active}-{point.workload}")
        if point.mode == FIXED:
            n = point.n_active
            batches = [fixed_batch(c, n, job.max_loras, rng, base_tokens=c if n == 0 else 0)
                       for _ in range(FIXED_BATCH_VARIANTS)]
        else:
            wl = parse_workload(point.workload)
            batches = [wl.sample(c, job.max_loras, rng) for _ in range(job.iters)]
        s = time_steps(d, batches, job.iters, job.warmup)
        stats = summarize(s.step_ms)
        row = {**self.point_row(point), **stats, "status": "ok",
               "graph_tokens": d.route(c, 0).tokens,
               "host_us_median": float(np.median(s.host_us)),
               "host_us_p90": float(np.percentile(s.host_us, 90)),
               "copy_us_median": float(np.median(s.copy_us)),
               "launch_us_median": float(np.median(s.launch_us)),
               "tokens_per_s": c / (stats["step_ms_median"] / 1e3),
               "n_active_mean": float(s.n_active.mean()), "graph_loras_mean": float(s.launch_counts.mean())}
        if self.predicted and point.mode == WORKLOAD:
            row["predicted_ms"] = self.predicted.get((point.workload, c))
        if point.mode == FIXED:
            row["base_tokens"] = c if point.n_active == 0 else 0
            row["graph_loras"] = int(s.launch_counts[0])
        return row

    def run(self) -> None:
        emit("env", self.env)
        try:
            d = self.build()
        except Exception as e:  # noqa: BLE001 - any build/compile/capture failure fails its points
            traceback.print_exc()
            self.fail_all(e)
            return
        if self.job.check:
            self.check(d)
        for p in self.job.points:
            try:
                emit("row", self.measure(d, p))
            except Exception as e:  # noqa: BLE001 - a failing point is a row, the sweep goes on
                traceback.print_exc()
                emit("row", {**self.point_row(p), "status": "failed", "error": _error(e)})


def main() -> None:
    """Read the job from stdin (``{"job": ..., "spawned_at": ...}``) and run it. The sweep runs
    it under ``lorabench.runtime.lifeline``, which ends it when the sweep is gone."""
    sys.stdout = sys.stderr  # stdout carries rows only
    message = json.loads(sys.stdin.read())
    Worker(Job.from_json(message["job"]), message["spawned_at"]).run()


if __name__ == "__main__":
    main()
