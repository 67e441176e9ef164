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
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from lorabench.commands.tune.backends import TUNERS, TuneBackend
from lorabench.commands.tune.output import (
    lorabench_entries,
    markdown,
    summarise,
    vllm_best,
)
from lorabench.commands.tune.shapes import OPS, Shape, build_shapes, candidates
from lorabench.config.tolerance import TOLERANCE
from lorabench.config.tune_spec import TuneSpec
from lorabench.errors import UserError
from lorabench.runtime import env
from lorabench.runtime.graphs import capture_graph
from lorabench.runtime.timing import replay_times
from lorabench.storage.tune_files import (
    CACHE_FILE,
    TUNED_FILE,
    read_cache,
    vllm_folder,
    write_json,
    write_vllm,
)

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
    """OUT/cache.jsonl: one line per measured (shape, config), appended the moment it exists, by
    every tune into OUT. Rows of another device, GPU or dtype, and rows of lorabench's kernels
    timed from other kernel sources (``revs``: kernel -> its backend's ``revision``), are kept in
    the file and ignored (``skipped`` counts them). ``notice``: what reading the file repaired.

    A tune spread over GPUs (``lorabench.commands.tune.spread``) gives each of its workers the
    rows of its shapes (``rows``) and a ``sink`` that sends each new row to the tune, which
    writes it (``take``): the folder has one writer, wherever the workers run."""

    def __init__(self, path: Path, identity: dict, fresh: bool, revs: dict[str, str | None] | None = None,
                 rows: list[dict] | None = None, sink=None):
        self.path, self.identity, self.revs, self.sink = path, identity, revs or {}, sink
        if rows is None and fresh and path.exists():
            path.replace(path.with_name(path.name + ".prev"))
        every, self.notice = (rows, None) if rows is not None else read_cache(path)
        self.rows: list[dict] = []
        self._of: dict[tuple, list[dict]] = {}
        self.skipped = {"identity": Counter(), "revision": 0}
        for r in every:
            self._sort(r)

    def _sort(self, r: dict) -> None:
        """Keep a row this tune can use, or count why not."""
        if not all(r.get(k) == v for k, v in self.identity.items()):
            self.skipped["identity"][" ".join(str(r.get(k)) for k in ("device", "gpu", "dtype") if r.get(k))] += 1
        elif r.get("kernels_rev") != self.revs.get(r["kernel"]):
            self.skipped["revision"] += 1
        else:
            self._keep(r)

    @staticmethod
    def key(kernel: str, op: str, shape) -> tuple:
        return kernel, op, tuple(shape)

    def _keep(self, row: dict) -> None:
        self.rows.append(row)
        self._of.setdefault(self.key(row["kernel"], row["op"], row["shape"]), []).append(row)

    def of(self, shape: Shape) -> list[dict]:
        return self._of.get(self.key(shape.kernel, shape.op, shape.key), [])

    def shapes(self) -> list[Shape]:
        """A shape per key the usable rows hold, named by the linears its rows were tuned as."""
        return [Shape.measured(*key, linear="/".join(dict.fromkeys(
                    part for r in rows for part in (r.get("linear") or "?").split("/"))))
                for key, rows in self._of.items()]

    def append(self, row: dict) -> None:
        row = {**row, **self.identity, "kernels_rev": self.revs.get(row["kernel"])}
        if self.sink is not None:
            self._keep(row)
            self.sink(row)
        else:
            self.take(row)

    def take(self, row: dict) -> None:
        """A row as a worker measured and stamped it: into the file, and kept if it is usable."""
        self._sort(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


class Tuner:
    """Runs the search over a spec's shapes and keeps the outputs current."""

    def __init__(self, spec: TuneSpec, command: str, console, fresh: bool = False, rows: list[dict] | None = None,
                 sink=None, where: str | None = None):
        """rows, sink: a spread tune's worker (``Cache``): it starts from its shapes' rows and sends
        each new one, writing nothing itself; ``where`` (its host and GPU) goes into its rows."""
        self.spec, self.console, self.where = spec, console, where
        self.cuda = spec.device == "cuda"
        self.dtype = getattr(torch, spec.dtype)
        self.sm90 = self.cuda and torch.cuda.get_device_capability() == (9, 0)
        self.out = Path(spec.out)
        if sink is None:
            try:
                self.out.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise UserError(f"--out: cannot make the folder {self.out}: {e.strerror}") from None
        gpu = torch.cuda.get_device_name() if self.cuda else None
        identity = {"device": spec.device, "gpu": gpu, "dtype": spec.dtype,  # timings of one kind only
                    "timing": "cuda_graph" if self.cuda else "cpu_wall", "launches_per_graph": LAUNCHES if self.cuda else 1}
        self.backends = {name: TUNERS[name]() for name in TUNERS if name in spec.kernels}
        revs = {name: (self.backends.get(name) or cls()).revision for name, cls in TUNERS.items()}  # every kernel's rows count
        self.cache = Cache(self.out / CACHE_FILE, identity, fresh, revs, rows, sink)
        self.shapes = build_shapes(spec, self.backends)
        self.share = spec.budget_s / len(self.shapes)
        self.session = f"{time.strftime('%Y%m%dT%H%M%S')}-{id(self):x}"
        self.timer = time_cuda if self.cuda else time_cpu
        self.viable: dict[Shape, int] = {}  # configs left after static pruning, per shape
        self.meta = {"gpu": gpu, "device": spec.device, "timing": "cuda_graph" if self.cuda else "cpu_wall",
                     "dtype": spec.dtype, "rank": spec.rank, "model": spec.model, "tp": spec.tp, "command": command,
                     "budget_s": spec.budget_s, "launches_per_graph": LAUNCHES if self.cuda else 1, "env": asdict(env.collect(spec.device))}
        self._timed = lambda n: None  # told the number of configs timed for the current shape

    def run(self) -> list[dict]:
        """Tune every shape under a progress bar (shapes done / total, the current shape, elapsed);
        where the console is no terminal (a pipe, a log), one line per shape instead."""
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        t0, total = time.perf_counter(), len(self.shapes)
        with pdl_off(), Progress(*columns, console=self.console, transient=False) as progress:
            task = progress.add_task("tune", total=total)
            for i, shape in enumerate(self.shapes, 1):
                self._timed = lambda n, label=shape.label: progress.update(task, description=f"{label}: {n} timed")
                self._timed(len(self.cache.of(shape)))
                self.tune(shape)
                self.write()
                progress.advance(task)
                if not self.console.is_terminal:
                    self.console.print(f"{i}/{total} {shape.label}: {len(self.cache.of(shape))} timed, "
                                       f"{time.perf_counter() - t0:.0f} s", highlight=False, markup=False)
            progress.update(task, description="tune")
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
               "default": is_default, **result, "spent_s": time.perf_counter() - t0, "session": self.session,
               "command": self.meta["command"], **({"where": self.where} if self.where else {})}
        self.cache.append(row)
        self._timed(len(self.cache.of(shape)))
        return {**row, "_out": out}

    def tables(self) -> list[Shape]:
        """What the folder's tables hold: this tune's shapes, and every other shape the cache has
        usable rows of (earlier tunes into the folder, of any kernel), by kernel and op."""
        mine = {Cache.key(s.kernel, s.op, s.key) for s in self.shapes}
        shapes = self.shapes + [s for s in self.cache.shapes() if Cache.key(s.kernel, s.op, s.key) not in mine]
        order = list(TUNERS)  # stable: within a kernel's op, this tune's order, then the cache's
        return sorted(shapes, key=lambda s: (order.index(s.kernel) if s.kernel in order else len(order), s.kernel,
                                             (*OPS, s.op).index(s.op), s.op))

    def write(self) -> list[dict]:
        """Rewrite every output from the whole cache (this tune's shapes and earlier tunes'); returns
        one summary per shape of the tables."""
        shapes, mine = self.tables(), set(self.shapes)
        results = [summarise(s, self.cache.of(s), self.viable.get(s)) for s in shapes]

        def commands(of: list[Shape]) -> list[str]:  # the commands whose rows hold these shapes, first seen first
            return list(dict.fromkeys(r["command"] for s in of for r in self.cache.of(s) if isinstance(r.get("command"), str)))

        earlier = [s for s in shapes if s not in mine]
        meta = {**self.meta, "commands": list(dict.fromkeys([self.meta["command"], *commands(shapes)]))}
        write_json(self.out / TUNED_FILE, {**meta, "entries": lorabench_entries(results)})
        best = vllm_best(results)
        if best or "vllm" in self.backends:
            write_vllm(vllm_folder(self.out), self.meta["gpu"], best)
        (self.out / "tune.md").write_text(markdown(meta, results, earlier=len(earlier), earlier_commands=commands(earlier)))
        return results
