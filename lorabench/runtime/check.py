"""The correctness verdict of one configuration: every graph it can serve a batch with is
replayed on batches that route to it (all adapters, all base, and mixes of both, at every
active count n) and compared with the plain-torch reference. With mixed-step graphs (PIECEWISE),
mixed steps too: a prompt chunk among decode tokens, adapters alone and with a base request, at
every n, through every PIECEWISE graph and the eager path past them.

Batches are tried smallest first (tokens, then n, then base requests), so the first mismatch
is the smallest batch that shows the configuration is wrong. Tolerances are per dtype, on the
worst token's relative error ``|out - ref| / |ref|`` over its logits; the check also measures
how far the LoRA update moves the logits (its *sensitivity*): a check whose tolerance is not
well below that could miss a dropped update, and then says it is inconclusive.

Mixed steps get a tolerance of their own: their prompt tokens attend to each other's fresh keys,
so rounding grows with depth as well as with the dtype (32 layers of Llama-3.1-8B in bf16: ~0.15
of a logit row for any correct kernel, vLLM's and the reference's own variants alike). The check
measures that *rounding floor* on the model under test, the reference against itself with its
shrink's output rounded to the dtype (``kernels.reference.ROUNDED``) on the largest mixed step,
and takes ``NOISE_MARGIN`` times it where that exceeds the dtype's tolerance. A dropped update
still fails: it moves the logits by the sensitivity, which must stay ``MIN_MIXED_SENSITIVITY``
mixed tolerances away.
"""

import random
import time
from dataclasses import asdict, dataclass, field

import torch

from lorabench.config.batches import fixed_batch, mixed_step
from lorabench.config.chunked import Step
from lorabench.config.tolerance import TOLERANCE
from lorabench.runtime.dispatch import Dispatcher, Route
from lorabench.runtime.mixed_attention import MixedLayout

MIN_SENSITIVITY = 10.0  # a dropped update must move the logits >= this many tolerances
NOISE_MARGIN = 2.0  # a mixed step's tolerance: at least this many times the measured rounding floor
MIN_MIXED_SENSITIVITY = 3.0  # ... and a dropped update must move the logits >= this many of it


@dataclass
class Case:
    slots: list[int]  # each token's slot
    step: Step | None = None  # a mixed step's pieces (request i in cache row first_row + i); None: a decode batch
    first_row: int = 0

    @property
    def layout(self) -> MixedLayout | None:
        if self.step is None:
            return None
        return MixedLayout.of(self.step, {p.request: self.first_row + p.request for p in self.step.pieces})

    @property
    def tokens(self) -> int:
        return len(self.slots)

    @property
    def n_active(self) -> int:
        return len({s for s in self.slots if s >= 0})

    @property
    def base(self) -> int:
        return sum(s < 0 for s in self.slots)


@dataclass
class Failure:
    slots: list[int]
    graph_tokens: int
    key: int
    grid: int
    graphed: bool
    max_err: float
    bad_tokens: list[int]  # positions in the batch whose logits are off
    pieces: list[list] | None = None  # a mixed step's [slot, tokens, context, prefill] per piece

    def describe(self, tolerance: float) -> str:
        case = Case(self.slots)
        kind = "PIECEWISE graphs" if self.pieces else "graph"
        where = (f"{kind} (bucket {self.graph_tokens}, key {self.key}, grid {self.grid})" if self.graphed
                 else f"the eager path (key {self.key}, grid {self.grid})")
        bad = sorted({self.slots[i] for i in self.bad_tokens})
        who = ", ".join("base" if s < 0 else f"slot {s}" for s in bad)
        what = f"batch {self.slots}" if not self.pieces else "mixed step [" + ", ".join(
            f"{'prefill' if pre else 'decode'} {n}{f'+{c} cached' if c else ''} of {'base' if s < 0 else f'slot {s}'}"
            for s, n, c, pre in self.pieces) + "]"
        return (f"{what} ({case.tokens} tokens, n={case.n_active}, {case.base} base tokens) -> {where}: "
                f"{len(self.bad_tokens)} token(s) of {who} off by {self.max_err:.3g} relative (tolerance {tolerance:.3g})")


