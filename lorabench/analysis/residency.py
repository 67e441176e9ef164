"""The whole LoRA configuration under N adapters: max_loras from adapter residency, the capture
set, and what it costs in memory and KV cache.

For a workload over N adapters driven by C clients (``lorabench.config.residency``: vLLM's
admission, LRU slots, the CPU cache), a run's points price every (kernels, max_loras, capture
set) the run measured:

- the closed loop is simulated for ``STEPS`` steps at each max_loras: how the steps spread over
  batch sizes (each priced at its capture size's graph) and active counts, how many tokens run
  per step (requests wait when the batch already holds max_loras adapters), how many adapters
  are loaded into slots per step;
- the decode step is the cost model's (``lorabench.analysis.optimise.Optimiser``, each batch
  size weighted by its share of the steps), from the run's fixed points; every load adds the
  run's median load time (one adapter copied from pinned host memory into a slot, blocking, timed
  by every worker, pooled: ``pooled_loads``);
- tokens per second = tokens per step / expected step;
- memory: the set's graphs (the cost model's curve through the measured sets), max_loras adapter
  slots (``lora_bytes_per_slot`` each), and the KV-cache tokens the two would hold instead; the
  CPU cache's host memory (``max_cpu_loras`` adapters).

The choice: per max_loras the fastest measured set, kept only if the 95 % interval of its gain over
max clears ``PAYS`` (else max, the fewest graphs), and the cost model's own best set only if it
clears ``PAYS`` over that choice too (measured beats modelled); then, among max_loras that fit the GPU memory
budget, the one with the most tokens per second, or the smallest max_loras whose shortfall from it
is not shown to exceed ``PAYS`` (more slots cost KV cache). Intervals resample every fixed point
and the run's timed loads independently (``lorabench.stats.Resampler``); different
max_loras ran in different workers, so their comparisons carry ``APART_MARGIN_PCT``.

CPU misses (loads whose adapter is not in the CPU cache) are counted, not priced: lorabench does
not time reading adapters from storage, so where there are any the expected step is a lower
bound, and says so. vLLM's kernels run vLLM's own dispatch rules, which this cost model does not
price: they are shown as measured only.
"""

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import pandas as pd

from lorabench.analysis.compare import (
    APART_MARGIN_PCT,
    NO_SAMPLES,
    as_slower,
    interval_of,
    points_read,
)
from lorabench.analysis.costmodel import CostModel
from lorabench.analysis.optimise import Optimiser, PricedGain
from lorabench.analysis.points import configs, ok_points, same_gpu, verdicts, with_columns
from lorabench.analysis.recommend import (
    PAYS,
    UNVERIFIED_POW2,
    fully_sharded_of,
    tp_of,
    verified_pow2,
    vllm_flags,
)
from lorabench.config.backends import backend_of
from lorabench.config.limits import DTYPE_BYTES
from lorabench.config.residency import Adapters, simulate
from lorabench.config.strategies import BASELINE, STRATEGIES, choose_bucket, strategy
from lorabench.config.workload import parse_workload
from lorabench.stats import Interval, Resampler, describe

STEPS = 20_000  # simulated steps per (workload, max_loras): the load rate's sampling error is about 1 %
CARD = 4  # the card's max_loras (sweeps/card.toml): what a recommendation is compared with
AUTO_SET = "auto"  # the cost model's best set within the budget (lorabench.analysis.optimise)
LOAD = "load"  # the run's timed loads of a kernels label, keyed (LOAD, kernels) among the resampled points


@dataclass(frozen=True)
class Occupancy:
    """Steps in the cost model's terms: per batch size b (a capture size, or the batch itself
    when it runs eagerly), its share of the steps and P(n | b); and per step, the means of the
    batch's tokens, the loads, the CPU misses and the requests waiting for a slot."""

    weights: dict[int, float]
    pmf: dict[int, np.ndarray]
    tokens: float
    loads: float
    cpu_misses: float
    waiting: float
    steps: int


