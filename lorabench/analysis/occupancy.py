"""The closed loop's steps in the cost model's terms (``Occupancy``): how the steps of a residency
workload spread over batch sizes (each run at its capture size's graph) and active counts, and
how many tokens, loads, CPU misses and waiting requests a step has, from a long simulation of the
loop (``lorabench.config.residency``: vLLM's admission, LRU slots, the CPU cache) or from the
steps a residency run made. Also what one token of KV cache takes.
"""

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from lorabench.analysis.vllm import tp_of
from lorabench.config.limits import DTYPE_BYTES
from lorabench.config.residency import Adapters, simulate
from lorabench.config.strategies import choose_bucket
from lorabench.config.workload import parse_workload

STEPS = 20_000  # simulated steps per (workload, max_loras): the load rate's sampling error is about 1 %


@dataclass(frozen=True)
class Occupancy:
    """Steps in the cost model's terms: per batch size b (a capture size, or the batch itself
    when it runs eagerly), its share of the steps and P(n | b); and per step, the means of the
    batch's tokens, the loads, the CPU misses and the requests waiting for a slot."""

    weights: dict[int, float]
    pmf: dict[int, np.ndarray]
    tokens: float
    loads: float
    cpu_misses: float
    waiting: float
    steps: int
    miss_bytes: float | None = None  # bytes the misses read per step (None: the adapters' files are not known)


def occupancy(tokens, n_active, loads, capture_sizes: list[int], max_loras: int, cpu_misses=None,
              waiting=None, miss_bytes=None) -> Occupancy:
    """The Occupancy of steps given per step (arrays of equal length; ``miss_bytes``: what each
    step's misses read, None where not known)."""
    tokens, n_active = np.asarray(tokens, dtype=np.int64), np.asarray(n_active, dtype=np.int64)
    buckets = np.array([choose_bucket(int(t), capture_sizes) or int(t) for t in tokens], dtype=np.int64)
    weights, pmf = {}, {}
    for b in sorted(set(buckets.tolist())):
        here = n_active[buckets == b]
        weights[b] = len(here) / len(tokens)
        pmf[b] = np.bincount(np.minimum(here, min(b, max_loras)), minlength=min(b, max_loras) + 1) / len(here)
    mean = (lambda x: float(np.mean(x)) if x is not None else 0.0)
    return Occupancy(weights, pmf, float(tokens.mean()), mean(loads), mean(cpu_misses), mean(waiting), len(tokens),
                     None if miss_bytes is None else mean(miss_bytes))


def simulated(workload: str, adapters: Adapters, clients: int, max_loras: int, capture_sizes: list[int],
              steps: int = STEPS, seed: int = 0) -> Occupancy:
    """The loop's Occupancy, simulated once per setting (the report and its validation ask again)."""
    return _simulated(workload, adapters, clients, max_loras, tuple(capture_sizes), steps, seed)


def windows(workload: str, adapters: Adapters, clients: int, max_loras: int, capture_sizes: list[int], steps: int,
            count: int) -> list[Occupancy]:
    """``count`` short runs of the loop, ``steps`` steps each (seeds 1, 2, ...; not cached): what
    runs as long as a measured one vary by."""
    return [_simulated.__wrapped__(workload, adapters, clients, max_loras, tuple(capture_sizes), steps, seed)
            for seed in range(1, count + 1)]


@lru_cache(maxsize=256)
def _simulated(workload: str, adapters: Adapters, clients: int, max_loras: int, capture_sizes: tuple[int, ...],
               steps: int, seed: int) -> Occupancy:
    s = simulate(parse_workload(workload), adapters, clients, max_loras, steps, seed)
    sizes = adapters.file_bytes
    read = [sum(sizes[a % len(sizes)] for a in r) for r in s.reads] if sizes else None
    return occupancy(s.tokens, s.n_active, s.n_loads, list(capture_sizes), max_loras, s.cpu_misses, s.waiting, read)


def kv_bytes_per_token(row) -> int:
    """KV cache one token takes on the row's GPU: K and V of every layer's KV heads (one TP
    rank's share)."""
    kv_heads = max(1, int(row["kv_heads"]) // tp_of(row))
    return 2 * int(row["layers"]) * kv_heads * int(row["head_dim"]) * DTYPE_BYTES[row["dtype"]]
