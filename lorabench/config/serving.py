"""A residency run whose requests carry prompts (``--input-tokens``): a closed loop of clients served
with chunked prefill (``config.chunked``: a token budget per step, decode first, prompts chunked)
from ``max_loras`` slots (``config.residency``: adapters loaded least recently used, vLLM's CPU cache).

Each step's adapters are those of its pieces (vLLM activates the scheduled requests' adapters);
admission keeps at most ``max_loras`` adapters among the running requests, as the decode-only loop
does. Every request holds one KV-cache row from its first chunk to its last token (rows 0 to
clients - 1, the lowest free one first). The loop starts with every client's first request
arriving at once; the ``burn_in`` steps before the schedule's first are simulated, not timed, and
the latencies count only requests that arrive in the timed steps (``Served.after``).
"""

import numpy as np

from lorabench.config.chunked import serve
from lorabench.config.lengths import Lengths
from lorabench.config.residency import Adapters, Schedule, Slots, Requests, check_loop


def default_burn_in(adapters: Adapters, clients: int, input_tokens: Lengths, budget: int) -> int:
    """Steps until every first request has ended, twice over: its output tokens (the longest), after
    the steps the clients' prompts take at ``budget`` tokens per step."""
    return 2 * (adapters.output_tokens.high + -(-clients * input_tokens.high // budget))


def simulate_prompts(workload, adapters: Adapters, clients: int, max_loras: int, steps: int, input_tokens: Lengths,
                     budget: int, seed: int = 0, burn_in: int | None = None) -> Schedule:
    """``steps`` steps of ``clients`` clients whose requests carry prompts of ``input_tokens``
    (a trace's ``input_tokens`` column overrides it), at most ``budget`` tokens per step, served
    from ``max_loras`` slots, after ``burn_in`` untimed ones (default: ``default_burn_in``)."""
    check_loop(adapters, clients, max_loras, steps)
    if budget < 1:
        raise ValueError(f"a budget of {budget} tokens per step")
    burn_in = default_burn_in(adapters, clients, input_tokens, budget) if burn_in is None else burn_in
    nxt = Requests(workload, adapters, seed)
    served = serve(lambda: nxt.with_prompt(input_tokens), clients, burn_in + steps, budget, clients, max_loras)
    slots = Slots(workload, adapters, max_loras)
    out = Schedule([], [], [], *(np.zeros(steps, dtype=np.int64) for _ in range(5)), pieces=[],
                   served=served.after(burn_in))
    first = np.full(len(served.requests), np.iinfo(np.int64).max)  # the step each request first ran in
    for i, step in reversed(list(enumerate(served.steps))):
        for p in step.pieces:
            first[p.request] = i
    arrival = np.array([r.arrival for r in served.requests])
    row_of: dict[int, int] = {}
    free = list(range(clients))
    for i, step in enumerate(served.steps):
        for p in step.pieces:
            if p.request not in row_of:
                row_of[p.request] = free.pop(free.index(min(free)))
        if i == burn_in:
            out.first_slots = list(slots.holder)  # before this step's loads
        batch = list(dict.fromkeys(p.adapter for p in step.pieces if p.adapter >= 0))  # in the pieces' order
        loads, missed = slots.activate(batch, i)
        if i >= burn_in:
            k = i - burn_in
            out.pieces.append(step)
            out.rows.append({p.request: row_of[p.request] for p in step.pieces})
            out.batches.append([slots.slot_of[a] if a >= 0 else -1 for a in step.token_adapters])
            out.requests.append(step.token_adapters)
            out.loads.append(loads)
            out.reads.append(missed)
            out.tokens[k], out.n_active[k], out.n_loads[k], out.cpu_misses[k] = step.tokens, len(batch), len(loads), len(missed)
            out.waiting[k] = int(((arrival <= i) & (i < first)).sum())  # arrived, not yet admitted
        for p in step.pieces:  # a request's row is free once its last token is out
            r = served.requests[p.request]
            if p.emits and r.done and r.emitted_at[-1] == i:
                free.append(row_of.pop(p.request))
    return out