def occupancy(tokens, n_active, loads, capture_sizes: list[int], max_loras: int, cpu_misses=None,
              waiting=None) -> Occupancy:
    """The Occupancy of steps given per step (arrays of equal length)."""
    tokens, n_active = np.asarray(tokens, dtype=np.int64), np.asarray(n_active, dtype=np.int64)
    buckets = np.array([choose_bucket(int(t), capture_sizes) or int(t) for t in tokens], dtype=np.int64)
    weights, pmf = {}, {}
    for b in sorted(set(buckets.tolist())):
        here = n_active[buckets == b]
        weights[b] = len(here) / len(tokens)
        pmf[b] = np.bincount(np.minimum(here, min(b, max_loras)), minlength=min(b, max_loras) + 1) / len(here)
    mean = (lambda x: float(np.mean(x)) if x is not None else 0.0)
    return Occupancy(weights, pmf, float(tokens.mean()), mean(loads), mean(cpu_misses), mean(waiting), len(tokens))


def simulated(workload: str, adapters: Adapters, clients: int, max_loras: int, capture_sizes: list[int],
              steps: int = STEPS, seed: int = 0) -> Occupancy:
    """The loop's Occupancy, simulated once per setting (the report and its validation ask again)."""
    return _simulated(workload, adapters, clients, max_loras, tuple(capture_sizes), steps, seed)


@lru_cache(maxsize=256)
def _simulated(workload: str, adapters: Adapters, clients: int, max_loras: int, capture_sizes: tuple[int, ...],
               steps: int, seed: int) -> Occupancy:
    s = simulate(parse_workload(workload), adapters, clients, max_loras, steps, seed)
    return occupancy(s.tokens, s.n_active, s.n_loads, list(capture_sizes), max_loras, s.cpu_misses, s.waiting)


