"""What a (kernels, max_loras, capture set) costs under residency, from a run's points: the decode
step is the cost model's (``lorabench.analysis.costmodel.Pricing``, each batch size weighted by
its share of the steps), every load adds the run's median load time (one adapter copied from
pinned host memory into a slot, timed by every worker, pooled: ``lorabench.analysis.view.pooled_loads``);
tokens per second = tokens per step / expected step; memory: the set's graphs (the cost model's
curve through the measured sets), max_loras adapter slots and the KV-cache tokens the two would
hold instead. Throughput gains get intervals that resample every fixed point and the timed
loads independently. Also each residency run against its prediction (``validation``).

CPU misses (loads whose adapter is not in the CPU cache) pay the run's cold read of an adapter's
file from storage where the run timed one (``--adapters DIR``), blocking the step as vLLM's
synchronous load from disk does; otherwise they are counted, not priced. ``path_prices`` puts the
chosen configuration's tokens/s under each load path the run timed side by side.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from lorabench.analysis.costmodel import Pricing
from lorabench.analysis.intervals import Gain, interval_of, points_read
from lorabench.analysis.occupancy import STEPS, Occupancy, kv_bytes_per_token, occupancy, simulated, windows
from lorabench.analysis.points import ok_points
from lorabench.analysis.view import LOAD, RunView
from lorabench.config.backends import backend_of
from lorabench.config.residency import Adapters

AUTO_SET = "auto"  # the cost model's best set within the budget (lorabench.analysis.search)


@dataclass(frozen=True)
class MissPrice:
    """What CPU-cache misses cost: the run's cold reads of its adapters' files, as their median
    (ms per read) and as a line in the file's bytes (``fixed_ms`` + bytes / ``bytes_per_ms``;
    None: a run made before it was kept). Priced by the bytes the misses read where the
    adapters' files are known (they differ in size: a rank-8 attention adapter's is a tenth of
    a rank-64 one's), else at the median read per miss."""

    read_ms: float
    bytes_per_ms: float | None = None
    fixed_ms: float = 0.0

    def per_step(self, occ: Occupancy) -> float:
        """The misses' ms per step under ``occ``."""
        if occ.miss_bytes is not None and self.bytes_per_ms:
            return occ.cpu_misses * self.fixed_ms + occ.miss_bytes / self.bytes_per_ms
        return occ.cpu_misses * self.read_ms


