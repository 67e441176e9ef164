"""A sweep's plan: the jobs (one worker process each) and the points each one measures.

A ``Job`` is everything one worker needs, frozen, and crosses the process boundary as JSON
(``to_json`` / ``from_json``): the worker reads no spec. It gets lorabench's capture set and grid
policy resolved; only vLLM's rules turn the strategy into vLLM's keys (``runtime.vllm_rules``).
"""

import json
from dataclasses import asdict, dataclass, fields

from lorabench.config.backends import KernelsLabel
from lorabench.config.batches import prefill_requests
from lorabench.config.models import ModelConfig, resolve
from lorabench.config.peft import read_adapters, slot_ranks
from lorabench.config.ranks import parse_ranks
from lorabench.config.residency import OUTPUT_TOKENS, Adapters
from lorabench.config.strategies import AUTO, Vllm, strategy
from lorabench.config.sweep_spec import OPTIONS, SweepSpec

# A point's mode: a batch of exactly n adapters; batches drawn from a workload over the slots; or a
# residency run: a closed loop of c clients over --adapters N adapters held in the slots by LRU,
# adapters loaded as the steps need them (``lorabench.config.residency``); or a prefill step of a
# fixed number of prompt tokens, n adapters among its requests (``batches.prefill_step``); or a
# serving run: a residency run whose requests carry prompts (--input-tokens), scheduled with chunked
# prefill (``lorabench.config.serving``).
FIXED, WORKLOAD, RESIDENCY, PREFILL, SERVING = "fixed", "workload", "residency", "prefill", "serving"
LOOPS = (RESIDENCY, SERVING)  # the modes whose steps load adapters into slots


def auto_key(kernels: str, max_loras: int) -> str:
    """Where ``SweepSpec.auto_sets`` keeps strategy auto's set for a (kernels, max_loras)."""
    return f"{kernels}/{max_loras}"


@dataclass(frozen=True)
class Point:
    """One measured point of a job: ``index`` is its place in the run's plan (the ``point`` column)."""

    index: int
    mode: str  # FIXED, WORKLOAD, RESIDENCY, PREFILL or SERVING
    concurrency: int  # requests per step
    n_active: int | None = None  # FIXED and PREFILL points
    workload: str | None = None  # WORKLOAD, RESIDENCY and SERVING points
    prefill_tokens: int | None = None  # PREFILL points: the step's prompt tokens


@dataclass(frozen=True)
class Job:
    """One worker's configuration: a (kernels, max_loras, strategy) of a sweep and its points."""

    run_id: str
    started_at: str
    argv: str
    kernels: str  # a KernelsLabel, as rows write it
    max_loras: int
    strategy: str  # canonical name, as rows write it
    counts: tuple[int, ...]  # lorabench's capture set (vLLM's keys are derived from the strategy by its rules)
    bucket_grid: bool  # graphs launched with min(bucket, max_loras) programs, whatever n
    device: str
    model: ModelConfig  # the whole model's shapes (--layers applied); the worker builds one rank of it
    rank: int
    dtype: str
    context_len: int
    capture_sizes: tuple[int, ...]
    max_tokens: int  # token slots the model is built with: the largest step it runs or captures
    iters: int
    warmup: int
    seed: int
    check: bool
    tuned: str | None  # the tune folder whose configs "+tuned" kernels run with
    points: tuple[Point, ...] = ()
    predicted_ms: tuple[tuple[str, int, float], ...] = ()  # strategy auto: (workload, c, the cost model's ms)
    ci_target: float | None = None  # stop a point once its median's interval is within this % (at most iters steps)
    tp: int = 1  # tensor-parallel ranks: the worker builds and times one rank's shapes
    fully_sharded: bool = False  # --fully-sharded-loras (tp > 1)
    ranks: str | None = None  # --ranks: the adapters' own ranks and shares, padded to ``rank``
    slot_ranks: tuple[int, ...] = ()  # each slot's adapter's own rank (empty: all at ``rank``)
    adapters: int | None = None  # --adapters: residency points serve this many adapters from the slots
    adapter_dir: str | None = None  # --adapters DIR: the PEFT adapters the slots hold (slot i: adapter i)
    max_cpu_loras: int | None = None  # --max-cpu-loras (None: every adapter in the CPU cache)
    output_tokens: str = str(OUTPUT_TOKENS)  # --output-tokens: tokens each request of a residency run decodes (N or LO-HI)
    load_path: str = "per-slice"  # --load-path: how a residency run's loads reach the slots
    mixed_sizes: tuple[int, ...] = ()  # the mixed steps' PIECEWISE buckets (vLLM's sizes to --max-cudagraph-capture-size)
    cache_rows: int | None = None  # the KV cache's requests (None: max_tokens)
    max_cudagraph_capture_size: int = 0
    prefill_tokens: tuple[int, ...] | None = None  # --prefill-tokens (the points carry theirs)
    max_num_batched_tokens: int = 8192
    input_tokens: str | None = None  # --input-tokens: serving runs' prompts (N or LO-HI)

    @property
    def residency(self) -> Adapters | None:
        return None if self.adapters is None else Adapters(self.adapters, self.max_cpu_loras, self.output_tokens)

    @property
    def label(self) -> KernelsLabel:
        return KernelsLabel.parse(self.kernels)

    @property
    def config(self) -> dict:
        """The (kernels, max_loras, strategy) that names this job in rows and verdicts."""
        return {"kernels": self.kernels, "max_loras": self.max_loras, "strategy": self.strategy}

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Job":
        raw = json.loads(text)
        raw["points"] = tuple(Point(**p) for p in raw["points"])
        raw["predicted_ms"] = tuple(tuple(p) for p in raw["predicted_ms"])
        if isinstance(raw["model"], str):  # a run planned before models had shapes in the plan: a preset's name
            raw["model"] = resolve(raw["model"], raw.pop("layers", None))
        else:
            raw["model"] = ModelConfig(**raw["model"])
        if raw.get("prefill_tokens") is not None:
            raw["prefill_tokens"] = tuple(raw["prefill_tokens"])
        for name in ("counts", "capture_sizes", "slot_ranks", "mixed_sizes"):
            raw[name] = tuple(raw.get(name, ()))
        return cls(**raw)


