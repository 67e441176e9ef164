"""Chunked-prefill scheduling: the steps a closed loop of clients runs when requests carry prompts.

A server with chunked prefill gives every step a token budget (vLLM's ``--max-num-batched-tokens``)
and fills it in this order:

1. **decode first**: each running request whose prompt is done gets its one token;
2. **prefills under way**, in the order they were admitted: each gets the rest of its prompt, or
   what is left of the budget (a chunk; its next chunk comes next step);
3. **waiting requests**, first come first served, while budget and ``max_num_seqs`` allow: each
   joins with its first chunk, unless its adapter is not among the step's and the step already
   holds ``max_loras`` adapters (it is skipped for this step and the next one is tried, as the
   residency loop admits; base-model requests always join).

A step that processes a request's last prompt token also produces its first output token; each
later step of the request (a decode) produces one more, until ``output_tokens``. The loop is
closed: when a request's last token is out, its client sends the next one, which waits from the
next step on. Every step is a list of ``Piece`` s (a request's tokens in that step, with the
context its attention reads), and every request keeps the steps that produced its tokens: with
each step's time, that gives its time to first token and its inter-token latencies
(``config.serving_latency``).
"""

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Piece:
    """One request's share of a step."""

    request: int  # the request's index in ``Served.requests``
    adapter: int  # -1: the base model
    tokens: int  # new tokens this step: 1 for a decode, a chunk of the prompt for a prefill
    context: int  # the request's tokens already in the KV cache (what its attention reads besides these)
    prefill: bool  # a prompt chunk (else a decode token)
    emits: bool  # the step ends with an output token for it (every decode; a prompt's last chunk)


@dataclass(frozen=True)
class Step:
    pieces: tuple[Piece, ...]

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self.pieces)

    @property
    def decode_tokens(self) -> int:
        return sum(p.tokens for p in self.pieces if not p.prefill)

    @property
    def prefill_tokens(self) -> int:
        return sum(p.tokens for p in self.pieces if p.prefill)

    @property
    def token_adapters(self) -> list[int]:
        """Each token's adapter (-1: base), in the pieces' order on the step's token axis."""
        return [p.adapter for p in self.pieces for _ in range(p.tokens)]

    @property
    def adapters(self) -> set[int]:
        """The distinct adapters the step runs (its active count is their number)."""
        return {p.adapter for p in self.pieces if p.adapter >= 0}


@dataclass
class Request:
    adapter: int
    input_tokens: int
    output_tokens: int
    arrival: int  # the first step it could run in (it waited from the start of this step)
    prefilled: int = 0  # prompt tokens processed so far
    emitted_at: list[int] = field(default_factory=list)  # the step that produced each output token

    @property
    def done(self) -> bool:
        return len(self.emitted_at) >= self.output_tokens


@dataclass
class Served:
    steps: list[Step]
    requests: list[Request]

    def after(self, start: int) -> "Served":
        """The steps from ``start`` on, as if they were the first: each request's arrival and token
        steps counted from ``start`` (an earlier arrival is negative; tokens before it dropped), so
        that latencies over them leave out what began before."""
        out = []
        for r in self.requests:
            kept = [s - start for s in r.emitted_at if s >= start]  # ``done`` still counts the tokens dropped
            out.append(Request(r.adapter, r.input_tokens, r.output_tokens - (len(r.emitted_at) - len(kept)),
                               r.arrival - start, r.prefilled, kept))
        return Served(self.steps[start:], out)


def serve(next_request: Callable[[], tuple[int, int, int]], clients: int, steps: int, budget: int, max_seqs: int,
          max_loras: int | None = None) -> Served:
    """``steps`` steps of ``clients`` clients, each keeping one request in flight; ``next_request()``
    gives a new request's (adapter, input tokens, output tokens). ``budget``: tokens per step;
    ``max_seqs``: requests per step; ``max_loras``: distinct adapters per step (None: any)."""
    if min(clients, budget, max_seqs) < 1 or steps < 0 or (max_loras is not None and max_loras < 1):
        raise ValueError(f"clients {clients}, budget {budget}, max_seqs {max_seqs} and max_loras {max_loras} "
                         "must be positive, steps non-negative")
    requests: list[Request] = []

    def arrive(step: int) -> int:
        adapter, prompt, out = next_request()
        if prompt < 1 or out < 1:
            raise ValueError(f"a request of {prompt} input and {out} output tokens: both must be at least 1")
        requests.append(Request(adapter, prompt, out, step))
        return len(requests) - 1

    waiting = [arrive(0) for _ in range(clients)]
    running: list[int] = []  # admitted, in admission order
    out: list[Step] = []
    for step in range(steps):
        pieces: list[Piece] = []
        left = budget
        adapters = {requests[i].adapter for i in running if requests[i].adapter >= 0}
        for i in running:  # decode first
            r = requests[i]
            if r.prefilled == r.input_tokens and left > 0:
                pieces.append(Piece(i, r.adapter, 1, r.input_tokens + len(r.emitted_at) - 1, False, True))
                left -= 1
        for i in running:  # then the prefills under way
            r = requests[i]
            if r.prefilled < r.input_tokens and left > 0:
                pieces.append(_chunk(i, r, left))
                left -= pieces[-1].tokens
        kept = []
        for i in waiting:  # then new requests, first come first served, skipping what does not fit
            r = requests[i]
            new_adapter = r.adapter >= 0 and r.adapter not in adapters
            if left <= 0 or len(running) >= max_seqs or (new_adapter and max_loras is not None
                                                          and len(adapters) >= max_loras):
                kept.append(i)
                continue
            running.append(i)
            if r.adapter >= 0:
                adapters.add(r.adapter)
            pieces.append(_chunk(i, r, left))
            left -= pieces[-1].tokens
        waiting = kept
        for p in pieces:  # the step runs: prompts advance, tokens come out
            r = requests[p.request]
            if p.prefill:
                r.prefilled += p.tokens
            if p.emits:
                r.emitted_at.append(step)
        out.append(Step(tuple(pieces)))
        finished = [i for i in running if requests[i].done]
        running = [i for i in running if not requests[i].done]
        waiting.extend(arrive(step + 1) for _ in finished)  # each finished client sends its next request
    return Served(out, requests)


def _chunk(i: int, r: Request, left: int) -> Piece:
    n = min(r.input_tokens - r.prefilled, left)
    return Piece(i, r.adapter, n, r.prefilled, True, r.prefilled + n == r.input_tokens)
