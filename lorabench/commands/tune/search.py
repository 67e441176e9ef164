"""The search: per shape the default config runs first (its output is the reference every
candidate must match, its time the baseline); candidates follow in a seeded random order until
the shape's share of the budget is spent (at least one runs). One that raises is pruned, one
whose output differs is ``wrong``. Every measurement is appended to ``OUT/cache.jsonl`` as it
is made, so a rerun resumes where the last one stopped; the outputs are rewritten after every
shape.

Timing: on a GPU, ``LAUNCHES`` back-to-back launches captured in one CUDA graph (how serving runs
them), replayed under CUDA events (``lorabench.runtime.timing``): per-launch median, p10, p90;
lorabench's kernels without PDL, so each launch's full latency is timed. On the CPU, the
interpreter's wall time per call, labelled ``cpu_wall``: CPU figures, never GPU results.
"""

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from rich.progress import Progress

from lorabench.commands.tune.backends import TUNERS, TuneBackend
from lorabench.commands.tune.output import (
    lorabench_entries,
    markdown,
    summarise,
    vllm_best,
)
from lorabench.commands.tune.shapes import Shape, build_shapes, candidates
from lorabench.config.tolerance import TOLERANCE
from lorabench.config.tune_spec import TuneSpec
from lorabench.errors import UserError
from lorabench.runtime import env
from lorabench.runtime.graphs import capture_graph
from lorabench.runtime.timing import replay_times
from lorabench.storage.tune_files import TUNED_FILE, vllm_folder, write_json, write_vllm

LAUNCHES, REPLAYS, CPU_CALLS = 20, 100, 3


def _stats(us, timing: str) -> dict:
    p10, p50, p90 = np.percentile(np.asarray(us), [10, 50, 90])
    return {"us": float(p50), "p10_us": float(p10), "p90_us": float(p90), "timing": timing}


def time_cuda(fn, launches: int = LAUNCHES, replays: int = REPLAYS) -> dict:
    """``launches`` calls captured in one CUDA graph, replayed ``replays`` times under events."""
    graph = capture_graph(fn, lambda: [fn() for _ in range(launches)])
    return _stats(replay_times(graph, replays, warmup=5) * 1e3 / launches, "cuda_graph")


def time_cpu(fn, calls: int = CPU_CALLS) -> dict:
    us = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        us.append((time.perf_counter() - t0) * 1e6)
    return _stats(us, "cpu_wall")


