"""Capture-set strategies, and the dispatch rule that picks a graph for each batch.

A strategy says which launch counts get their own graph set (every set contains ``max_loras``,
so any batch can be served) and how a graph's grid is sized. A strategy is plain data: its name,
the ``Rule`` its counts follow, and how vLLM realises it; a new one is one ``register`` line
(a new kind of set: one ``Rule`` and its case in ``Strategy.counts``). Everything else (the plan,
the worker, the report, the recommendation, strategy auto's baselines) reads what it needs from
the value. An explicit list is written ``[1,2,4]``; ``auto`` is chosen by the optimiser when a
sweep is planned.

Dispatch: bucket = smallest capture size >= the batch's tokens; launch count = smallest captured
count >= the batch's active count n; n = 0 uses the no-LoRA graph (no LoRA kernels at all),
which the dispatcher always captures; a batch larger than every capture size runs eagerly.
"""

import bisect
from dataclasses import dataclass
from enum import Enum
from functools import cache

BASELINE = "max"  # what every gain is measured against: no specialisation, what a server runs by default
AUTO = "auto"  # chosen per (kernels, max_loras) by lorabench.analysis.optimise; its counts travel in the plan


class Vllm(Enum):
    """How vLLM's runner realises a strategy (``lorabench.runtime.vllm_rules``)."""

    DEFAULT = "vLLM's default: one LoRA key, grid max_loras + 1"
    SPECIALISE = "--specialize-active-lora: vLLM's own powers of two"
    EMULATED = "vLLM's runner with these counts as keys (no vLLM flag does this)"
    NONE = "no vLLM equivalent"


class Rule(Enum):
    """How a strategy's launch counts follow from max_loras."""

    ALL_SLOTS = "max_loras alone"
    POWERS_OF_TWO = "the powers of two below max_loras, and max_loras"
    DENSE = "every count 1..max_loras"
    LISTED = "the listed counts, which must lie in 1..max_loras and hold max_loras"
    CHOSEN = "chosen when a sweep is planned (strategy auto, from --auto-from)"


@dataclass(frozen=True)
class Strategy:
    """A capture set: ``counts(max_loras)`` -> the sorted launch counts that get graphs."""

    name: str
    rule: Rule
    listed: tuple[int, ...] = ()  # Rule.LISTED: the counts, sorted
    bucket_grid: bool = False  # each bucket's graph is launched with min(bucket, max_loras) programs, whatever n
    vllm: Vllm = Vllm.EMULATED
    doc: str = ""

    @property
    def fixed(self) -> bool:
        """A set of counts with count-sized grids: what strategy auto prices and compares with."""
        return not self.bucket_grid and self.rule is not Rule.CHOSEN

    def counts(self, max_loras: int) -> list[int]:
        """The sorted launch counts at ``max_loras``; ValueError for a list that does not fit it,
        and for auto (its counts are in the plan)."""
        if self.rule is Rule.ALL_SLOTS:
            return [max_loras]
        if self.rule is Rule.POWERS_OF_TWO:
            return sorted({1 << i for i in range(max_loras.bit_length()) if 1 << i < max_loras} | {max_loras})
        if self.rule is Rule.DENSE:
            return list(range(1, max_loras + 1))
        if self.rule is Rule.LISTED:
            if self.listed[0] < 1 or self.listed[-1] > max_loras:
                raise ValueError(f"capture set {self.name} must hold counts in 1..max_loras={max_loras}")
            if max_loras not in self.listed:
                raise ValueError(f"capture set {self.name} must contain max_loras={max_loras}, or batches with every "
                                 "slot active have no graph")
            return list(self.listed)
        raise ValueError("strategy auto's counts are chosen when a sweep is planned (--auto-from)")


# In report order. Plain values: a new strategy is one more line here (or a ``register`` call).
STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("max", Rule.ALL_SLOTS, vllm=Vllm.DEFAULT, doc="one LoRA graph set whose grid covers every slot"),
    Strategy("pow2", Rule.POWERS_OF_TWO, vllm=Vllm.SPECIALISE,
             doc="powers of two below max_loras, plus max_loras (vLLM's set, without the base slot it also counts)"),
    Strategy("dense", Rule.DENSE, doc="every count 1..max_loras"),
    Strategy("agnostic", Rule.ALL_SLOTS, bucket_grid=True, vllm=Vllm.NONE,
             doc="one LoRA graph per bucket, grid min(bucket, max_loras) whatever n (lorabench's kernels only)"),
)}


def parse_explicit(text: str) -> list[int] | None:
    """``[1,2,4]`` -> [1, 2, 4]; None when ``text`` is not a bracketed list."""
    text = text.strip()
    if not (text.startswith("[") and text.endswith("]")):
        return None
    try:
        counts = [int(p) for p in text[1:-1].split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"explicit capture set {text!r} must list integers, e.g. [1,2,4]") from None
    if not counts:
        raise ValueError(f"explicit capture set {text!r} is empty")
    return counts


@cache
def strategy(name: str) -> Strategy:
    """The registered strategy, an explicit list ``[a,b,...]`` or ``auto`` (whose counts come from
    the plan: asking for them raises)."""
    name = name.strip()
    if name in STRATEGIES:
        return STRATEGIES[name]
    if name == AUTO:
        return Strategy(AUTO, Rule.CHOSEN, vllm=Vllm.NONE, doc="chosen by the optimiser from an earlier run")
    explicit = parse_explicit(name)
    if explicit is None:
        raise ValueError(f"unknown strategy {name!r} (choose from {', '.join(STRATEGIES)} or a list like [1,2,4])")
    listed = tuple(sorted(set(explicit)))
    return Strategy("[" + ",".join(map(str, listed)) + "]", Rule.LISTED, listed)


def register(s: Strategy) -> Strategy:
    """Add a strategy to the registry (after the built-in ones, in report order)."""
    STRATEGIES[s.name] = s
    strategy.cache_clear()  # a name looked up before may now be this one
    return s


def capture_counts(name: str, max_loras: int) -> list[int]:
    """The sorted launch counts of strategy ``name`` at ``max_loras``."""
    return strategy(name).counts(max_loras)


def canonical(name: str) -> str:
    """The strategy's name as written into rows: registered names as is, lists as ``[1,2,4]``."""
    return strategy(name).name


def report_order(name: str) -> tuple[int, str]:
    """Registered strategies in registration order, then the rest by name."""
    names = list(STRATEGIES)
    return (names.index(name) if name in names else len(names), name)


def choose_bucket(tokens: int, capture_sizes: list[int]) -> int | None:
    """Smallest capture size >= tokens, or None when the batch must run eagerly."""
    i = bisect.bisect_left(capture_sizes, tokens)
    return capture_sizes[i] if i < len(capture_sizes) else None


def choose_launch(n_active: int, counts: list[int]) -> int:
    """Smallest captured launch count >= n_active; 0 (the no-LoRA graph) when n_active = 0."""
    if n_active == 0:
        return 0
    i = bisect.bisect_left(counts, n_active)
    if i == len(counts):
        raise ValueError(f"{n_active} active adapters exceed the largest captured count {counts[-1]}")
    return counts[i]
