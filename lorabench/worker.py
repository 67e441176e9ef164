"""One sweep worker: a fresh process per (kernels, max_loras, strategy), so that graph sets never
hide each other's memory. It reads its job (JSON) on stdin, builds the model, compiles, captures,
times every point of its plan, and writes one ``@@row {json}`` line per point on stdout as soon as
the point finishes (the parent writes the Parquet). A point that fails becomes a ``failed`` row
and the worker goes on; if the build or the capture fails, every point becomes a failed row.

Run as ``python -m lorabench.worker < job.json``.
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

from lorabench import env, roofline
from lorabench.batches import fixed_batch
from lorabench.check import check
from lorabench.dispatch import Dispatcher
from lorabench.kernels import SUPPORTED_DTYPES, TRITON_BACKENDS, TUNED, backend_of, fused_lora, get_backend, triton_lora, vllm_lora
from lorabench.model import LlamaLoRA, preset
from lorabench.strategies import BUCKET_GRID, capture_counts
from lorabench.timing import summarize, time_steps
from lorabench.vllm_rules import VllmRules, vllm_counts
from lorabench.workload import parse_workload

FIXED_BATCH_VARIANTS = 8  # fixed-mode points cycle through this many random batches of the same (c, n)

_STDOUT = sys.stdout


def emit(kind: str, payload: dict) -> None:
    _STDOUT.write(f"@@{kind} {json.dumps(payload)}\n")
    _STDOUT.flush()


def _inject(stage: str) -> None:
    """Test-only fault injection: LORABENCH_FAIL=build|capture|check|point:I|kill:I."""
    want = os.environ.get("LORABENCH_FAIL", "")
    if want == stage:
        raise RuntimeError(f"injected failure at {stage}")
    if want == "kill:" + stage.partition(":")[2] and stage.startswith("point:"):
        os.kill(os.getpid(), 9)


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()[:2000]


def _triton_cache_files() -> int:
    root = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return sum(1 for _ in root.rglob("*")) if root.exists() else 0


class Worker:
    def __init__(self, job: dict):
        self.job = job
        self.spec = job["spec"]
        self.cuda = self.spec["device"] == "cuda"
        self.cfg = cfg = preset(self.spec["model"], self.spec["layers"])
        self.max_loras = job["max_loras"]
        self.backend = backend_of(job["kernels"])
        self.vllm = self.backend == "vllm"
        if job["kernels"] in ("fused" + TUNED, "triton" + TUNED):
            from lorabench.tune_files import tuned_table

            (fused_lora if self.backend == "fused" else triton_lora).load_tuned(tuned_table(self.spec["tuned"]))
        if job.get("counts"):  # strategy auto: chosen when the sweep was planned
            self.counts = job["counts"]
        elif self.vllm:
            self.counts = vllm_counts(job["strategy"], self.max_loras)
        else:
            self.counts = capture_counts(job["strategy"], self.max_loras)
        auto = (self.spec.get("auto_sets") or {}).get(f"{job['kernels']}/{self.max_loras}") if job["strategy"] == "auto" else None
        self.predicted = auto and {(auto["workload"], int(c)): ms for c, ms in auto["predicted_ms"].items()}
        self.env = env.collect(self.spec["device"])
        self.common = {
            "run_id": job["run_id"], "started_at": job["started_at"], "argv": job["argv"],
            "seed": self.spec["seed"], **{k: self.env[k] for k in ("git_sha", "device", "gpu_name", "driver", "torch", "triton", "cuda")},
            "model": cfg.name, "layers": cfg.layers, "hidden": cfg.hidden, "rank": self.spec["rank"],
            "dtype": self.spec["dtype"], "kernels": job["kernels"], "max_loras": self.max_loras,
            "strategy": job["strategy"], "captured_counts": self.counts,
            "capture_sizes": self.spec["capture_sizes"], "context_len": self.spec["context_len"],
            "iters": self.spec["iters"], "warmup": self.spec["warmup"],
            "timing": "cuda_events" if self.cuda else "cpu_wall",
            "vllm": vllm_lora.version() if self.vllm else None,
            "tuned": self.spec.get("tuned") if job["kernels"].endswith(TUNED) else None,
            "pdl": (triton_lora.pdl_enabled(torch.device(self.spec["device"]))
                    if self.backend in ("triton", "fused") else None),
        }
        self.startup: dict = {}

    def point_row(self, point: dict) -> dict:
        return {**self.common, **self.startup, "point": point["point"], "mode": point["mode"],
                "concurrency": point["concurrency"], "n_active": point.get("n_active"),
                "workload": point.get("workload")}

    def fail_all(self, points, e: BaseException) -> None:
        for p in points:
            emit("row", {**self.point_row(p), "status": "failed", "error": _error(e)})

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def build(self) -> Dispatcher:
        spec, device = self.spec, self.spec["device"]
        self.startup["process_s"] = time.time() - self.job["spawned_at"]
        t0 = time.perf_counter()
        _inject("build")
        model = LlamaLoRA(
            self.cfg, max_loras=self.max_loras, rank=spec["rank"], max_tokens=max(spec["capture_sizes"] + spec["concurrency"]),
            context_len=spec["context_len"], dtype=SUPPORTED_DTYPES[spec["dtype"]], device=device, seed=spec["seed"],
        )
        rules = VllmRules(self.job["strategy"], self.max_loras, model.max_tokens, device) if self.vllm else None
        d = Dispatcher(model, get_backend(self.backend), max_loras=self.max_loras, capture_sizes=spec["capture_sizes"],
                       counts=self.counts, use_graphs=self.cuda, seed=spec["seed"], rules=rules,
                       bucket_grid=self.job["strategy"] in BUCKET_GRID)
        self.sync()
        build_s = time.perf_counter() - t0
        cache_before = _triton_cache_files()  # outside the timers: it walks the cache folder
        t1 = time.perf_counter()
        d.warm_up()
        compile_s = time.perf_counter() - t1
        compiled = self.backend in TRITON_BACKENDS and not os.environ.get("TRITON_INTERPRET")
        if self.cuda:
            torch.cuda.empty_cache()
            free0, reserved0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
        _inject("capture")
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
                self.startup.update(roofline.probe())  # the floor's bandwidth and per-kernel cost, this worker's
            except Exception:  # noqa: BLE001 - no probe, no roofline; the points still count
                traceback.print_exc()
        return d

    def check(self, d: Dispatcher) -> None:
        """The configuration's correctness verdict, carried by every row; emitted on its own too."""
        config = {k: self.job[k] for k in ("kernels", "max_loras", "strategy")}  # not analysis.CONFIG: no pandas here
        try:
            _inject("check")
            v = check(d, self.spec["dtype"], self.spec["seed"])
            verdict = {"correct": v.correct, "check_detail": v.detail, "check_max_err": v.max_err,
                       "check_batches": v.batches, "check_s": v.seconds}
            emit("check", {**config, **v.to_dict(), "num_graphs": d.num_graphs, "captured_counts": self.counts})
        except Exception as e:  # noqa: BLE001 - a check that cannot run is no verdict, not a lost sweep
            traceback.print_exc()
            verdict = {"correct": None, "check_detail": f"check did not run: {_error(e)}"}
            emit("check", {**config, "correct": None, "detail": verdict["check_detail"]})
        self.startup.update(verdict)

    def measure(self, d: Dispatcher, point: dict) -> dict:
        spec, c = self.spec, point["concurrency"]
        rng = random.Random(f"{spec['seed']}-{c}-{point.get('n_active')}-{point.get('workload')}")
        if point["mode"] == "fixed":
            n = point["n_active"]
            batches = [fixed_batch(c, n, self.max_loras, rng, base_tokens=c if n == 0 else 0)
                       for _ in range(FIXED_BATCH_VARIANTS)]
        else:
            wl = parse_workload(point["workload"])
            batches = [wl.sample(c, self.max_loras, rng) for _ in range(spec["iters"])]
        s = time_steps(d, batches, spec["iters"], spec["warmup"])
        stats = summarize(s.step_ms)
        row = {**self.point_row(point), **stats, "status": "ok",
               "graph_tokens": d.route(c, 0).tokens,
               "host_us_median": float(np.median(s.host_us)),
               "host_us_p90": float(np.percentile(s.host_us, 90)),
               "copy_us_median": float(np.median(s.copy_us)),
               "launch_us_median": float(np.median(s.launch_us)),
               "tokens_per_s": c / (stats["step_ms_median"] / 1e3),
               "n_active_mean": float(s.n_active.mean()), "graph_loras_mean": float(s.launch_counts.mean())}
        if self.predicted and point["mode"] == "workload":
            row["predicted_ms"] = self.predicted.get((point["workload"], c))
        if point["mode"] == "fixed":
            row["base_tokens"] = c if point["n_active"] == 0 else 0
            row["graph_loras"] = int(s.launch_counts[0])
        return row

    def run(self) -> None:
        points = self.job["points"]
        emit("env", self.env)
        try:
            d = self.build()
        except Exception as e:  # noqa: BLE001 - any build/compile/capture failure fails its points
            traceback.print_exc()
            self.fail_all(points, e)
            return
        if self.spec.get("check", True):
            self.check(d)
        for p in points:
            try:
                _inject(f"point:{p['point']}")
                emit("row", self.measure(d, p))
            except Exception as e:  # noqa: BLE001 - a failing point is a row, the sweep goes on
                traceback.print_exc()
                emit("row", {**self.point_row(p), "status": "failed", "error": _error(e)})


def main() -> None:
    sys.stdout = sys.stderr  # stdout carries rows only
    Worker(json.loads(sys.stdin.read())).run()


if __name__ == "__main__":
    main()