@dataclass
class Verdict:
    correct: bool | None  # None: inconclusive (the reference cannot tell a dropped update)
    batches: int
    graphs_checked: int
    graphs_total: int
    max_err: float
    tolerance: float
    sensitivity: float
    seconds: float
    first: Failure | None = None
    failing_graphs: list[list[int]] = field(default_factory=list)  # [bucket, key, grid]
    eager_wrong: bool = False  # a batch past every capture size (run eagerly) was wrong
    mixed_batches: int = 0  # of ``batches``, mixed steps
    mixed_graphs_checked: int = 0  # mixed keys (PIECEWISE graph sets) some step was served by
    mixed_graphs_total: int = 0
    failing_mixed_graphs: list[list[int]] = field(default_factory=list)  # [bucket, key, grid]
    mixed_eager_wrong: bool = False  # a mixed step past every mixed size was wrong
    first_mixed: Failure | None = None  # the smallest failing mixed step (``first`` may be a decode batch)
    mixed_max_err: float = 0.0  # worst relative logit error over the mixed steps
    rounding_floor: float | None = None  # the reference against itself rounded (mixed steps; module doc)
    mixed_tolerance: float | None = None  # max(tolerance, NOISE_MARGIN x rounding_floor)

    @property
    def mixed_limit(self) -> str:
        """The mixed steps' tolerance in words."""
        if self.mixed_tolerance is None or self.mixed_tolerance <= self.tolerance:
            return f"tolerance {self.tolerance:g}"
        return f"tolerance {self.mixed_tolerance:.2g}: {NOISE_MARGIN:g}x the rounding floor {self.rounding_floor:.2g}"

    @property
    def detail(self) -> str:
        if self.correct is None:
            if self.sensitivity < MIN_SENSITIVITY * self.tolerance:
                return (f"inconclusive: the LoRA update moves the logits by only {self.sensitivity:.3g}, "
                        f"under {MIN_SENSITIVITY:g}x the tolerance {self.tolerance:g}")
            return (f"inconclusive on mixed steps: the LoRA update moves the logits by only {self.sensitivity:.3g}, "
                    f"under {MIN_MIXED_SENSITIVITY:g}x their {self.mixed_limit}")
        mixed = (f", {self.mixed_graphs_checked} of {self.mixed_graphs_total} mixed (PIECEWISE) keys over "
                 f"{self.mixed_batches} mixed steps" if self.mixed_batches else "")
        if self.correct:
            mixed_err = (f"; mixed steps {self.mixed_max_err:.2g} ({self.mixed_limit})"
                         if self.mixed_batches and self.mixed_tolerance and self.mixed_tolerance > self.tolerance else "")
            return (f"ok: {self.batches} batches, {self.graphs_checked} of {self.graphs_total} graphs served{mixed}, "
                    f"max error {self.max_err:.2g} (tolerance {self.tolerance:g}{mixed_err}, "
                    f"LoRA moves logits by {self.sensitivity:.2g})")
        wrong = []
        if self.failing_graphs or self.eager_wrong:
            wrong.append(f"{len(self.failing_graphs)} of {self.graphs_checked} graphs served"
                         + (" and the eager path" if self.eager_wrong else ""))
        if self.failing_mixed_graphs or self.mixed_eager_wrong:
            wrong.append(f"{len(self.failing_mixed_graphs)} of {self.mixed_graphs_checked} mixed keys served"
                         + (" and the mixed eager path" if self.mixed_eager_wrong else ""))
        text = f"WRONG in {' and '.join(wrong)}; smallest: " + self.first.describe(self.tolerance_of(self.first))
        if self.first_mixed is not None and self.first_mixed is not self.first:
            text += "; smallest mixed step: " + self.first_mixed.describe(self.tolerance_of(self.first_mixed))
        return text

    def tolerance_of(self, failure: Failure) -> float:
        return (self.mixed_tolerance or self.tolerance) if failure.pieces is not None else self.tolerance

    def to_dict(self) -> dict:
        return {**asdict(self), "detail": self.detail}