def kv_bytes_per_token(row) -> int:
    """KV cache one token takes on the row's GPU: K and V of every layer's KV heads (one TP
    rank's share)."""
    kv_heads = max(1, int(row["kv_heads"]) // tp_of(row))
    return 2 * int(row["layers"]) * kv_heads * int(row["head_dim"]) * DTYPE_BYTES[row["dtype"]]


@dataclass
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

    @property
    def step_ms(self) -> float:
        return self.decode_ms + self.occ.loads * self.load_ms

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

    def to_dict(self) -> dict:
        return {"kernels": self.kernels, "max_loras": self.max_loras, "strategy": self.strategy, "counts": self.counts,
                "expected_step_ms": round(self.step_ms, 4), "decode_ms": round(self.decode_ms, 4),
                "load_ms": round(self.load_ms, 4), "loads_per_step": round(self.occ.loads, 5),
                "tokens_per_step": round(self.occ.tokens, 3), "tokens_per_s": round(self.tokens_per_s, 1),
                "waiting_per_step": round(self.occ.waiting, 3), "cpu_misses_per_step": round(self.occ.cpu_misses, 5),
                "graph_mem_bytes": None if self.graph_mem_bytes is None else int(self.graph_mem_bytes),
                "slot_bytes": self.slot_bytes, "kv_tokens_given_up": self.kv_tokens, "model_values": self.values}


class Pricer:
    """Prices capture sets at one (kernels, max_loras) for an Occupancy, as numbers and as a
    function of the resampled medians (the fixed points' and the timed loads')."""

    def __init__(self, df: pd.DataFrame, kernels: str, max_loras: int, occ: Occupancy, rs: Resampler | None,
                 loads: np.ndarray | None = None, model: CostModel | None = None):
        """loads: the run's timed loads of these kernels, every worker's (``pooled_loads``); without
        them, the median of the workers' medians. model: the run's CostModel of (kernels,
        max_loras), when the caller prices several occupancies with it."""
        ok = ok_points(df)
        rows = ok[(ok.kernels == kernels) & (ok.max_loras == max_loras)]
        self.kernels, self.L, self.occ, self.rs = kernels, max_loras, occ, rs
        self.model = model if model is not None else CostModel(df, kernels, max_loras)
        self.opt = Optimiser(self.model, occ.pmf, occ.weights)
        self.priced = PricedGain(df, self.opt, rs)
        self.load_key = (LOAD, kernels)
        medians = ok[ok.kernels == kernels].drop_duplicates("max_loras").load_ms_median.dropna()
        self.load_ms = (float(np.median(loads)) if loads is not None and len(loads)
                        else float(medians.median()) if len(medians) else None)
        first = rows.iloc[0]
        self.slot_bytes = int(first.lora_bytes_per_slot) * max_loras if pd.notna(first.lora_bytes_per_slot) else 0
        self.kv_token_bytes = kv_bytes_per_token(first)

    def unpriced(self, counts: list[int]) -> str | None:
        if self.load_ms is None and self.occ.loads > 0:
            return f"the run timed no adapter loads of {self.kernels} (made before lorabench timed them)"
        return self.opt.unpriced(counts)

    def price(self, name: str, counts: list[int]) -> Priced | None:
        plan = self.opt.evaluate(counts)
        if plan is None or self.unpriced(counts):
            return None
        return Priced(self.kernels, self.L, name, plan.counts, plan.expected_ms, self.load_ms or 0.0, self.occ,
                      plan.graph_mem_bytes, self.slot_bytes, self.kv_token_bytes, plan.sources)

    def step(self, counts: list[int]):
        """The expected step (ms) as a function of the medians."""
        def step(m):
            loads = self.occ.loads * m[self.load_key] if self.occ.loads > 0 else 0.0
            return self.priced.expected(m, {}, counts) + loads
        return step

    def medians(self) -> dict:
        return {**self.priced.medians, self.load_key: self.load_ms}


MORE = ("more tokens/s", "fewer tokens/s")


def describe_more(gain: Interval | None, why: str | None = None, margin_pct: float = 0.0) -> str:
    """A throughput gain (%, positive: more tokens/s) in words: "more tokens/s by 6.6 % (95 % CI
    3.7…10.1)", "no difference detected (...)", or "no interval: why"."""
    return describe(as_slower(gain), margin_pct, MORE) if gain is not None else f"no interval: {why or NO_SAMPLES}"


def pooled_loads(loads: dict | None) -> dict[str, np.ndarray]:
    """kernels -> every worker's timed loads: a load copies the same bytes in the same operations
    whatever max_loras, and it is host-bound (hundreds of small copies queued one by one), so what
    varies between workers is the host's speed at the moment, not the load: every sample counts."""
    out: dict[str, list] = {}
    for (k, _), v in sorted((loads or {}).items()):
        out.setdefault(k, []).append(np.asarray(v, dtype=float))
    return {k: np.concatenate(v) for k, v in out.items()}


def throughput_gain(a: tuple[Pricer, list[int]], b: tuple[Pricer, list[int]]):
    """Statistic: A's tokens per second over B's, in % (positive: A serves more)."""
    (pa, ca), (pb, cb) = a, b
    sa, sb = pa.step(ca), pb.step(cb)
    return lambda m: 100 * (pa.occ.tokens / sa(m) * sb(m) / pb.occ.tokens - 1)


def gain_interval(rs: Resampler | None, a: tuple[Pricer, list[int]], b: tuple[Pricer, list[int]]):
    """(interval of A's throughput gain over B in %, or None and why)."""
    stat = throughput_gain(a, b)
    return interval_of(rs, stat, points_read(stat, {**a[0].medians(), **b[0].medians()}))


def _pays(rs, pricer: Pricer, a: Priced, b: Priced) -> tuple[bool, str, Interval | None]:
    """Does A serve at least PAYS more tokens per second than B (the low end of the interval of
    its gain; the medians alone when there is none)? With the words that say so."""
    iv, why = gain_interval(rs, (pricer, a.counts), (pricer, b.counts))
    if iv is None:
        gain = 100 * (a.tokens_per_s / b.tokens_per_s - 1)
        return gain >= 100 * PAYS, f"{gain:.1f} % more tokens/s (medians alone: {why})", None
    return iv.low >= 100 * PAYS, describe_more(iv), iv


def set_name(config: dict) -> str:
    """A priced configuration's (``Priced.to_dict``) capture set as ``--strategy`` takes it: its
    strategy's name, or the cost model's own set as a list, "[24,32,64]"."""
    return config["strategy"] if config["strategy"] != AUTO_SET else "[" + ",".join(map(str, config["counts"])) + "]"


def _name(p: Priced) -> str:
    return f"{p.strategy} {p.counts}" if p.strategy != AUTO_SET else f"the cost model's set {p.counts}"


def _set_at(pricer: Pricer, measured: dict[str, list[int]], memory_bytes: float | None, rs) -> dict:
    """The capture set at one max_loras, by the report's rules: the fastest measured set is kept
    over max only when the interval of its gain clears PAYS (else max, the fewest graphs), and the
    cost model's best set within the graph-memory budget, which the run did not measure, only when
    it clears PAYS over that choice too (measured beats modelled)."""
    sets = dict(measured)
    try:
        best = pricer.opt.best(memory_bytes)
    except ValueError:
        best = None
    if best is not None and best.counts not in sets.values():
        sets[AUTO_SET] = best.counts
    priced = {name: p for name, c in sets.items() if (p := pricer.price(name, c)) is not None}
    if BASELINE not in priced:
        why = pricer.unpriced(sets.get(BASELINE, [pricer.L]))
        return {"chosen": None, "priced": priced, "reason": f"max cannot be priced: {why}"}
    fits = {n: p for n, p in priced.items() if memory_bytes is None or (p.graph_mem_bytes or 0) <= memory_bytes + 1}
    base = priced[BASELINE]
    chosen, reason = base, "max is the fastest measured set"
    known = [p for n, p in fits.items() if n != AUTO_SET]
    fastest = min(known, key=lambda p: p.step_ms) if known else base
    if fastest is not base:
        ok, words, _ = _pays(rs, pricer, fastest, base)
        reason = f"{_name(fastest)} vs max: {words}"
        if ok:
            chosen = fastest
        else:
            reason += f"; not shown to clear {100 * PAYS:g} %, so max, the fewest graphs"
    model = fits.get(AUTO_SET)
    if model is not None and model.step_ms < chosen.step_ms:
        ok, words, _ = _pays(rs, pricer, model, chosen)
        if ok:
            reason += f"; {_name(model)} vs {_name(chosen)}: {words}, so the model's set (measure it)"
            chosen = model
        else:
            reason += f"; {_name(model)} vs it: {words}, not shown to clear {100 * PAYS:g} %: measured beats modelled"
    gain = None if chosen is base else _pays(rs, pricer, chosen, base)[2]  # the choice's gain over max
    return {"chosen": chosen, "priced": priced, "reason": reason,
            "gain_interval_pct": None if gain is None else gain.to_dict()}


def residency_recommendations(df: pd.DataFrame, workload: str, adapters: Adapters, clients: int | None = None,
                              gpu_memory_bytes: float | None = None, kernels: list[str] | None = None,
                              max_loras: list[int] | None = None, samples=None, loads=None,
                              steps: int = STEPS) -> list[dict]:
    """Per lorabench kernels label of the run: every (max_loras, capture set) priced under the
    workload over ``adapters``, driven by ``clients`` clients (default: the run's largest
    concurrency), and the chosen configuration (see the module's docstring). ``samples``: the run's
    samples (point -> step times); ``loads``: its timed loads ((kernels, max_loras) -> ms)."""
    df = with_columns(df)
    df, _ = same_gpu(df)
    ok = ok_points(df)
    if "correct" in ok:
        ok = ok[~ok.correct.eq(False)]
    fixed = ok[ok["mode"] == "fixed"]
    pooled = pooled_loads(loads)
    keyed = dict(samples or {})
    keyed.update({(LOAD, k): v for k, v in pooled.items()})
    rs = Resampler(keyed) if keyed else None
    measured_sets: dict[tuple[str, int], dict[str, list[int]]] = {}
    for r in configs(df).itertuples():
        if r.strategy in STRATEGIES and STRATEGIES[r.strategy].fixed and r.correct is not False:
            measured_sets.setdefault((r.kernels, int(r.max_loras)), {})[r.strategy] = [int(x) for x in r.captured_counts]
    out = []
    for k, g in fixed.groupby("kernels"):
        if (kernels and k not in kernels) or backend_of(k) == "vllm":
            continue
        top = int(g.concurrency.max())
        c = clients or top
        if c > top:
            raise ValueError(f"{c} clients need fixed points up to concurrency {c}; the run has them up to {top}")
        entry = {"kernels": k, "workload": parse_workload(workload).name, "adapters": adapters.count,
                 "max_cpu_loras": adapters.cpu_slots, "output_tokens": adapters.output_tokens, "clients": c,
                 "gpu_memory_budget_bytes": gpu_memory_bytes, "at": {}, "configs": []}
        pricers: dict[int, Pricer] = {}
        for m in sorted(int(x) for x in g.max_loras.unique()):
            if max_loras and m not in max_loras:
                continue
            if m > adapters.cpu_slots:
                entry["at"][m] = {"chosen": None, "reason": f"above --max-cpu-loras {adapters.cpu_slots} "
                                  "(vLLM's CPU cache holds at least the GPU's slots)"}
                continue
            sizes = [int(b) for b in g[g.max_loras == m].capture_sizes.iloc[0]]
            occ = simulated(workload, adapters, c, m, sizes, steps)
            pricers[m] = p = Pricer(df, k, m, occ, rs, pooled.get(k))
            slots = p.slot_bytes
            graph_budget = None if gpu_memory_bytes is None else gpu_memory_bytes - slots
            if graph_budget is not None and graph_budget < 0:
                entry["at"][m] = {"chosen": None, "reason": f"its {m} adapter slots alone take more than the budget"}
                continue
            at = _set_at(p, measured_sets.get((k, m), {}), graph_budget, rs)
            entry["at"][m] = at
            entry["configs"] += [x.to_dict() for x in at["priced"].values()]
        _choose(entry, pricers, rs, gpu_memory_bytes)
        _describe(entry, ok, verdicts(df))
        out.append(entry)
    return out


def _choose(entry: dict, pricers: dict[int, Pricer], rs, budget: float | None) -> None:
    """Across max_loras: the most tokens per second, or the smallest max_loras not shown to
    fall more than PAYS short of it (its interval's low end below PAYS)."""
    chosen = {m: at["chosen"] for m, at in entry["at"].items() if at.get("chosen") is not None}
    chosen = {m: p for m, p in chosen.items() if budget is None or p.gpu_bytes is None or p.gpu_bytes <= budget + 1}
    entry.update(chosen=None, versus_best=None, versus_card=None)
    if not chosen:
        entry["reason"] = "no max_loras has a configuration priced within the budget: " + "; ".join(
            f"max_loras {m}: {at.get('reason')}" for m, at in entry["at"].items())
        return
    best = max(chosen.values(), key=lambda p: p.tokens_per_s)
    pick, why = best, "the most tokens per second"
    for m in sorted(chosen):
        p = chosen[m]
        if m >= best.max_loras:
            break
        iv, no = gain_interval(rs, (pricers[best.max_loras], best.counts), (pricers[m], p.counts))
        short = iv.low if iv is not None else 100 * (best.tokens_per_s / p.tokens_per_s - 1)
        if short < 100 * PAYS:
            pick = p
            why = (f"max_loras {best.max_loras} serves the most tokens per second, "
                   + (f"{describe_more(iv, margin_pct=APART_MARGIN_PCT)} than {m} slots" if iv is not None
                      else f"{short:.1f} % more than {m} slots (medians alone: {no})")
                   + f", not shown to clear {100 * PAYS:g} %: so {m}, the fewer slots")
            entry["versus_best"] = None if iv is None else iv.to_dict()
            break
    entry["chosen"] = pick.to_dict()
    entry["reason"] = why + f"; {entry['at'][pick.max_loras]['reason']}"
    card_max = (entry["at"].get(CARD) or {}).get("priced", {}).get(BASELINE)
    if card_max is not None and (pick.max_loras, pick.counts) != (CARD, card_max.counts):
        iv, no = gain_interval(rs, (pricers[pick.max_loras], pick.counts), (pricers[CARD], card_max.counts))
        entry["versus_card"] = {
            "max_loras": CARD, "strategy": BASELINE, "tokens_per_s": round(card_max.tokens_per_s, 1),
            "expected_step_ms": round(card_max.step_ms, 4),
            "gain_pct": round(100 * (pick.tokens_per_s / card_max.tokens_per_s - 1), 2),
            "gain_interval_pct": None if iv is None else iv.to_dict(),
            "verdict": describe_more(iv, no, APART_MARGIN_PCT)}


def _describe(entry: dict, ok: pd.DataFrame, checked: pd.DataFrame) -> None:
    """The vLLM flags, what the prices leave out, and the sweep that validates the choice."""
    for at in entry["at"].values():  # Priced objects stay out of the JSON
        at.pop("priced", None)
        if at.get("chosen") is not None:
            at["chosen"] = at["chosen"].to_dict() if isinstance(at["chosen"], Priced) else at["chosen"]
    c = entry["chosen"]
    entry["notes"] = []
    if c is None:
        entry["vllm"] = None
        entry["validate"] = None
        return
    if c["cpu_misses_per_step"] > 0:
        entry["notes"].append(f"{1000 * c['cpu_misses_per_step']:.1f} loads per 1000 steps miss the CPU cache of "
                              f"{entry['max_cpu_loras']}: their reads from storage are not priced, so the expected step "
                              "is a lower bound")
    first = ok.iloc[0]
    m = c["max_loras"]
    pow2 = strategy("pow2").counts(m)
    specialise = c["counts"] == pow2 and c["counts"] != [m]
    flags = vllm_flags(m, int(first["rank"]), specialise, tp_of(first), fully_sharded_of(first))
    flags += f" --max-cpu-loras {max(entry['max_cpu_loras'], m)}"
    note = "vLLM captures max_loras+1 (and powers of two with --specialize-active-lora)"
    if c["counts"] not in ([m], pow2):
        note += f"; the set {c['counts']} is lorabench's own, so the flags give vLLM's default"
    if specialise and not verified_pow2(checked):
        note += "; " + UNVERIFIED_POW2
    entry["vllm"] = {"flags": flags, "note": note}
    slots = sorted({m} | ({CARD} & set(entry["at"]) if CARD <= entry["max_cpu_loras"] else set()))
    strategies = sorted({set_name(c), BASELINE})
    sizes = sorted({int(b) for b in first.capture_sizes if int(b) <= entry["clients"]} | {entry["clients"]})
    entry["validate"] = (f"lorabench sweep --max-loras {','.join(map(str, slots))} --strategy '{','.join(strategies)}' "
                         f"--concurrency {','.join(map(str, sizes))} --kernels {entry['kernels']} "
                         f"--workload {entry['workload']} --adapters {entry['adapters']} "
                         f"--max-cpu-loras {entry['max_cpu_loras']} --output-tokens {entry['output_tokens']} "
                         f"--model {first.model} --rank {int(first['rank'])} --iters 1000 --ci-target 0.5")


def validation(df: pd.DataFrame, samples: pd.DataFrame, loads: dict | None = None, steps: int = STEPS) -> pd.DataFrame:
    """Each residency row against its prediction: priced on the very steps it ran (their batch
    sizes, active counts and loads, from its samples: what the cost model gets wrong) and on the
    long simulation (what the recommendation says: adds the load rate's and the waiting's
    sampling). The measured figures are the row's mean step and tokens per second; the loads are
    priced as the recommendation prices them (``pooled_loads``)."""
    df = with_columns(df)
    pooled = pooled_loads(loads)
    rows = ok_points(df)
    rows = rows[(rows["mode"] == "residency") & (rows.kernels.map(backend_of) != "vllm")]
    models: dict[tuple[str, int], CostModel] = {}  # one per (kernels, max_loras): every row of it prices twice
    out = []
    for r in rows.itertuples():
        own = samples[samples.point == r.point]
        entry = {"kernels": r.kernels, "max_loras": int(r.max_loras), "strategy": r.strategy, "workload": r.workload,
                 "clients": int(r.concurrency), "adapters": int(r.adapters), "point": int(r.point),
                 "measured_ms": float(r.step_ms_mean), "measured_tokens_per_s": float(r.tokens_per_s),
                 "loads_per_step": float(r.loads_per_step), "tokens_per_step": float(r.tokens_per_step)}
        counts = [int(x) for x in r.captured_counts]
        sizes = [int(b) for b in r.capture_sizes]
        try:
            if own.tokens.isna().any() or own.empty:
                raise ValueError("its samples lack the steps' tokens and loads")
            same = occupancy(own.tokens, own.n_active, own.loads, sizes, int(r.max_loras))
            key = (r.kernels, int(r.max_loras))
            if key not in models:
                models[key] = CostModel(df, *key)
            p = Pricer(df, *key, same, None, pooled.get(r.kernels), models[key]).price(r.strategy, counts)
            adapters = Adapters(int(r.adapters), int(r.max_cpu_loras), int(r.output_tokens))
            long = simulated(r.workload, adapters, int(r.concurrency), int(r.max_loras), sizes, steps)
            q = Pricer(df, *key, long, None, pooled.get(r.kernels), models[key]).price(r.strategy, counts)
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