PER_JOB = {"kernels", "max_loras", "strategy", "model", "capture_sizes", "tuned", "prefill_tokens"}  # each job sets these itself
COPIED = [name for name in OPTIONS if name in {f.name for f in fields(Job)} - PER_JOB]  # every other option a job has


def plan(spec: SweepSpec, run_id: str = "", started_at: str = "", argv: str = "") -> list[Job]:
    """The workers' jobs, each with its points: for every concurrency c, every n in
    0..min(c, max_loras) (or those of --active-counts, and 0) in fixed mode, then one workload run
    per workload; then per --prefill-tokens T, a prefill point at every n in 0..min(T, max_loras)
    (or those of --active-counts; beside a serving run's, n up to its clients). With --adapters the
    workload runs are residency runs, of the largest concurrency's clients only (the smaller
    concurrencies are the batch sizes its steps take). vLLM's kernels skip strategies vLLM has no
    grid for."""
    jobs, index = [], 0
    model = spec.model_config or resolve(spec.model, spec.layers)
    adapters = read_adapters(spec.adapter_dir, model, spec.rank) if spec.adapter_dir else ()
    for kernels in spec.labels:
        for max_loras in spec.max_loras:
            for name in spec.strategy:
                s = strategy(name)
                if kernels.vllm and s.vllm is Vllm.NONE:
                    continue  # vLLM's grid follows its count: it has no count-agnostic mode to measure
                points = []
                for c in spec.concurrency:
                    for n in range(min(c, max_loras) + 1):
                        if n and spec.active_counts is not None and n not in spec.active_counts:
                            continue
                        points.append(Point(index, FIXED, c, n_active=n))
                        index += 1
                    if spec.adapters is None:
                        for w in spec.workload:
                            points.append(Point(index, WORKLOAD, c, workload=w))
                            index += 1
                    elif c == max(spec.concurrency):
                        for w in spec.workload:
                            points.append(Point(index, SERVING if spec.input_tokens else RESIDENCY, c, workload=w))
                            index += 1
                # beside a serving run, no step holds more requests (so adapters) than its clients
                most = min(max_loras, max(spec.concurrency)) if spec.input_tokens else max_loras
                for t in spec.prefill_tokens or ():
                    ns = [n for n in range(min(t, most) + 1)
                          if n == 0 or spec.active_counts is None or n in spec.active_counts]
                    requests = prefill_requests(t, ns[-1], spec.context_len)  # the same chunks at every n
                    for n in ns:
                        points.append(Point(index, PREFILL, requests, n_active=n, prefill_tokens=t))
                        index += 1
                predicted: tuple = ()
                if s.name == AUTO:
                    chosen = spec.auto_sets[auto_key(str(kernels), max_loras)]
                    counts = chosen["counts"]
                    predicted = tuple((chosen["workload"], int(c), ms) for c, ms in chosen["predicted_ms"].items())
                else:
                    counts = s.counts(max_loras)
                jobs.append(Job(
                    run_id=run_id, started_at=started_at, argv=argv, kernels=str(kernels), max_loras=max_loras,
                    strategy=s.name, counts=tuple(counts), bucket_grid=s.bucket_grid,
                    model=model,
                    capture_sizes=tuple(spec.capture_sizes), max_tokens=spec.max_tokens,
                    mixed_sizes=tuple(spec.mixed_sizes), cache_rows=spec.cache_rows,
                    prefill_tokens=tuple(spec.prefill_tokens) if spec.prefill_tokens else None,
                    tuned=spec.tuned if kernels.tuned else None, points=tuple(points), predicted_ms=predicted,
                    fully_sharded=spec.fully_sharded_loras,
                    slot_ranks=(parse_ranks(spec.ranks, spec.rank).slot_ranks(max_loras) if spec.ranks
                                else slot_ranks(adapters, max_loras) if adapters else ()),
                    adapter_dir=spec.adapter_dir,
                    **{name: getattr(spec, name) for name in COPIED}))
    return jobs


def group_key(job: Job) -> tuple[str, int]:
    return job.kernels, job.max_loras


def groups(jobs: list[tuple[int, Job]]) -> list[list[tuple[int, Job]]]:
    """The jobs one worker process runs together: every strategy of one (kernels, max_loras),
    which the report compares with each other, so it times them in alternating turns on one GPU
    (drift in clocks or temperature then falls on all of them alike). ``jobs``: (index in the plan,
    job); the groups keep the plan's order."""
    out: dict[tuple[str, int], list[tuple[int, Job]]] = {}
    for index, job in jobs:
        out.setdefault(group_key(job), []).append((index, job))
    return list(out.values())


def point_groups(jobs: list[Job]) -> dict[int, int]:
    """Each planned point's group: the group's place among the plan's groups (its worker's log and
    its rows' part file are numbered so)."""
    return {p.index: g for g, members in enumerate(groups(list(enumerate(jobs)))) for _, job in members
            for p in job.points}
