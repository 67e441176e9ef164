"""Workloads: how a step's requests pick adapters, and the active-count distribution P(n | c).

Grammar: terms joined by ``+``. Adapter choice: ``uniform`` over the resident slots,
``zipf:S`` (slot i drawn with weight 1/(i+1)^S) or ``single`` (all adapter requests of a step
share one slot); ``base:P`` makes a fraction P of requests base-model requests. Examples:
``uniform``, ``zipf:1.2``, ``base:0.5`` (= ``uniform+base:0.5``), ``zipf:1.1+base:0.3``; each
kind of term at most once (``base:0.5+base:0.3`` is refused, not read as ``base:0.3``).
``trace:PATH`` reads the workload from a server's trace instead (``lorabench.config.trace``).
"""

import math
import random
from dataclasses import dataclass

import numpy as np

from lorabench.config.batches import distinct_adapters
from lorabench.config.trace import TraceWorkload


@dataclass(frozen=True)
class Workload:
    adapters: str = "uniform"  # uniform | zipf | single
    zipf_s: float = 0.0
    base_frac: float = 0.0

    @property
    def name(self) -> str:
        parts = [self.adapters if self.adapters != "zipf" else f"zipf:{self.zipf_s:g}"]
        if self.base_frac:
            parts = ([] if self.adapters == "uniform" else parts) + [f"base:{self.base_frac:g}"]
        return "+".join(parts)

    def weights(self, max_loras: int) -> np.ndarray:
        if self.adapters == "zipf":
            w = 1.0 / np.arange(1, max_loras + 1) ** self.zipf_s
        else:
            w = np.ones(max_loras)
        return w / w.sum()

    def sample(self, concurrency: int, max_loras: int, rng: random.Random) -> list[int]:
        """One step's slots (-1 = base request)."""
        shared = rng.randrange(max_loras)
        cum = np.cumsum(self.weights(max_loras)).tolist()
        slots = []
        for _ in range(concurrency):
            if rng.random() < self.base_frac:
                slots.append(-1)
            elif self.adapters == "single":
                slots.append(shared)
            else:
                slots.append(min(np.searchsorted(cum, rng.random(), side="right").item(), max_loras - 1))
        return slots

    def active_count_pmf(self, concurrency: int, max_loras: int, draws: int = 20000, seed: int = 0) -> np.ndarray:
        """P(n | c) for n = 0..min(c, max_loras), estimated from ``draws`` sampled steps."""
        gen = np.random.default_rng(seed)
        top = min(concurrency, max_loras)
        if self.adapters == "single":
            picks = np.zeros((draws, concurrency), dtype=np.int64)
        else:
            picks = gen.choice(max_loras, size=(draws, concurrency), p=self.weights(max_loras))
        picks[gen.random((draws, concurrency)) < self.base_frac] = -1
        return np.bincount(distinct_adapters(picks), minlength=top + 1)[: top + 1] / draws


def parse_workload(text: str):
    """A ``Workload``, or a ``TraceWorkload`` for ``trace:PATH``."""
    if text.strip().startswith("trace:"):
        path = text.strip()[len("trace:"):]
        if not path or "+" in path:
            raise ValueError(f"workload {text!r}: write trace:PATH alone (a trace cannot be combined with other terms)")
        return TraceWorkload(path)
    adapters, zipf_s, base = "uniform", 0.0, 0.0
    seen: set[str] = set()
    for term in (t.strip() for t in text.split("+")):
        name, _, arg = term.partition(":")
        try:
            if name in ("uniform", "single") and not arg:
                adapters = name
            elif name == "zipf" and arg and 0 < float(arg) < math.inf:
                adapters, zipf_s = "zipf", float(arg)
            elif name == "base" and arg and 0.0 <= float(arg) <= 1.0:
                base = float(arg)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"bad workload term {term!r} in {text!r}: use uniform, single, zipf:S (S>0), base:P (0<=P<=1), joined by +"
            ) from None
        kind = "base" if name == "base" else "adapters"
        if kind in seen:  # the later term would silently replace the earlier one
            raise ValueError(f"workload {text!r} names " + ("base twice" if kind == "base" else "two adapter distributions"))
        seen.add(kind)
    return Workload(adapters, zipf_s, base)