def mixed_rows(d: Dispatcher) -> int:
    """The KV-cache rows mixed cases write, the cache's last: as many as a mixed case has requests
    (max_loras, a base request, the chunks of the largest step). Decode cases stay below them:
    a decode token attends over its whole row, and the mixed steps of one strategy's check would
    otherwise change what the next strategy's decode cases read (their answers are shared)."""
    if not d.mixed_sizes:
        return 0
    return d.max_loras + 1 + -(-d.model.max_tokens // d.model.context_len)


def cases(d: Dispatcher, rng: random.Random) -> list[Case]:
    """Per capture size b (previous size p): batches of p+1 and b tokens; beyond the largest size,
    the largest decode batch the model holds (eager; a token per KV-cache row). For each, every n in 0..min(tokens, max_loras):
    all adapters, and, where there is room, mixes with one base request and with as many base
    requests as possible. Sorted smallest first."""
    sizes, top = d.capture_sizes, min(d.model.max_tokens, d.model.cache_rows - mixed_rows(d))  # a token per cache row
    lengths = {b for b in sizes} | {p + 1 for p in sizes[:-1]} | {1}
    if top > sizes[-1]:
        lengths |= {sizes[-1] + 1, top}
    out = []
    for t in sorted(lengths):
        for n in range(min(t, d.max_loras) + 1):
            bases = {t} if n == 0 else {0, min(1, t - n), t - n}
            for base in sorted(bases):
                out.append(Case(fixed_batch(t, n, d.max_loras, rng, base_tokens=base)))
    return out


def mixed_case(d: Dispatcher, step: Step) -> Case:
    """A mixed step as a case, its requests in the cache's last rows (``mixed_rows``)."""
    return Case(step.token_adapters, step, d.model.cache_rows - mixed_rows(d))


def mixed_cases(d: Dispatcher, rng: random.Random) -> list[Case]:
    """With mixed sizes only. Per mixed size b (previous size p): steps of p+1 and b tokens; past
    the largest, a step of the most tokens the model holds (eager). For each, every n in
    0..min(tokens, max_loras): adapters alone and with one base request (n = 0: base alone), each
    a prompt chunk among decode tokens with random contexts (``batches.mixed_step``), in the
    cache's last rows (``mixed_rows``). Smallest first. The largest eager step takes n = 0, 1 and
    its most only: the eager path meets every n at the step just past the largest size already,
    and at thousands of tokens each n would cost more than all the smaller steps together."""
    sizes, top = d.mixed_sizes, d.model.max_tokens
    if not sizes:
        return []
    lengths = set(sizes) | {p + 1 for p in sizes[:-1]} | {1}
    if top > sizes[-1]:
        lengths |= {sizes[-1] + 1, top}
    out = []
    for t in sorted(lengths):
        most = min(t, d.max_loras)
        counts = range(most + 1) if t < top or t <= sizes[-1] + 1 else sorted({0, 1, most})
        for n in counts:
            for base in sorted({1} if n == 0 else {0, min(1, t - n)}):
                out.append(mixed_case(d, mixed_step(t, n, d.max_loras, d.model.context_len, rng, base)))
    return out


def row_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per token: |out - ref| / |ref| over its logits, in float32."""
    return (out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)


def sensitivity(d: Dispatcher, rng: random.Random, refs: "References | None" = None) -> float:
    """The smallest relative change the LoRA update makes to an adapter token's logits."""
    t = d.capture_sizes[-1]
    slots = fixed_batch(t, min(t, d.max_loras), d.max_loras, rng)
    ids = torch.randint(0, d.model.cfg.vocab, (t,), device=d.input_ids.device)
    if refs is not None and refs.sensitivity is not None:
        return refs.sensitivity
    with_lora = d.reference(slots, ids)
    base = d.reference([-1] * t, ids)
    value = float(row_errors(base, with_lora).min())
    if refs is not None:
        refs.sensitivity = value
    return value


def rounding_floor(d: Dispatcher, seed: int, refs: "References | None" = None) -> float:
    """The reference's distance from itself with its shrink's output rounded to the model's dtype,
    on the largest mixed step with every slot it can hold active: the worst token's relative logit
    error that rounding alone makes there (module doc). 0 without mixed sizes."""
    if not d.mixed_sizes:
        return 0.0
    if refs is not None and refs.rounding_floor is not None:
        return refs.rounding_floor
    t = d.model.max_tokens
    step = mixed_step(t, min(t, d.max_loras), d.max_loras, d.model.context_len, random.Random(seed + 1), 0)
    case = mixed_case(d, step)
    ids = torch.randint(0, d.model.cfg.vocab, (t,), device=d.input_ids.device,
                        generator=torch.Generator(device=d.input_ids.device).manual_seed(seed + 1))
    ref = d.reference(case.slots, ids, layout=case.layout)
    # MoE: the rounded answer takes the first one's experts, or a near-tie flipped by rounding would
    # route a token elsewhere and the floor would measure routing, not rounding
    rounded = d.reference(case.slots, ids, reuse_routing=True, layout=case.layout, rounded=True)
    value = float(row_errors(rounded, ref).max())
    if refs is not None:
        refs.rounding_floor = value
    return value


class References:
    """The reference's answers kept across the checks of dispatchers that share one model,
    max_loras and capture sizes (a worker's strategies): their cases are the same batches, so the
    reference, the check's slow half, runs once for all of them. Kept in host memory, up to
    ``budget`` bytes (past it an answer is computed again), so the cache never competes with the
    graphs for device memory."""

    def __init__(self, budget: int = 2**30):
        self.answers: dict = {}
        self.budget, self.used = budget, 0
        self.sensitivity: float | None = None
        self.rounding_floor: float | None = None

    def get(self, key, device) -> torch.Tensor | None:
        ref = self.answers.get(key)
        return None if ref is None else ref.to(device)

    def put(self, key, ref: torch.Tensor) -> None:
        size = ref.numel() * ref.element_size()
        if self.used + size <= self.budget:
            self.answers[key] = ref.to("cpu", copy=True)
            self.used += size


def check(d: Dispatcher, dtype: str, seed: int = 0, refs: References | None = None) -> Verdict:
    """Replay every servable graph of a captured dispatcher on every case; see the module doc.
    ``refs``: answers shared with the checks of the worker's other strategies (``References``;
    decode batches only: a mixed step's answer depends on the KV cache earlier steps wrote)."""
    t0 = time.perf_counter()
    rng = random.Random(seed)
    tol = TOLERANCE[dtype].logits
    gen = torch.Generator(device=d.input_ids.device).manual_seed(seed)
    saved_ids = d.input_ids.clone()
    served: set[tuple[bool, int, int]] = set()
    failing: dict[tuple[bool, int, int], int] = {}
    first, first_mixed, max_err, mixed_max_err, batches, mixed_batches = None, None, 0.0, 0.0, 0, 0
    eager_wrong = {False: False, True: False}
    try:
        sens = sensitivity(d, rng, refs)
        decode = cases(d, rng)
        mixed = mixed_cases(d, rng)
        floor = rounding_floor(d, seed, refs) if mixed else None
        mixed_tol = max(tol, NOISE_MARGIN * floor) if mixed else None
        for i, case in enumerate(decode + mixed):
            ids = torch.randint(0, d.model.cfg.vocab, (case.tokens,), device=d.input_ids.device, generator=gen)
            d.input_ids[: case.tokens].copy_(ids)
            layout = case.layout
            prep = d.prepare(case.slots, layout)
            out = d.launch(prep, every_token=True).clone()
            route: Route = prep.route
            grid = d.grid_of(route)
            key = (i, tuple(case.slots))
            shared = refs is not None and layout is None
            ref = refs.get(key, out.device) if shared else None
            if ref is None:
                ref = d.reference(case.slots, ids, reuse_routing=True, layout=layout)
                if shared:
                    refs.put(key, ref)
            err = row_errors(out, ref)
            worst = float(err.max())
            batches += 1
            mixed_batches += layout is not None
            max_err = max(max_err, worst)
            if layout is not None:
                mixed_max_err = max(mixed_max_err, worst)
            limit = tol if layout is None else mixed_tol
            graph = (route.mixed, route.tokens, route.launch)
            if route.graphed:
                served.add(graph)
            if not worst < limit:  # NaN fails too
                if route.graphed:
                    failing[graph] = grid
                else:
                    eager_wrong[route.mixed] = True
                if first is None or (layout is not None and first_mixed is None):
                    bad = [i for i, e in enumerate(err.tolist()) if not e < limit]
                    pieces = None if case.step is None else [[p.adapter, p.tokens, p.context, p.prefill]
                                                             for p in case.step.pieces]
                    failure = Failure(case.slots, route.tokens, route.launch, grid, route.graphed, worst, bad, pieces)
                    first = first or failure
                    if layout is not None:
                        first_mixed = first_mixed or failure
    finally:
        d.input_ids.copy_(saved_ids)
    # A failure is one beyond its own limit (rounding cannot explain it): WRONG whatever the
    # sensitivity of the other kind; a pass is a verdict only where a dropped update would show.
    if first is not None:
        correct = False
    elif sens < MIN_SENSITIVITY * tol:
        correct = None
    else:
        correct = True if mixed_tol is None or sens >= MIN_MIXED_SENSITIVITY * mixed_tol else None

    def wrong(mixed: bool) -> list[list[int]]:
        return sorted([b, k, g] for (m, b, k), g in failing.items() if m == mixed)

    return Verdict(
        correct=correct, batches=batches, graphs_checked=sum(not m for m, _, _ in served), graphs_total=d.num_graphs,
        max_err=max_err, tolerance=tol, sensitivity=sens, seconds=time.perf_counter() - t0, first=first,
        failing_graphs=wrong(False), eager_wrong=eager_wrong[False], mixed_batches=mixed_batches,
        mixed_graphs_checked=sum(m for m, _, _ in served), mixed_graphs_total=len(d.mixed_keys),
        failing_mixed_graphs=wrong(True), mixed_eager_wrong=eager_wrong[True], first_mixed=first_mixed,
        mixed_max_err=mixed_max_err, rounding_floor=floor, mixed_tolerance=mixed_tol,
    )
