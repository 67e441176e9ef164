"""A point timed in alternating turns: each strategy that has the point gets ``TURN`` steps at a
time, the order rotated every round, until it has ``iters`` steps or, with ``--ci-target``, its
median's interval is narrow enough. ``Timed`` gathers one strategy's samples over its turns."""

from dataclasses import fields

import numpy as np

from lorabench.runtime.timing import StepSamples
from lorabench.stats import half_width_pct

TURN = 10  # steps a strategy is timed for before the next one's turn
SWITCH_WARMUP = 1  # untimed steps when a strategy's turn comes round again
MIN_STEPS = 20  # --ci-target: no point stops with fewer samples (at 10 the bootstrap's 95 % interval covers ~92 %)
MIN_TURNS = 2  # --ci-target: nor before each strategy sharing the point has had two turns


class Timed:
    """A strategy's samples at one point, gathered over its turns."""

    def __init__(self):
        self.parts: list[StepSamples] = []
        self.rounds: list[int] = []

    @property
    def steps(self) -> int:
        return sum(len(p.step_ms) for p in self.parts)

    def add(self, samples: StepSamples, rnd: int) -> None:
        self.parts.append(samples)
        self.rounds.append(rnd)

    def done(self, iters: int, ci_target: float | None, arms: int) -> bool:
        """``iters`` steps, or the CI target met after at least MIN_STEPS steps and, when
        strategies share the point, MIN_TURNS turns (so that each was timed between the others)."""
        if self.steps >= iters:
            return True
        if ci_target is None or self.steps < MIN_STEPS or (arms > 1 and len(self.parts) < MIN_TURNS):
            return False
        width = half_width_pct(np.concatenate([p.step_ms for p in self.parts]))
        return width is not None and width <= ci_target

    def samples(self) -> StepSamples:
        return StepSamples(*(np.concatenate([getattr(p, f.name) for p in self.parts]) for f in fields(StepSamples)))

    def turns(self) -> list[int]:
        return [r for p, r in zip(self.parts, self.rounds) for _ in range(len(p.step_ms))]
