"""Batches of decode requests as slot lists (fixed active counts, mixes with base requests), mixed
steps of prefill chunks and decode tokens, and how many distinct adapters a batch holds."""

import random
from typing import NamedTuple

import numpy as np

from lorabench.config.chunked import Piece, Step


class BenchPoint(NamedTuple):
    """A kernel bench's point: ``tokens`` requests, ``active`` adapters among them, and the
    adapter columns the kernels launch (``max``'s graphs launch max_loras; None: the active count)."""

    tokens: int
    active: int
    launch: int | None = None


def parse_bench_points(text: str, max_loras: int, base_tokens: int = 0) -> list[BenchPoint]:
    """``tokens:active[:launch]`` points, comma-separated; ValueError with one line naming the
    first bad one (not three non-negative integers, a launch count outside active..max_loras, or
    more active adapters than fit the tokens that are not base)."""
    points = []
    for p in text.split(","):
        fields = p.split(":")
        if len(fields) not in (2, 3) or not all(f.isdigit() for f in fields):
            raise ValueError(f"point {p!r} is not tokens:active[:launch]")
        tokens, active, *launch = (int(f) for f in fields)
        if launch and not active <= launch[0] <= max_loras:
            raise ValueError(f"point {p!r}: its launch count must lie between the active count and max_loras {max_loras}")
        if not 1 <= active <= min(tokens - base_tokens, max_loras):
            raise ValueError(f"point {p!r}: {active} active adapters do not fit {tokens} tokens with {base_tokens} "
                             f"base tokens and max_loras {max_loras}")
        points.append(BenchPoint(tokens, active, launch[0] if launch else None))
    return points


def fixed_batch(tokens: int, n_active: int, max_loras: int, rng: random.Random, base_tokens: int = 0) -> list[int]:
    """``tokens`` requests using exactly ``n_active`` distinct adapter slots, of which
    ``base_tokens`` requests use no adapter (slot -1); order shuffled."""
    if n_active > min(tokens - base_tokens, max_loras) or (n_active == 0 and base_tokens != tokens):
        raise ValueError(f"cannot place {n_active} adapters in {tokens} tokens with {base_tokens} base")
    chosen = rng.sample(range(max_loras), n_active)
    lora_tokens = chosen + [rng.choice(chosen) for _ in range(tokens - base_tokens - n_active)] if chosen else []
    slots = lora_tokens + [-1] * base_tokens
    rng.shuffle(slots)
    return slots


def mixed_batch(tokens: int, n_active: int, max_loras: int, rng: random.Random) -> list[int]:
    """Like ``fixed_batch`` with a random number of base-model requests among the adapters."""
    base = tokens if n_active == 0 else rng.randint(0, tokens - n_active)
    return fixed_batch(tokens, n_active, max_loras, rng, base_tokens=base)


def mixed_step(tokens: int, n_active: int, max_loras: int, context_len: int, rng: random.Random,
               base_requests: int = 0) -> Step:
    """A mixed step of ``tokens`` tokens whose requests use exactly ``n_active`` distinct adapter
    slots, ``base_requests`` of them none: each request a decode token but the first, whose prompt
    chunk takes the rest (split into chunks of at most ``context_len`` tokens from further
    requests of the same adapters where longer). Contexts random within ``context_len``, pieces
    shuffled; request i is piece i (its cache row)."""
    requests = n_active + base_requests
    if not 1 <= requests <= tokens or n_active > max_loras:
        raise ValueError(f"cannot place {n_active} adapters and {base_requests} base requests in {tokens} tokens")
    adapters = rng.sample(range(max_loras), n_active) + [-1] * base_requests
    prompt, limit = tokens - (requests - 1), context_len
    chunks = [min(limit, prompt - i) for i in range(0, prompt, limit)]
    owners = adapters[:1] + [rng.choice(adapters) for _ in chunks[1:]]
    pieces = [(a, n, rng.randint(0, context_len - n), True) for a, n in zip(owners, chunks)]
    pieces += [(a, 1, rng.randint(0, context_len - 1), False) for a in adapters[1:]]
    rng.shuffle(pieces)
    return Step(tuple(Piece(i, a, n, c, prefill, True) for i, (a, n, c, prefill) in enumerate(pieces)))


def prefill_requests(tokens: int, most_active: int, context_len: int) -> int:
    """The requests of every prefill step of ``tokens`` tokens in a sweep whose largest active count
    there is ``most_active``: one per adapter, or as many as chunks of at most ``context_len``
    tokens need. Every n at that size shares them (and ``prefill_step``'s chunks), so that the
    steps differ in their adapters alone (attention's cost depends on the chunks' lengths)."""
    return max(most_active, 1, -(-tokens // context_len))


def prefill_step(tokens: int, n_active: int, max_loras: int, requests: int, context_len: int,
                 rng: random.Random) -> Step:
    """A prefill point's step: ``tokens`` prompt tokens from ``requests`` requests (first chunks,
    context 0) as a server's step holds them: as few long chunks of at most ``context_len`` as the
    tokens need, near-equal, the other requests one token each (a long prompt's chunk beside short
    ones, as a step of chunked prefill holds a prompt beside decode tokens); ``n_active`` distinct
    adapter slots among the requests, on the long chunks first, each at least once, the rest drawn
    from them (n = 0: all base). Request i is piece i."""
    if n_active > min(requests, max_loras) or requests > tokens or requests * context_len < tokens:
        raise ValueError(f"cannot place {n_active} adapters in {requests} requests of a {tokens}-token prefill "
                         f"with {max_loras} slots and chunks of at most {context_len}")
    long = next(k for k in range(1, requests + 1) if tokens - (requests - k) <= k * context_len)
    size, extra = divmod(tokens - (requests - long), long)
    lengths = [size + (i < extra) for i in range(long)] + [1] * (requests - long)
    chosen = rng.sample(range(max_loras), n_active)
    adapters = chosen + [rng.choice(chosen) for _ in range(requests - n_active)] if chosen else [-1] * requests
    return Step(tuple(Piece(i, a, n, 0, True, True) for i, (a, n) in enumerate(zip(adapters, lengths))))


def distinct_adapters(steps: np.ndarray) -> np.ndarray:
    """Per row of slot/adapter ids (-1 = base request): how many distinct non-negative ids."""
    ordered = np.sort(steps, axis=1)
    return (ordered[:, :1] >= 0).sum(axis=1) + ((np.diff(ordered, axis=1) != 0) & (ordered[:, 1:] >= 0)).sum(axis=1)
