"""What a worker records of each timed step of a point (``Steps``) and of its group's timed
adapter loads (``Loads``), as the protocol carries them; ``lorabench.storage.samples`` keeps them
in Parquet. Plain data: a worker imports this without pyarrow."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Steps:
    """One point's timed steps as its worker sends them: one entry per step in each list."""

    turn: list[int]
    step_ms: list[float]
    host_us: list[float]
    copy_us: list[float]
    launch_us: list[float]
    n_active: list[int]
    launches: list[int]
    tokens: list[int]
    loads: list[int]
    reads: list[int]  # adapters' files read from storage within the step (its CPU-cache misses, --adapters DIR)
    read_bytes: list[int]  # their bytes


@dataclass(frozen=True)
class Loads:
    """A worker group's timed adapter loads (``lorabench.runtime.adapters.time_loads``): what each
    added to the step it blocked, the load by itself, and the host's time of queueing it."""

    kernels: str
    max_loras: int
    load_ms: list[float]
    alone_ms: list[float]
    host_us: list[float]
    path: str = "per-slice"  # the load path (lorabench.runtime.load_paths): vLLM's per-slice copies, or another
