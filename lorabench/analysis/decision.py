"""What was decided, and on what evidence, as values: the report's choice among the strategies a
run measured (``MeasuredDecision``), strategy auto's capture set (``AutoDecision``), and the whole
LoRA configuration under residency (``SetChoice`` at each max_loras, ``ResidencyDecision`` across
them). Each holds what was chosen, the gains it rests on (an interval, or the medians and why
not), what was rejected and why, and what more measuring would settle; nothing here is text.
Their reasons are written by ``lorabench.analysis.reasons`` and their JSON by
``lorabench.analysis.recommendation_json``, from these values alone.

One rule runs through all of them: an option with more graphs (or more slots) is taken over the
one with fewer only when it is at least ``PAYS`` better: with samples, the low end of the 95 %
interval of its gain; without, its medians' gain.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from lorabench.analysis.compare import Comparison
from lorabench.analysis.costmodel import Plan
from lorabench.analysis.intervals import Gain
from lorabench.analysis.residency_price import PathPrice, Priced
from lorabench.analysis.vllm import VllmAdvice
from lorabench.config.residency import Adapters
from lorabench.config.strategies import BASELINE

PAYS = 0.02  # an option must be >= 2 % better than the one with fewer graphs to be worth its graphs
PAYS_PCT = 100 * PAYS


class Basis(Enum):
    """What a choice among measured strategies rests on."""

    INTERVAL = "interval"  # the 95 % interval of every candidate's gain
    MEDIANS = "medians"  # the medians alone: some candidate's gain has no interval
    NONE = "none"  # nothing to decide: no strategy other than max passed


@dataclass(frozen=True)
class Rejection:
    """A configuration left out of the choice: it failed its correctness check (``why``: the check's detail)."""

    strategy: str
    why: str | None


@dataclass(frozen=True)
class Costs:
    """What a measured configuration's graphs cost: its FULL graphs (decode), its build and their
    capture; and, where the run has mixed steps, its PIECEWISE graphs (None without), which vLLM
    captures per active count too and which a server pays for at startup beside the FULL ones."""

    counts: list[int]
    graphs: int | None
    graph_mem_bytes: int | None
    startup_s: float | None  # build, compile and the FULL graphs' capture
    mixed_graphs: int | None = None
    mixed_graph_mem_bytes: int | None = None
    mixed_capture_s: float | None = None

    def describe(self) -> str:
        """'N graphs', or with PIECEWISE graphs 'N FULL + M PIECEWISE graphs, PIECEWISE X MiB captured in Y s'."""
        if not self.mixed_graphs:
            return f"{self.graphs} graphs"
        out = f"{self.graphs} FULL + {self.mixed_graphs} PIECEWISE graphs"
        if self.mixed_graph_mem_bytes is not None:
            out += f", PIECEWISE {self.mixed_graph_mem_bytes / 2**20:.0f} MiB"
        if self.mixed_capture_s is not None:
            out += f" captured in {self.mixed_capture_s:.2f} s"
        return out


@dataclass(frozen=True)
class MeasuredDecision:
    """The report's choice at one (kernels, max_loras, workload), from its ``comparison``: the
    fastest complete strategy that passed its check and clears ``PAYS`` over max, else max."""

    comparison: Comparison
    capture_sizes: tuple[int, ...]
    vllm: VllmAdvice
    chosen: str | None = None
    fastest: str | None = None  # the fastest complete strategy, whether it passed its check or not
    ranked: tuple[str, ...] = ()  # the complete strategies that passed their check, fastest first
    gains: Mapping[str, Gain] = field(default_factory=dict)  # every comparable strategy against max (max: 0)
    basis: Basis = Basis.NONE
    why_medians: str | None = None  # why some candidate's gain has no interval (basis MEDIANS)
    cleared: tuple[str, ...] = ()  # candidates whose gain clears PAYS on the basis
    open: tuple[str, ...] = ()  # candidates whose interval reaches past PAYS without clearing it
    settle: str | None = None  # the steps per point that would settle the most promising open one
    rejected: tuple[Rejection, ...] = ()
    costs: Costs | None = None  # the chosen configuration's
    max_costs: Costs | None = None
    unavailable: str | None = None  # why nothing is proposed (nothing comparable, every strategy wrong)
    pays_pct: float = PAYS_PCT

    @property
    def kernels(self) -> str:
        return self.comparison.kernels

    @property
    def max_loras(self) -> int:
        return self.comparison.max_loras

    @property
    def workload(self) -> str:
        return self.comparison.workload

    @property
    def fastest_ok(self) -> str | None:
        return self.ranked[0] if self.ranked else None

    @property
    def inconclusive(self) -> bool:
        """Max was kept, but an interval still reaches past PAYS: more steps could change the answer."""
        return self.basis is Basis.INTERVAL and not self.cleared and bool(self.open) and self.chosen == BASELINE

    @property
    def more_measuring(self) -> str | None:
        return self.settle if self.inconclusive else None


@dataclass(frozen=True)
class AutoDecision:
    """Strategy auto at one (kernels, max_loras): the cost model's best set within the budgets
    (``proposed``), held to the report's rules: it must clear ``PAYS`` over max (``gain``), and
    what the run measured beats what the model predicts (``measured_as``, ``report_plan``)."""

    measured: MeasuredDecision  # the report's choice, on the same comparison
    capture_sizes: tuple[int, ...]
    concurrency: tuple[int, ...]  # the concurrencies priced over (the comparison's grid)
    memory_bytes: float | None = None  # the budgets
    startup_s: float | None = None
    chosen: Plan | None = None
    proposed: Plan | None = None
    gain: Gain | None = None  # the proposal's predicted gain over max (None: the proposal is max)
    measured_as: tuple[str, ...] = ()  # measured strategies whose set the set kept is, which the report does not propose
    report_set: tuple[int, ...] | None = None  # the report's choice's set, where the rules turn to it and auto knows it
    report_plan: Plan | None = None  # that set as the model prices it (None: it cannot)
    report_fits: bool = False  # that set fits the budgets
    baselines: Mapping[str, Plan] = field(default_factory=dict)  # max, pow2, dense as the model prices them
    vllm: VllmAdvice | None = None
    validate: str | None = None  # the sweep that measures the chosen set
    unavailable: str | None = None  # why there is no set (nothing comparable; not even max fits)
    pays_pct: float = PAYS_PCT

    @property
    def kernels(self) -> str:
        return self.measured.kernels

    @property
    def max_loras(self) -> int:
        return self.measured.max_loras

    @property
    def workload(self) -> str:
        return self.measured.workload

    @property
    def max_plan(self) -> Plan | None:
        return self.baselines.get(BASELINE)

    @property
    def specialised(self) -> bool:
        """The proposal has counts other than max's."""
        return self.proposed is not None and self.proposed.counts != [self.max_loras]

    @property
    def kept(self) -> Plan | None:
        """The proposal once held to PAYS: itself when it clears it (or is max), else max."""
        if not self.specialised or self.gain.clears(self.pays_pct):
            return self.proposed
        return self.max_plan

    @property
    def report_inconclusive(self) -> bool:
        """Max kept because the model's set is a measured one the report does not propose, and
        the report itself is inconclusive."""
        return bool(self.measured_as) and self.chosen.counts == [self.max_loras] and self.measured.inconclusive

    @property
    def inconclusive(self) -> bool:
        return self.report_inconclusive or (self.specialised and self.gain.open(self.pays_pct))

    @property
    def more_measuring(self) -> str | None:
        if self.report_inconclusive:
            return self.measured.more_measuring
        return self.gain.settle(self.pays_pct) if self.inconclusive else None


@dataclass(frozen=True)
class SetChoice:
    """The capture set at one max_loras under residency: the fastest measured set within the
    budget, kept over max only when its throughput gain clears ``PAYS``; the cost model's own set
    only when it clears ``PAYS`` over that choice too (measured beats modelled)."""

    max_loras: int
    chosen: Priced | None = None
    priced: Mapping[str, Priced] = field(default_factory=dict)  # every set priced here (measured, the model's)
    fastest: Priced | None = None  # the fastest measured set within the budget, when it is not max
    fastest_gain: Gain | None = None  # its throughput gain over max
    model: Priced | None = None  # the model's own set, when it fits and is faster than the measured choice
    model_gain: Gain | None = None  # its gain over the measured choice
    gain: Gain | None = None  # the choice's gain over max (None: the choice is max)
    unavailable: str | None = None  # why nothing is priced here
    pays_pct: float = PAYS_PCT

    @property
    def measured_choice(self) -> Priced | None:
        """The choice among the measured sets, before the model's set is considered."""
        if self.fastest is not None and self.fastest_gain.clears(self.pays_pct):
            return self.fastest
        return self.priced.get(BASELINE)


@dataclass(frozen=True)
class CacheSize:
    """One CPU cache size, priced for the chosen configuration."""

    size: int  # adapters the cache holds
    host_bytes: float  # what they take in host memory (one worker process's)
    misses_per_step: float
    step_ms: float
    tokens_per_s: float

    @property
    def host_gib(self) -> float:
        return self.host_bytes / 2**30


@dataclass(frozen=True)
class CacheChoice:
    """The candidate sizes and the one chosen (None: not chosen, ``why`` says why)."""

    sizes: tuple[CacheSize, ...] = ()
    chosen: CacheSize | None = None
    why: str = ""
    host_budget_bytes: float | None = None


@dataclass(frozen=True)
class ResidencyDecision:
    """The whole LoRA configuration for one kernels label under residency: across the max_loras
    that fit the budget, the most tokens per second (``best``), or the fewest slots whose
    shortfall from it is not shown to exceed ``PAYS`` (``fewer``: best's gain over the choice)."""

    kernels: str
    workload: str
    adapters: Adapters
    clients: int
    gpu_memory_bytes: float | None = None
    at: Mapping[int, SetChoice] = field(default_factory=dict)
    chosen: Priced | None = None
    best: Priced | None = None
    fewer: Gain | None = None
    card: Priced | None = None  # the card's configuration (max_loras 4, max), when the choice is another
    card_gain: Gain | None = None  # the choice's throughput gain over it
    notes: tuple[str, ...] = ()  # what the prices leave out
    vllm: VllmAdvice | None = None
    validate: str | None = None
    unavailable: str | None = None  # why nothing could be priced at all
    pays_pct: float = PAYS_PCT
    load_paths: tuple[PathPrice, ...] = ()  # the choice under each load path the run timed
    cpu_cache: CacheChoice | None = None  # --max-cpu-loras chosen (None: given, every adapter by default)

    @property
    def configs(self) -> list[Priced]:
        """Every configuration priced, by max_loras."""
        return [p for at in self.at.values() for p in at.priced.values()]
