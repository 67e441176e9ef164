"""Adapter residency: N adapters served from ``max_loras`` GPU slots, and how often a workload
needs one loaded (``--adapters N``).

A closed loop, as a benchmark client with ``--max-concurrency C`` drives a server: C clients each
keep one request in flight. A request asks for an adapter (drawn from the workload over the N
adapters, adapter 0 the most popular under zipf; or read in order from a trace) or for the base
model, and decodes ``output_tokens`` tokens (fixed, or drawn uniformly from a range), one per step; when it ends, its client sends the next
one at once. The server schedules as vLLM's does (requests with prompts: ``lorabench.config.serving``):

- **admission** (first come, first served, with skips): a waiting request joins the running batch
  unless its adapter is not yet among the batch's and the batch already holds ``max_loras``
  adapters; vLLM's scheduler then skips it for this step and tries the next. Base-model requests
  always join. So with few slots and many adapters, requests wait and fewer tokens run per step.
- **activation** (least recently used): every adapter of the batch counts as used at this step;
  one that holds no slot takes a free slot, or the least recently used slot whose adapter the
  batch does not use, and is *loaded* into it before the step (vLLM copies it from host memory
  into the slot, blocking the step). vLLM's own loop touches the batch's adapters one by one and
  can evict one the step needs before touching it, which then loads again; lorabench never does,
  so it counts at most the loads vLLM makes.
- **the CPU cache** (vLLM's ``--max-cpu-loras``, least recently used too): a load whose adapter is
  not in it must first be read from storage (a *CPU miss*), evicting the cache's oldest.

Here requests have no prompt (``--input-tokens`` gives them one: ``config.serving``): a request's
first step is a decode step. The loop starts with every client's first request part-way through (remaining tokens uniform) and
empty slots, and runs ``burn_in`` steps before the schedule's first, so that the schedule starts
from the steady state.
"""

import bisect
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from lorabench.config.sweep_spec import OUTPUT_TOKENS  # noqa: F401 - the default, declared with --output-tokens
from lorabench.config.chunked import Served, Step
from lorabench.config.lengths import Lengths, as_lengths
from lorabench.config.trace import TraceWorkload


@dataclass(frozen=True)
class Adapters:
    """``--adapters``: how many adapters the requests choose from, vLLM's CPU cache, and how
    many tokens each request decodes (``output_tokens``: Lengths, or a count or its text, made Lengths)."""

    count: int
    max_cpu_loras: int | None = None  # None: every adapter fits in the CPU cache
    output_tokens: Lengths = Lengths(OUTPUT_TOKENS, OUTPUT_TOKENS)
    file_bytes: tuple[int, ...] = ()  # the user's adapters: each one's file, what a miss reads (empty: random adapters)

    def __post_init__(self):
        object.__setattr__(self, "output_tokens", as_lengths(self.output_tokens))

    @property
    def cpu_slots(self) -> int:
        return self.count if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass
class Schedule:
    """The decode steps a closed loop of clients runs, one entry per step."""

    batches: list[list[int]]  # each running request's slot (-1: a base-model request)
    requests: list[list[int]]  # each running request's adapter (-1: the base model), as batches orders them
    loads: list[list[tuple[int, int]]]  # (slot, adapter) loaded into a slot before the step
    tokens: np.ndarray  # running requests (the batch's tokens)
    n_active: np.ndarray  # distinct adapters in the batch
    n_loads: np.ndarray
    cpu_misses: np.ndarray  # loads whose adapter had to be read from storage first
    waiting: np.ndarray  # requests waiting for a slot (not admitted) at the step
    first_slots: list[int] = field(default_factory=list)  # each slot's adapter at the first timed step (-1: none yet)
    reads: list[list[int]] = field(default_factory=list)  # per step, the adapters read from storage first (its misses)
    # Prompt runs (``config.serving``): each step's pieces (batches then hold each token's slot in
    # their order), each piece's request's KV-cache row, and the requests as the timed steps saw
    # them (``chunked.Served.after``: their latencies). None / empty for decode-only runs.
    pieces: list[Step] | None = None
    rows: list[dict[int, int]] = field(default_factory=list)
    served: Served | None = None

    def slots_at(self, starts) -> dict[int, list[int]]:
        """Each slot's adapter before step ``i``'s loads, for every ``i`` of ``starts``: what the
        slots must hold for the steps from ``i`` on to load what this schedule says."""
        held, out, done = list(self.first_slots), {}, 0
        for i in sorted(set(starts)):
            for loads in self.loads[done:i]:
                for slot, adapter in loads:
                    held[slot] = adapter
            done = max(done, i)
            out[i] = list(held)
        return out