@dataclass(frozen=True)
class Priced:
    """One (kernels, max_loras, capture set) under the residency workload, as the run prices it."""

    kernels: str
    max_loras: int
    strategy: str  # a measured strategy, or AUTO_SET
    counts: list[int]
    decode_ms: float  # the expected step without loads
    load_ms: float
    occ: Occupancy
    graph_mem_bytes: float | None
    slot_bytes: int
    kv_token_bytes: int
    values: dict[str, int] = field(default_factory=dict)  # how the cost model priced it (measured, interpolated, ...)
    miss: MissPrice | None = None  # what CPU-cache misses add (the storage reads); None: not timed, not priced

    @property
    def miss_ms_per_step(self) -> float:
        return 0.0 if self.miss is None else self.miss.per_step(self.occ)

    @property
    def step_ms(self) -> float:
        return self.decode_ms + self.occ.loads * self.load_ms + self.miss_ms_per_step

    @property
    def tokens_per_s(self) -> float:
        return 1e3 * self.occ.tokens / self.step_ms

    @property
    def gpu_bytes(self) -> float | None:
        """What the configuration takes from the GPU beyond the model: graphs and adapter slots."""
        return None if self.graph_mem_bytes is None else self.graph_mem_bytes + self.slot_bytes

    @property
    def kv_tokens(self) -> int | None:
        """KV-cache tokens its GPU memory would hold."""
        return None if self.gpu_bytes is None else int(self.gpu_bytes // self.kv_token_bytes)

    @property
    def set_name(self) -> str:
        """Its capture set as ``--strategy`` takes it: its strategy's name, or the cost model's own
        set as a list, "[24,32,64]"."""
        return self.strategy if self.strategy != AUTO_SET else "[" + ",".join(map(str, self.counts)) + "]"

    @property
    def label(self) -> str:
        """Its set in words: ``pow2 [1, 2, 4]``, ``the cost model's set [3, 4]``."""
        return f"{self.strategy} {self.counts}" if self.strategy != AUTO_SET else f"the cost model's set {self.counts}"


class Pricer:
    """Prices capture sets at one (kernels, max_loras) of a run for an Occupancy, as numbers and
    as a function of the resampled medians (the fixed points' and the timed loads')."""

    def __init__(self, view: RunView, kernels: str, max_loras: int, occ: Occupancy):
        """The loads are the run's timed loads of these kernels, every worker's; without them, the
        median of the workers' medians."""
        self.kernels, self.L, self.occ = kernels, max_loras, occ
        self.model = view.cost_model(kernels, max_loras)
        self.pricing = Pricing(self.model, occ.pmf, occ.weights)
        self.load_key = (LOAD, kernels)
        self.load_ms, self.slot_bytes, self.kv_token_bytes, self.miss = view.memo(
            ("residency", kernels, max_loras), lambda: _costs(view, kernels, max_loras))

    def unpriced(self, counts: list[int]) -> str | None:
        if self.load_ms is None and self.occ.loads > 0:
            return f"the run timed no adapter loads of {self.kernels} (made before lorabench timed them)"
        return self.pricing.unpriced(counts)

    def price(self, name: str, counts: list[int]) -> Priced | None:
        plan = self.pricing.plan(counts)
        if plan is None or self.unpriced(counts):
            return None
        return Priced(self.kernels, self.L, name, plan.counts, plan.expected_ms, self.load_ms or 0.0, self.occ,
                      plan.graph_mem_bytes, self.slot_bytes, self.kv_token_bytes, plan.sources, self.miss)

    def step(self, counts: list[int]) -> Callable:
        """The expected step (ms) as a function of the medians."""
        def step(m):
            loads = self.occ.loads * m[self.load_key] if self.occ.loads > 0 else 0.0
            return self.pricing.expected_ms(counts, m) + loads + (0.0 if self.miss is None else self.miss.per_step(self.occ))
        return step

    def medians(self) -> dict:
        return {**self.model.medians, self.load_key: self.load_ms}


def _median_of(rows: pd.DataFrame, column: str) -> float | None:
    """The median of the workers' medians in ``column`` (None: the run has none)."""
    if column not in rows:
        return None
    values = rows.drop_duplicates("max_loras")[column].dropna()
    return float(values.median()) if len(values) else None


def _costs(view: RunView, kernels: str, max_loras: int) -> tuple[float | None, int, int, MissPrice | None]:
    """(the load's ms, the slots' bytes, a KV-cache token's bytes, the misses' price) at (kernels, max_loras)."""
    ok = view.compared
    mine = ok[ok.kernels == kernels]
    loads = view.pooled_loads.get(kernels)
    load_ms = float(np.median(loads)) if loads is not None and len(loads) else _median_of(mine, "load_ms_median")
    first = mine[mine.max_loras == max_loras].iloc[0]
    slot_bytes = int(first.lora_bytes_per_slot) * max_loras if pd.notna(first.lora_bytes_per_slot) else 0
    read_ms = _median_of(mine, "storage_read_cold_ms_median")
    gb_s, fixed = _median_of(mine, "storage_read_cold_gb_s"), _median_of(mine, "storage_read_cold_fixed_ms")
    miss = None if read_ms is None else MissPrice(read_ms, None if gb_s is None else gb_s * 1e6, fixed or 0.0)
    return load_ms, slot_bytes, kv_bytes_per_token(first), miss


@dataclass(frozen=True)
class PathPrice:
    """The chosen configuration with its loads made another way."""

    path: str
    load_ms: float  # what one load adds to the step that needs it
    step_ms: float
    tokens_per_s: float
    engine: str  # how a server takes this path


# The load paths a run times (lorabench.runtime.load_paths): the rows' column of what one load adds to a step, and
# the engine flag that selects it.
LOAD_PATHS = {
    "per-slice": (None, "vLLM's and SGLang's default: every slice zeroed and copied"),
    "one-copy": ("load_one_copy_ms_median", "no flag in vLLM 0.33 (one contiguous pinned buffer per adapter: vLLM #31317)"),
    "overlapped": ("load_overlap_lost_ms_median", "SGLang's --enable-lora-overlap-loading (vLLM #41785 proposes it); "
                                                  "priced as what a step beside the load loses, and the waiting "
                                                  "request's tokens until its adapter is usable"),
}
OVERLAP_USABLE = "load_overlap_usable_ms_median"


def overlapped_tokens(tokens: float, loads: float, usable_ms: float, step_ms: float) -> float:
    """Tokens per step when each load runs beside the steps: the request that needs the adapter
    decodes nothing until it is usable, ``usable_ms / step_ms`` steps, while the others go on (a
    first-order estimate: one request per load, the steps it waits at their mean length)."""
    return max(tokens - loads * usable_ms / step_ms, 0.0)


def path_prices(view: RunView, p: Priced) -> list[PathPrice]:
    """``p``'s expected step and tokens/s with its loads made on each path the run timed (per-slice: ``p`` itself)."""
    rows = view.compared[view.compared.kernels == p.kernels]
    out = []
    for path, (column, engine) in LOAD_PATHS.items():
        load_ms = p.load_ms if column is None else _median_of(rows, column)
        if load_ms is None:
            continue
        step = p.decode_ms + p.occ.loads * load_ms + p.miss_ms_per_step
        tokens = p.occ.tokens
        if path == "overlapped":
            usable = _median_of(rows, OVERLAP_USABLE)
            if usable is None:
                continue
            tokens = overlapped_tokens(tokens, p.occ.loads, usable, step)
        out.append(PathPrice(path, load_ms, step, 1e3 * tokens / step, engine))
    return out


def throughput_gain(view: RunView, a: tuple[Pricer, Priced], b: tuple[Pricer, Priced]) -> Gain:
    """A's tokens per second over B's, in % (positive: A serves more), with its interval."""
    (pa, ca), (pb, cb) = a, b
    sa, sb = pa.step(ca.counts), pb.step(cb.counts)

    def stat(m):
        return 100 * (pa.occ.tokens / sa(m) * sb(m) / pb.occ.tokens - 1)

    iv, why = interval_of(view.resampler, stat, points_read(stat, {**pa.medians(), **pb.medians()}))
    return Gain(100 * (ca.tokens_per_s / cb.tokens_per_s - 1), iv, why)


WINDOWS = 16  # simulated runs as long as a residency run: the spread of their tokens/s (``window_sd_pct``)


def _path_load_ms(view: RunView, kernels: str, path: str) -> float | None:
    """What one load along ``path`` costs (None: vLLM's per-slice path, the pooled loads' price)."""
    column = LOAD_PATHS[path][0] if path in LOAD_PATHS else None
    if column is None:
        return None
    load_ms = _median_of(view.compared[view.compared.kernels == kernels], column)
    if load_ms is None:
        raise ValueError(f"the run timed no {path} loads")
    return load_ms


def validation(view: RunView, steps: int = STEPS) -> pd.DataFrame:
    """Each residency row against its prediction: priced on the very steps it ran (their batch
    sizes, active counts and loads, from its samples: what the cost model gets wrong) and on the
    long simulation (what the recommendation says: adds the load rate's and the waiting's
    sampling). The measured figures are the row's mean step and tokens per second; the loads are
    priced as the recommendation prices them (pooled), along the run's ``--load-path`` (one-copy:
    its median in a step), and its CPU-cache misses at the cold storage read where the run read
    its adapters' files (else not at all: it loaded them from host memory). ``window_sd_pct``:
    how much ``WINDOWS`` simulated runs as long as this one differ in tokens/s (standard
    deviation, % of their mean): a long-run error within about twice it is chance."""
    rows = ok_points(view.kept)
    rows = rows[(rows["mode"] == "residency") & (rows.kernels.map(backend_of) != "vllm")]
    samples = view.steps if view.steps is not None else pd.DataFrame(columns=["point", "tokens", "n_active", "loads"])
    by_point = dict(tuple(samples.groupby("point"))) if len(rows) else {}
    out = []
    for r in rows.itertuples():
        own = by_point.get(r.point, samples.iloc[:0])
        entry = {"kernels": r.kernels, "max_loras": int(r.max_loras), "strategy": r.strategy, "workload": r.workload,
                 "clients": int(r.concurrency), "adapters": int(r.adapters), "point": int(r.point),
                 "measured_ms": float(r.step_ms_mean), "measured_tokens_per_s": float(r.tokens_per_s),
                 "loads_per_step": float(r.loads_per_step), "tokens_per_step": float(r.tokens_per_step)}
        counts = [int(x) for x in r.captured_counts]
        sizes = [int(b) for b in r.capture_sizes]
        files = getattr(r, "adapter_file_bytes", None)
        # its misses read their files within the steps: the user's adapters, in a run that reads them (not an older one)
        read = bool(pd.notna(getattr(r, "storage_reads_per_step", None)) and files is not None and len(files))
        path = getattr(r, "load_path", None) or "per-slice"
        entry["load_path"] = path
        try:
            if own.tokens.isna().any() or own.empty:
                raise ValueError("its samples lack the steps' tokens and loads")
            reads = own["reads"] if read and "reads" in own else None
            read_bytes = own["read_bytes"] if read and "read_bytes" in own else None
            same = occupancy(own.tokens, own.n_active, own.loads, sizes, int(r.max_loras), cpu_misses=reads,
                             miss_bytes=read_bytes)
            adapters = Adapters(int(r.adapters), int(r.max_cpu_loras), r.output_tokens,
                                tuple(int(b) for b in files) if files is not None and len(files) else ())
            long = simulated(r.workload, adapters, int(r.concurrency), int(r.max_loras), sizes, steps)
            load_ms = _path_load_ms(view, r.kernels, path)

            def as_run(occ: Occupancy) -> Priced | None:
                """Priced as the run loaded: along its load path, its misses read only where it read files."""
                p = Pricer(view, r.kernels, int(r.max_loras), occ).price(r.strategy, counts)
                if p is None:
                    return None
                return replace(p, miss=p.miss if read else None, load_ms=p.load_ms if load_ms is None else load_ms)

            p, q = as_run(same), as_run(long)
            short = [as_run(occ) for occ in windows(r.workload, adapters, int(r.concurrency), int(r.max_loras), sizes,
                                                    len(own), WINDOWS)]
            if all(x is not None for x in short):
                tps = np.array([x.tokens_per_s for x in short])
                entry["window_sd_pct"] = float(100 * tps.std() / tps.mean())
        except ValueError as e:
            p = q = None
            entry["why"] = str(e)
        if p is not None:
            entry.update(predicted_ms=p.step_ms, predicted_tokens_per_s=p.tokens_per_s,
                         error_pct=100 * (r.step_ms_mean / p.step_ms - 1))
        if q is not None:
            entry.update(long_run_ms=q.step_ms, long_run_tokens_per_s=q.tokens_per_s,
                         long_run_error_pct=100 * (r.tokens_per_s / q.tokens_per_s - 1))
        out.append(entry)
    return pd.DataFrame(out)