@contextmanager
def pdl_off():
    """lorabench's kernels without PDL (``LORABENCH_PDL=0``, read at every launch): back-to-back
    PDL launches of one kernel overlap one another, which times their throughput, not the
    latency a decode step waits for."""
    old = os.environ.get("LORABENCH_PDL")
    os.environ["LORABENCH_PDL"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LORABENCH_PDL", None)
        else:
            os.environ["LORABENCH_PDL"] = old


def measure(backend: TuneBackend, problem, cfg: dict, ref: torch.Tensor | None, tol: float, timer) -> tuple[dict, torch.Tensor | None]:
    """Run ``cfg`` once from a zeroed output, compare with ``ref``, then time it. Returns the
    row's result fields and the output (None unless it ran)."""
    try:
        with backend.configured(problem, cfg):
            fn = backend.launcher(problem, cfg)
            problem.output.zero_()
            fn()
            out = problem.output.clone()  # ordered after the launch on the device
            if ref is not None:
                err = float((out.float() - ref.float()).abs().max())
                if not err <= tol * max(1.0, float(ref.float().abs().max())):
                    return {"status": "wrong", "error": f"max |diff| {err:.3g} vs the default's output"}, out
            return {"status": "ok", **timer(fn)}, out
    except Exception as e:  # noqa: BLE001 - any failure to compile or run prunes the config
        return {"status": "pruned", "error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"}, None


def _cid(cfg: dict) -> str:
    return json.dumps(cfg, sort_keys=True)


class Cache:
    """OUT/cache.jsonl: one line per measured (shape, config), appended the moment it exists.
    Rows of another device, GPU or dtype, and rows of lorabench's kernels timed from other kernel
    sources (``revs``: kernel -> its backend's ``revision``), are kept in the file and ignored."""

    def __init__(self, path: Path, identity: dict, fresh: bool, revs: dict[str, str | None] | None = None):
        self.path, self.identity, self.revs = path, identity, revs or {}
        if fresh and path.exists():
            path.replace(path.with_name(path.name + ".prev"))
        self.rows = [r for r in self._read() if all(r.get(k) == v for k, v in identity.items())
                     and r.get("kernels_rev") == self.revs.get(r.get("kernel"))]

    def _read(self) -> list[dict]:
        rows = []
        for line in self.path.read_text().splitlines() if self.path.exists() else []:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by an interrupt
                pass
        return rows

    def of(self, shape: Shape) -> list[dict]:
        key = list(shape.key)
        return [r for r in self.rows if (r["kernel"], r["op"], r["shape"]) == (shape.kernel, shape.op, key)]

    def append(self, row: dict) -> None:
        row = {**row, **self.identity, "kernels_rev": self.revs.get(row["kernel"])}
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


class Tuner:
    """Runs the search over a spec's shapes and keeps the outputs current."""

    def __init__(self, spec: TuneSpec, command: str, console, fresh: bool = False):
        self.spec, self.console = spec, console
        self.cuda = spec.device == "cuda"
        self.dtype = getattr(torch, spec.dtype)
        self.sm90 = self.cuda and torch.cuda.get_device_capability() == (9, 0)
        self.out = Path(spec.out)
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"--out: cannot make the folder {self.out}: {e.strerror}") from None
        gpu = torch.cuda.get_device_name() if self.cuda else None
        identity = {"device": spec.device, "gpu": gpu, "dtype": spec.dtype,  # timings of one kind only
                    "timing": "cuda_graph" if self.cuda else "cpu_wall", "launches_per_graph": LAUNCHES if self.cuda else 1}
        self.backends = {name: TUNERS[name]() for name in TUNERS if name in spec.kernels}
        self.cache = Cache(self.out / "cache.jsonl", identity, fresh, {n: b.revision for n, b in self.backends.items()})
        self.shapes = build_shapes(spec, self.backends)
        self.share = spec.budget_s / len(self.shapes)
        self.session = f"{time.strftime('%Y%m%dT%H%M%S')}-{id(self):x}"
        self.timer = time_cuda if self.cuda else time_cpu
        self.viable: dict[Shape, int] = {}  # configs left after static pruning, per shape
        self.meta = {"gpu": gpu, "device": spec.device, "timing": "cuda_graph" if self.cuda else "cpu_wall",
                     "dtype": spec.dtype, "rank": spec.rank, "model": spec.model, "command": command,
                     "budget_s": spec.budget_s, "launches_per_graph": LAUNCHES if self.cuda else 1, "env": env.collect(spec.device)}

    def run(self) -> list[dict]:
        with pdl_off(), Progress(console=self.console, transient=True) as progress:
            task = progress.add_task("tuning", total=len(self.shapes))
            for shape in self.shapes:
                progress.update(task, description=shape.label)
                self.tune(shape)
                self.write()
                progress.advance(task)
        return self.write()

    def tune(self, shape: Shape) -> None:
        backend = self.backends[shape.kernel]
        rows = self.cache.of(shape)
        default = backend.default(shape)
        done = {_cid(r["config"]) for r in rows}
        spent, tried = sum(r["spent_s"] for r in rows), sum(not r["default"] for r in rows)
        todo = candidates(shape, backend, default, self.spec.rank, self.dtype.itemsize, self.sm90, self.spec.seed)
        self.viable[shape] = len(todo)
        todo = [c for c in todo if _cid(c) not in done]
        old = [r for r in rows if r["default"] and _cid(r["config"]) == _cid(default)]  # today's default only
        if old and (old[0]["status"] != "ok" or not todo or (spent >= self.share and tried)):
            return  # nothing to compare against, or this shape's budget is spent (resume)
        problem = backend.problem(shape, self.spec.rank, self.dtype, self.spec.device, self.spec.seed)
        ref = self.reference(shape, problem, default, bool(old))
        for cfg in todo:
            if ref is None or (spent >= self.share and tried):
                break
            spent += self.record(shape, problem, cfg, ref, False)["spent_s"]
            tried += 1

    def reference(self, shape: Shape, problem, default: dict, cached: bool) -> torch.Tensor | None:
        """The default's output: measured and recorded first, or only rerun if the cache has it."""
        if cached:
            return measure(self.backends[shape.kernel], problem, default, None, 0.0, lambda fn: {})[1]
        row = self.record(shape, problem, default, None, True)
        return row.pop("_out") if row["status"] == "ok" else None

    def record(self, shape: Shape, problem, cfg: dict, ref, is_default: bool) -> dict:
        t0 = time.perf_counter()
        result, out = measure(self.backends[shape.kernel], problem, cfg, ref, TOLERANCE[self.spec.dtype].kernel, self.timer)
        row = {"kernel": shape.kernel, "op": shape.op, "linear": shape.linear, "shape": list(shape.key), "config": cfg,
               "default": is_default, **result, "spent_s": time.perf_counter() - t0, "session": self.session}
        self.cache.append(row)
        return {**row, "_out": out}

    def write(self) -> list[dict]:
        """Rewrite every output from the cache; returns one summary per shape."""
        results = [summarise(s, self.cache.of(s), self.viable.get(s)) for s in self.shapes]
        write_json(self.out / TUNED_FILE, {**self.meta, "entries": lorabench_entries(results)})
        if "vllm" in self.backends:
            write_vllm(vllm_folder(self.out), self.meta["gpu"], vllm_best(results))
        (self.out / "tune.md").write_text(markdown(self.meta, results))
        return results