class Requests:
    """The next request's (adapter, tokens to decode): a workload's draw over ``adapters.count``
    adapters (``single``: every request the same adapter), or the trace's requests in order; its
    length drawn after its adapter, from the same generator (a fixed length draws nothing, so loops
    of fixed lengths run as they ran before ranges existed)."""

    def __init__(self, workload, adapters: Adapters, seed: int):
        self.workload, self.adapters = workload, adapters
        self.rng = random.Random(f"residency-{seed}")
        if isinstance(workload, TraceWorkload):
            check_residency(workload, adapters.count, None, [1])
            ids = trace_adapters(workload)
            out, prompts = workload.df.get("output_tokens"), workload.df.get("input_tokens")
            self.trace = ids.tolist()
            self.lengths = None if out is None else [int(v) for v in out]
            self.prompts = None if prompts is None else [int(v) for v in prompts]
            self.next_row = 0
        else:
            self.trace = None
            self.cum = np.cumsum(workload.weights(adapters.count)).tolist()

    def __call__(self) -> tuple[int, int]:
        if self.trace is not None:
            i = self.next_row % len(self.trace)
            self.next_row += 1
            return self.trace[i], self.lengths[i] if self.lengths else self.adapters.output_tokens.draw(self.rng)
        return self._adapter(), self.adapters.output_tokens.draw(self.rng)

    def _adapter(self) -> int:
        wl, rng = self.workload, self.rng
        if rng.random() < wl.base_frac:
            return -1
        if wl.adapters == "single":
            return 0
        # the first adapter whose cumulative weight exceeds the draw (the last: float rounding)
        return min(bisect.bisect_right(self.cum, rng.random()), len(self.cum) - 1)

    def with_prompt(self, lengths: Lengths) -> tuple[int, int, int]:
        """The next request's (adapter, input tokens, output tokens): its prompt from the trace's
        ``input_tokens`` column where it has one, else drawn from ``lengths``."""
        adapter, output = self()
        if self.trace is not None and self.prompts is not None:
            return adapter, self.prompts[(self.next_row - 1) % len(self.trace)], output
        return adapter, lengths.draw(self.rng), output


def trace_adapters(trace: TraceWorkload) -> np.ndarray:
    """A requests trace's adapter ids in order (-1: base); a trace of logged steps has none."""
    if not trace.requests:
        raise ValueError(f"trace {trace.path} logs steps (concurrency, n_active), not requests with adapters: "
                         "residency needs a trace of requests with an `adapter` column")
    return trace.adapter_ids


def check_residency(workload, adapters: int, max_cpu_loras: int | None, max_loras: list[int]) -> None:
    """A ValueError in one line when these residency runs cannot be set up."""
    if max_cpu_loras is not None and max_cpu_loras < max(max_loras):
        raise ValueError(f"--max-cpu-loras {max_cpu_loras} is below --max-loras {max(max_loras)} "
                         "(vLLM's CPU cache holds at least the GPU's slots)")
    if isinstance(workload, TraceWorkload):
        ids = trace_adapters(workload)
        if ids.max(initial=-1) >= adapters:
            raise ValueError(f"trace {workload.path} has {ids.max() + 1} adapters, more than --adapters {adapters}")
        for column in ("output_tokens", "input_tokens"):
            if column in workload.df:
                import pandas as pd  # a trace's: pandas read it

                out = pd.to_numeric(workload.df[column], errors="coerce")
                bad = out[out.isna() | (out % 1 != 0) | (out < 1)]
                if len(bad):
                    raise ValueError(f"trace {workload.path}: row {bad.index[0]} needs a whole {column} of at least 1")


def _warm_cache(workload, adapters: Adapters) -> list[int]:
    """The CPU cache of a server that has run a while: the ``cpu_slots`` most popular adapters
    (a trace's first distinct ones), so that a schedule's misses are the cache's steady state,
    not the first request of each adapter."""
    if isinstance(workload, TraceWorkload):
        ids = dict.fromkeys(int(a) for a in trace_adapters(workload) if a >= 0)
        return list(ids)[: adapters.cpu_slots]
    return list(range(min(adapters.cpu_slots, adapters.count)))


