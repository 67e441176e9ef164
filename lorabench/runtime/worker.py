"""One worker process per (kernels, max_loras): builds the model once, compiles and captures
every strategy's graphs, times every point in alternating turns across the strategies
(``lorabench.runtime.turns``), and sends one row per (strategy, point) with its steps
(``lorabench.runtime.protocol``'s ``Measured``) as soon as the point finishes (the parent writes
the Parquet files). A point that fails becomes
``failed`` rows and the worker goes on; a strategy whose build or capture fails fails its points;
if the model cannot be built, every point becomes a failed row.

Run as ``python -m lorabench.runtime.worker < jobs.json`` (``{"jobs": [Job, ...], "spawned_at"}``,
the jobs of one ``lorabench.config.plan.groups`` group); the
sweep runs it through ``python -m lorabench.runtime.lifeline SWEEP_PID lorabench.runtime.worker``.
"""

import functools
import json
import os
import sys
import time
import traceback

import torch

from lorabench.config.models import shard
from lorabench.config.peft import read_adapters
from lorabench.config.plan import LOOPS, PREFILL, Job, Point
from lorabench.config.sweep_spec import OPTIONS
from lorabench.kernels import BACKENDS, get_backend
from lorabench.runtime import env, telemetry
from lorabench.runtime.adapters import AdapterLoader
from lorabench.runtime.arms import Arm, forget_compiled, triton_cache_files
from lorabench.runtime.check import References, check
from lorabench.runtime.dispatch import Dispatcher
from lorabench.runtime.load_paths import ONE_COPY, OneCopy, StorageReads
from lorabench.runtime.load_timing import timed_loads
from lorabench.runtime.model import LlamaLoRA
from lorabench.runtime.peft_slots import fill_slots
from lorabench.runtime.point_steps import PointSteps, point_steps
from lorabench.runtime.probe import probe
from lorabench.runtime.protocol import SWEEP, Measured
from lorabench.runtime.rows import timed_columns
from lorabench.runtime.timing import time_steps
from lorabench.runtime.turns import SWITCH_WARMUP, TURN, Timed
from lorabench.runtime.vllm_rules import VllmRules
from lorabench.storage.checks import Checked
from lorabench.storage.row import Row
from lorabench.storage.tune_files import tuned_table

# A prefill point's timed steps at most: a serving run's ``iters`` (thousands) is sized for its loop,
# whose prefill points only price its mixed steps; 3000 steps of ~65 ms were 3 minutes a point.
PREFILL_STEPS = 100

JOB_COLUMNS = [name for name, o in OPTIONS.items() if o.column]  # options every row copies from its job


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()[:2000]


