"""The steps a point runs, the same for every strategy (seeded by the point, not the strategy): a
fixed point's batches, a prefill point's mixed steps, a workload's draws, or a loop's schedule
(residency, serving) with the loads its steps make."""

import random
from dataclasses import dataclass, field

from lorabench.config.batches import fixed_batch, prefill_step
from lorabench.config.chunked import Served
from lorabench.config.lengths import parse_lengths
from lorabench.config.plan import FIXED, LOOPS, PREFILL, SERVING, Job, Point
from lorabench.config.residency import simulate
from lorabench.config.serving import simulate_prompts
from lorabench.config.workload import parse_workload
from lorabench.runtime.dispatch import MixedBatch
from lorabench.runtime.mixed_attention import MixedLayout
from lorabench.runtime.turns import TURN

FIXED_BATCH_VARIANTS = 8  # fixed-mode points cycle through this many random batches of the same (c, n)


@dataclass
class PointSteps:
    batches: list  # per step its tokens' slots, or a MixedBatch (a step with a prompt chunk)
    loads: list[list[tuple[int, int]]] | None = None  # a loop's (slot, adapter) loads before each step
    start_slots: dict[int, list[int]] = field(default_factory=dict)  # a loop's slots at each turn's first step
    reads: list[list[int]] | None = None  # a loop's CPU-cache misses per step, read from storage (the user's files)
    served: Served | None = None  # a serving point's requests over its timed steps (their latencies)


def point_steps(job: Job, point: Point, reads_files: bool) -> PointSteps:
    """``reads_files``: the adapters are the user's, whose misses a loop reads from storage."""
    c = point.concurrency
    prefill = f"-{point.prefill_tokens}" if point.prefill_tokens else ""  # decode points: the seeds of older runs
    rng = random.Random(f"{job.seed}-{c}-{point.n_active}-{point.workload}{prefill}")
    if point.mode == PREFILL:
        steps = [prefill_step(point.prefill_tokens, point.n_active, job.max_loras, c, job.context_len, rng)
                 for _ in range(FIXED_BATCH_VARIANTS)]
        return PointSteps([MixedBatch(s.token_adapters, MixedLayout.of(s, {p.request: p.request for p in s.pieces}))
                           for s in steps])
    if point.mode == FIXED:
        n = point.n_active
        return PointSteps([fixed_batch(c, n, job.max_loras, rng, base_tokens=c if n == 0 else 0)
                           for _ in range(FIXED_BATCH_VARIANTS)])
    wl = parse_workload(point.workload)
    if point.mode not in LOOPS:
        return PointSteps([wl.sample(c, job.max_loras, rng) for _ in range(job.iters)])
    if point.mode == SERVING:
        schedule = simulate_prompts(wl, job.residency, c, job.max_loras, job.iters,
                                    parse_lengths(job.input_tokens, "--input-tokens"), job.max_num_batched_tokens,
                                    job.seed)
        batches = [MixedBatch(b, MixedLayout.of(step, rows)) if step.prefill_tokens else b  # decode alone: FULL graphs
                   for b, step, rows in zip(schedule.batches, schedule.pieces, schedule.rows)]
    else:
        schedule = simulate(wl, job.residency, c, job.max_loras, job.iters, job.seed)
        batches = schedule.batches
    return PointSteps(batches, schedule.loads, schedule.slots_at(range(0, job.iters, TURN)),
                      schedule.reads if reads_files else None, schedule.served)