class Slots:
    """The GPU slots and vLLM's CPU cache over a run's steps, both least recently used."""

    def __init__(self, workload, adapters: Adapters, max_loras: int):
        self.max_loras, self.cpu_slots = max_loras, adapters.cpu_slots
        self.slot_of: dict[int, int] = {}  # adapter -> its slot
        self.holder = [-1] * max_loras  # slot -> its adapter
        self.used = [-1] * max_loras  # slot -> the last step its adapter ran
        self.cpu: OrderedDict[int, None] = OrderedDict((a, None) for a in _warm_cache(workload, adapters))

    def activate(self, batch, step: int) -> tuple[list[tuple[int, int]], list[int]]:
        """Give every adapter of ``batch`` (at most max_loras, in order) a slot at ``step``: one that
        holds none takes an empty slot, else the least recently used one whose adapter ``batch``
        does not use, read from storage first when the CPU cache lacks it. Returns the step's
        (slot, adapter) loads and the adapters it read from storage."""
        loads, missed = [], []
        for a in batch:
            if a in self.cpu:
                self.cpu.move_to_end(a)
            if a in self.slot_of:
                self.used[self.slot_of[a]] = step
                continue
            if a not in self.cpu:
                missed.append(a)
                self.cpu[a] = None
                if len(self.cpu) > self.cpu_slots:
                    self.cpu.popitem(last=False)
            free = [s for s in range(self.max_loras) if self.holder[s] < 0 or self.holder[s] not in batch]
            s = min(free, key=lambda s: (self.holder[s] >= 0, self.used[s]))  # an empty slot, else the least recently used
            if self.holder[s] >= 0:
                del self.slot_of[self.holder[s]]
            self.holder[s], self.slot_of[a], self.used[s] = a, s, step
            loads.append((s, a))
        return loads, missed


def check_loop(adapters: Adapters, clients: int, max_loras: int, steps: int) -> None:
    if clients < 1 or max_loras < 1 or steps < 0:
        raise ValueError(f"clients {clients}, max_loras {max_loras} and steps {steps} must be positive")
    if adapters.max_cpu_loras is not None and adapters.max_cpu_loras < max_loras:  # None: every adapter, however few
        raise ValueError(f"max_cpu_loras {adapters.cpu_slots} is below max_loras {max_loras} (vLLM requires at least max_loras)")


def simulate(workload, adapters: Adapters, clients: int, max_loras: int, steps: int, seed: int = 0,
             burn_in: int | None = None) -> Schedule:
    """``steps`` decode steps of ``clients`` clients served from ``max_loras`` slots, after
    ``burn_in`` untimed ones (default: twice the longest output, so that every first request has
    ended and the slots have filled)."""
    check_loop(adapters, clients, max_loras, steps)
    nxt = Requests(workload, adapters, seed)
    start = random.Random(f"residency-start-{seed}")
    burn_in = 2 * adapters.output_tokens.high if burn_in is None else burn_in
    waiting: deque[list[int]] = deque()
    for _ in range(clients):
        a, length = nxt()
        waiting.append([a, start.randint(1, length)])
    running: list[list[int]] = []
    slots = Slots(workload, adapters, max_loras)
    out = Schedule([], [], [], *(np.zeros(steps, dtype=np.int64) for _ in range(5)))
    for step in range(burn_in + steps):
        if step == burn_in:
            out.first_slots = list(slots.holder)  # before this step's loads
        batch: dict[int, None] = {r[0]: None for r in running if r[0] >= 0}
        kept: deque[list[int]] = deque()
        for r in waiting:
            if r[0] >= 0 and r[0] not in batch and len(batch) >= max_loras:
                kept.append(r)
                continue
            running.append(r)
            if r[0] >= 0:
                batch[r[0]] = None
        waiting = kept
        loads, missed = slots.activate(batch, step)
        if step >= burn_in:
            i = step - burn_in
            out.batches.append([slots.slot_of[r[0]] if r[0] >= 0 else -1 for r in running])
            out.requests.append([r[0] for r in running])
            out.loads.append(loads)
            out.reads.append(missed)
            out.tokens[i], out.n_active[i], out.n_loads[i] = len(running), len(batch), len(loads)
            out.cpu_misses[i], out.waiting[i] = len(missed), len(waiting)
        still = []
        for r in running:
            r[1] -= 1
            if r[1] > 0:
                still.append(r)
            else:
                a, length = nxt()
                waiting.append([a, length])
        running = still
    return out