class Worker:
    """Runs a group of jobs (``lorabench.config.plan.groups``: the strategies of one (kernels,
    max_loras)) in one process on one GPU: one model, one dispatcher per strategy, every graph
    set resident, and every point timed in alternating turns across the strategies that have it
    (A B C, B C A, ...), so that drift falls on all of them alike."""

    def __init__(self, jobs: list[Job], spawned_at: float):
        self.jobs, self.spawned_at = jobs, spawned_at
        job = self.lead = jobs[0]
        self.cuda = job.device == "cuda"
        self.cfg = cfg = shard(job.model, job.tp)  # one tensor-parallel rank's shapes (the whole model at tp 1)
        self.backend = get_backend(job.label.backend)
        if job.label.tuned and hasattr(self.backend, "load_tuned"):  # lorabench's kernels (vLLM reads its own folder)
            self.backend.load_tuned(tuned_table(job.tuned))
        self.arms = [Arm(j) for j in jobs]
        self.env = env.collect(job.device)
        self.gpu = telemetry.Gpu.by_uuid(self.env.gpu_uuid) if self.env.gpu_uuid else None
        self.common = {
            "run_id": job.run_id, "started_at": job.started_at, "argv": job.argv, **self.env.columns(),
            **{name: getattr(job, name) for name in JOB_COLUMNS}, "capture_sizes": list(job.capture_sizes),
            "mixed_capture_sizes": list(job.mixed_sizes) or None,
            "model": cfg.name, "model_source": cfg.source, "architecture": cfg.architecture, "layers": cfg.layers,
            "hidden": cfg.hidden, "heads": job.model.heads, "kv_heads": job.model.kv_heads, "head_dim": cfg.head_dim,
            "intermediate": job.model.intermediate, "vocab": job.model.vocab,
            # one rank is timed alone: the collectives a TP step adds are not in its step_ms
            "allreduce": "left out" if job.tp > 1 else None, "fully_sharded_loras": job.fully_sharded,
            "slot_ranks": list(job.slot_ranks) or None, "adapter_dir": job.adapter_dir,
            **({"experts": cfg.moe.experts, "top_k": cfg.moe.top_k, "moe_intermediate": cfg.moe.intermediate,
                "shared_intermediate": cfg.moe.shared_intermediate, "shared_expert_weights": cfg.moe.shared_weights}
               if cfg.moe else {}),
            "max_cpu_loras": job.residency.cpu_slots if job.residency else None,
            "output_tokens": str(job.output_tokens) if job.residency else None,
            "timing": "cuda_events" if self.cuda else "cpu_wall",
            "vllm": self.backend.version() if job.label.vllm else None, "tuned": job.tuned,
            "pdl": (self.backend.pdl_enabled(torch.device(job.device))  # lorabench's Triton kernels
                    if hasattr(self.backend, "pdl_enabled") else None),
        }
        self.shared: dict = {}  # startup columns every strategy shares: the process, the model, the probe
        # The check's reference answers, once for every strategy; not for MoE models, whose
        # reference replays each tested graph's own routing (``runtime.moe``).
        self.refs = References() if len(jobs) > 1 and cfg.moe is None else None
        self.loader: AdapterLoader | None = None  # after the check: loads overwrite slots
        # --adapters DIR: the user's adapters, checked against the model when planned
        self.adapters = read_adapters(job.adapter_dir, job.model, job.rank) if job.adapter_dir else ()
        if self.adapters:  # what a CPU-cache miss reads, per adapter (the recommendation prices misses by it)
            self.common["adapter_file_bytes"] = [os.path.getsize(a.weights) for a in self.adapters]

    def point_row(self, arm: Arm, point: Point) -> dict:
        return {**self.common, **arm.job.config, "captured_counts": arm.counts, **self.shared, **arm.startup,
                "point": point.index, "mode": point.mode, "concurrency": point.concurrency,
                "n_active": point.n_active, "workload": point.workload, "prefill_tokens": point.prefill_tokens}

    def failed(self, arm: Arm, point: Point, e: BaseException) -> Measured:
        return Measured(Row(**self.point_row(arm, point), status="failed", error=_error(e)))

    def fail(self, arm: Arm, e: BaseException, points=None) -> None:
        for p in arm.job.points if points is None else points:
            SWEEP.emit(self.failed(arm, p, e))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def build_model(self) -> LlamaLoRA:
        job = self.lead
        self.shared["process_s"] = time.time() - self.spawned_at
        t0 = time.perf_counter()
        model = LlamaLoRA(self.cfg, max_loras=job.max_loras, rank=job.rank, max_tokens=job.max_tokens,
                          context_len=job.context_len, dtype=getattr(torch, job.dtype), device=job.device, seed=job.seed,
                          slot_ranks=job.slot_ranks, fully_sharded=job.fully_sharded, cache_rows=job.cache_rows,
                          extended=getattr(self.backend, "EXTENDS_K", False))
        self.sync()
        self.shared["build_s"] = time.perf_counter() - t0
        if self.adapters:  # a server starts with none: their reads are not the model's build
            fill_slots(model, self.adapters)
        return model

    def dispatcher(self, model: LlamaLoRA, arm: Arm, capture_sizes: list[int]) -> Dispatcher:
        job = arm.job
        rules = VllmRules(arm.strategy, job.max_loras, model.max_tokens, job.device) if arm.label.vllm else None
        return Dispatcher(model, self.backend, max_loras=job.max_loras, capture_sizes=capture_sizes, counts=arm.counts,
                          use_graphs=self.cuda, seed=job.seed, rules=rules, bucket_grid=job.bucket_grid,
                          slot_rank=model.slot_rank if arm.label.unpadded else None, mixed_sizes=list(job.mixed_sizes))

    def first_capture(self, model: LlamaLoRA) -> None:
        """Before any strategy: a warm-up and capture of the first strategy's graphs at the
        smallest batch, thrown away. It pays what a process pays once, whatever its capture set
        (CUDA and cuBLAS initialisation, Triton's first launches, the capture workspace), which
        would otherwise land on whichever strategy came first; recorded as ``first_capture_s``
        and ``first_capture_bytes`` on every row."""
        if self.cuda:
            torch.cuda.empty_cache()  # the model build's freed temporaries are not this capture's
        free0 = torch.cuda.mem_get_info()[0] if self.cuda else None
        t0 = time.perf_counter()
        d = self.dispatcher(model, self.arms[0], [min(self.lead.capture_sizes)])
        d.warm_up()
        d.capture()
        self.sync()
        self.shared["first_capture_s"] = time.perf_counter() - t0
        del d
        if self.cuda:
            torch.cuda.empty_cache()
            self.shared["first_capture_bytes"] = free0 - torch.cuda.mem_get_info()[0]

    def build(self, model: LlamaLoRA, arm: Arm) -> None:
        """The arm's dispatcher: compiled (warm-up) and captured; its startup columns, each its
        own: the model's build is every strategy's, and the Triton kernels loaded before are
        forgotten first (``forget_compiled``)."""
        job = arm.job
        t0 = time.perf_counter()
        d = self.dispatcher(model, arm, list(job.capture_sizes))
        self.sync()
        build_s = self.shared["build_s"] + time.perf_counter() - t0
        forget_compiled()
        cache_before = triton_cache_files()  # outside the timers: it walks the cache folder
        t1 = time.perf_counter()
        d.warm_up()
        compile_s = time.perf_counter() - t1
        compiled = BACKENDS[arm.label.backend].triton and not os.environ.get("TRITON_INTERPRET")
        if self.cuda:
            torch.cuda.empty_cache()
            free0, reserved0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
        t2 = time.perf_counter()
        d.capture()
        capture_s = time.perf_counter() - t2
        arm.startup.update(
            build_s=build_s, compile_s=compile_s, capture_s=capture_s, startup_s=build_s + compile_s + capture_s,
            num_graphs=d.num_graphs, lora_bytes_per_slot=model.lora_bytes_per_slot(),
            lora_io_bytes_per_token=model.lora_io_bytes_per_token(),
            expert_lora_bytes_per_slot=model.expert_lora_bytes_per_slot() if self.cfg.moe else None,
            triton_cache=("cold" if triton_cache_files() > cache_before else "warm") if compiled else None,
        )
        if self.cuda:
            arm.startup["graph_mem_bytes"] = free0 - torch.cuda.mem_get_info()[0]
            arm.startup["pool_bytes"] = torch.cuda.memory_reserved() - reserved0
        if d.mixed_keys:  # the PIECEWISE set, its own startup (vLLM captures it too, per active count)
            free1 = torch.cuda.mem_get_info()[0] if self.cuda else None
            t3 = time.perf_counter()
            d.capture_mixed()
            arm.startup.update(mixed_capture_s=time.perf_counter() - t3, num_mixed_graphs=d.num_mixed_graphs)
            if self.cuda:
                arm.startup["mixed_graph_mem_bytes"] = free1 - torch.cuda.mem_get_info()[0]
        arm.dispatcher = d

    def probe(self) -> None:
        """The floor's bandwidth and per-kernel cost, this worker's (every strategy's rows)."""
        if self.cuda:
            try:
                self.shared.update(probe())
            except Exception:  # noqa: BLE001 - no probe, no roofline; the points still count
                traceback.print_exc()

    def time_loads(self, model: LlamaLoRA, d: Dispatcher) -> None:
        """What loading one adapter into a slot costs here, by every path
        (``lorabench.runtime.load_timing``): every row's ``load_*`` columns. A worker that cannot
        load still times its points; its residency points fail."""
        self.loader, columns = timed_loads(model, d, self.adapters, self.lead.kernels, self.lead.max_loras, self.sync)
        self.shared.update(columns)

    @functools.cached_property
    def residency_loader(self) -> AdapterLoader | OneCopy:
        """What a residency run's loads go through (``--load-path``): vLLM's per-slice copies, or
        the adapter's one buffer at once (its staging buffer, one slot's bytes, stays on the GPU)."""
        if self.loader is None:
            raise RuntimeError("this worker could not load adapters (its log says why)")
        return OneCopy(self.loader) if self.lead.load_path == ONE_COPY else self.loader

    def check(self, arm: Arm) -> None:
        """The configuration's correctness verdict, carried by every row; emitted on its own too."""
        d = arm.dispatcher
        try:
            v = check(d, arm.job.dtype, arm.job.seed, self.refs)
            verdict = {"correct": v.correct, "check_detail": v.detail, "check_max_err": v.max_err,
                       "check_batches": v.batches, "check_s": v.seconds}
            SWEEP.emit(Checked(**arm.job.config, **v.to_dict(), num_graphs=d.num_graphs, captured_counts=arm.counts))
        except Exception as e:  # noqa: BLE001 - a check that cannot run is no verdict, not a lost sweep
            traceback.print_exc()
            verdict = {"correct": None, "check_detail": f"check did not run: {_error(e)}"}
            SWEEP.emit(Checked(**arm.job.config, correct=None, detail=verdict["check_detail"]))
        arm.startup.update(verdict)

    def point_steps(self, point: Point) -> PointSteps:
        """The point's steps (``runtime.point_steps``); a loop's need this worker's loader."""
        if point.mode in LOOPS and self.loader is None:
            raise RuntimeError("this worker could not load adapters (its log says why)")
        return point_steps(self.lead, point, reads_files=bool(self.adapters))

    def measure(self, entries: list[tuple[Arm, Point]]) -> list[tuple[dict, object]]:
        """One point, timed for every strategy that has it, in alternating turns: ``TURN`` steps
        each, the order rotated every round. A strategy stops when it has ``iters`` steps, or,
        with a CI target, once its median's 95 % interval is that narrow (at least
        ``MIN_STEPS``). Returns each strategy's row's columns and its steps, or a failed ``Measured``
        for a strategy whose steps raised: the others go on."""
        job = self.lead
        steps = self.point_steps(entries[0][1])
        ci_target = None if steps.loads else job.ci_target  # a residency run's mean needs all its steps: rare loads are its point
        timed = [Timed() for _ in entries]
        failed: dict[int, BaseException] = {}
        todo = list(range(len(entries)))
        rnd, start = 0, entries[0][1].index  # the first strategy to go changes from point to point
        while todo:
            k = (start + rnd) % len(todo)
            order = todo[k:] + todo[:k]
            for i in order:
                arm, point = entries[i]
                try:
                    self.turn(arm, point, steps, timed[i], rnd, alone=len(entries) == 1)
                except Exception as e:  # noqa: BLE001 - a failing point is a row, the sweep goes on
                    traceback.print_exc()
                    failed[i] = e
            todo = [i for i in todo if i not in failed and not timed[i].done(self.steps_wanted(entries[i][1]), ci_target,
                                                                              len(entries))]
            rnd += 1
        arms = ",".join(arm.job.strategy for arm, _ in entries)  # timed together at this point
        out = []
        for i, (arm, p) in enumerate(entries):
            if i in failed:
                out.append(self.failed(arm, p, failed[i]))
            else:
                columns, samples = timed_columns(arm.dispatcher, p, timed[i], arm.predicted, steps.served)
                out.append(({**self.point_row(arm, p), **columns, "arms": arms}, samples))
        return out

    def steps_wanted(self, point: Point) -> int:
        """The timed steps a point takes at most: the spec's ``iters``, at most ``PREFILL_STEPS`` for
        a prefill point."""
        return min(self.lead.iters, PREFILL_STEPS) if point.mode == PREFILL else self.lead.iters

    def turn(self, arm: Arm, point: Point, steps: PointSteps, timed: "Timed", rnd: int, alone: bool) -> None:
        """One strategy's turn at a point: ``TURN`` more timed steps, after the spec's warm-up on
        its first turn and ``SWITCH_WARMUP`` untimed steps on every later one (none when it is
        timed alone); a loop's steps make their loads."""
        n = min(TURN, self.steps_wanted(point) - timed.steps)
        warmup = self.lead.warmup if timed.steps == 0 else (0 if alone else SWITCH_WARMUP)
        if timed.steps == 0:  # the compiles an eager step at a new token or launch count makes, outside the timed steps
            arm.dispatcher.warm_eager(steps.batches)
        loads = steps.loads
        start = steps.start_slots.get(timed.steps) if loads else None
        reads = steps.reads if loads else None
        timed.add(time_steps(arm.dispatcher, steps.batches, n, warmup, first=timed.steps, loads=loads,
                             loader=self.residency_loader if loads else None, start_slots=start, reads=reads,
                             storage=StorageReads([a.weights for a in self.adapters]) if reads else None), rnd)

    def run(self) -> None:
        SWEEP.emit(self.env)
        try:
            model = self.build_model()
        except Exception as e:  # noqa: BLE001 - no model, no points: every one a failed row
            traceback.print_exc()
            for arm in self.arms:
                self.fail(arm, e)
            return
        try:
            self.first_capture(model)
        except Exception:  # noqa: BLE001 - the strategies' own builds say what fails
            traceback.print_exc()
        for arm in self.arms:
            try:
                self.build(model, arm)
            except Exception as e:  # noqa: BLE001 - a build/compile/capture failure fails this strategy's points
                traceback.print_exc()
                self.fail(arm, e)
        live = [a for a in self.arms if a.dispatcher is not None]
        if not live:
            return
        self.probe()
        if self.lead.check:
            for arm in live:
                self.check(arm)
            self.refs = None
        if any(a.job.points for a in live):  # `lorabench check` times nothing
            self.time_loads(model, live[0].dispatcher)
        for _, entries in self.schedule(live):
            self.run_point(entries)

    def schedule(self, arms: list[Arm]) -> list[tuple[tuple, list[tuple[Arm, Point]]]]:
        """The points in plan order, each with every strategy that has it (matched by mode,
        concurrency, active count, workload and prefill tokens)."""
        by_key: dict[tuple, list[tuple[Arm, Point]]] = {}
        for arm in arms:
            for p in arm.job.points:
                by_key.setdefault((p.mode, p.concurrency, p.n_active, p.workload, p.prefill_tokens), []).append((arm, p))
        return sorted(by_key.items(), key=lambda kv: min(p.index for _, p in kv[1]))

    def run_point(self, entries: list[tuple[Arm, Point]]) -> None:
        """Time one point for its strategies and emit their rows, with the GPU's readings before
        and after. A strategy whose steps fail gets a failed row (``measure``); anything else
        failing fails them all; the worker goes on with the next point."""
        gpu = self.gpu
        try:
            self.sync()
            start = gpu.snapshot() if gpu else None
            rows = self.measure(entries)
            end = gpu.snapshot() if gpu else None
        except Exception as e:  # noqa: BLE001 - a failing point is a row, the sweep goes on
            traceback.print_exc()
            for arm, p in entries:
                self.fail(arm, e, [p])
            return
        readings = telemetry.point_columns(gpu, start, end)
        why = telemetry.suspect(readings)
        for measured in rows:
            if isinstance(measured, Measured):  # failed
                SWEEP.emit(measured)
                continue
            columns, steps = measured
            reasons = [r for r in (columns.pop("noisy_iqr"), columns.pop("noisy_host"), columns.pop("noisy_stall"), why) if r]
            noisy = {"noisy": bool(reasons), "noisy_why": "; ".join(reasons) or None}
            SWEEP.emit(Measured(Row(**{**columns, **readings, **noisy}), steps))  # the readings' GPU: the point's


def main() -> None:
    """Read the jobs from stdin (``{"jobs": [...], "spawned_at": ...}``) and run them. The sweep runs
    it under ``lorabench.runtime.lifeline``, which ends it when the sweep is gone."""
    sys.stdout = sys.stderr  # stdout carries the protocol only
    message = json.loads(sys.stdin.read())
    Worker([Job.from_json(j) for j in message["jobs"]], message["spawned_at"]).run()


if __name__ == "__main__":
    main()
