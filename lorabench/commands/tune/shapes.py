"""What a tune searches: the shapes (one tuned key each) and the configs worth timing per shape.

Shapes are the model's LoRA linears at every token bucket and max_loras, keyed as each backend
looks its configs up (``lorabench.commands.tune.backends``). Configs come from the backend's
search space; those that cannot compile or only pad a smaller config's tiles never run.
"""

import itertools
import random
from dataclasses import dataclass, replace

import triton

from lorabench.config.models import lora_linears, resolve, shard
from lorabench.config.tune_spec import TuneSpec

SMEM_BYTES = 232448  # shared memory one block may use on sm90 (227 KiB)
OPS = ("fused", "gemm", "shrink", "expand")  # the tuned ops, in table order


@dataclass(frozen=True)
class Shape:
    """One tuned key: the kernel (a backend), its op, the key it is looked up by, and what the
    timing problem is built from."""

    kernel: str
    op: str  # one of OPS
    linear: str  # qkv, o, gate_up, down; "o/down" where two linears share a key
    key: tuple  # the backend's config key (lorabench's: shape_key, launch count last; vLLM's: (max_loras + 1, slices, m, k, n))
    k: int
    slices: tuple
    tokens: int
    max_loras: int
    active: int  # adapters in the timing batch = lorabench's kernels' launch count

    @classmethod
    def measured(cls, kernel: str, op: str, key: tuple, linear: str) -> "Shape":
        """A shape known from a tune folder's cache rows only (an earlier tune's): enough to
        summarise and write it, never to time it (no problem dimensions)."""
        return cls(kernel, op, linear, tuple(key), k=0, slices=(), tokens=0, max_loras=0, active=0)

    @property
    def label(self) -> str:
        return f"{self.kernel} {self.op} {self.linear} {list(self.key)}"


def build_shapes(spec: TuneSpec, backends: dict) -> list[Shape]:
    """Every shape of the spec's kernels, in the backends' order; linears that share a key are
    tuned once (``o/down``). ``backends``: name -> its TuneBackend."""
    found: dict[tuple, Shape] = {}
    for m, L, (name, (k, slices)) in itertools.product(spec.tokens, spec.max_loras, lora_linears(shard(resolve(spec.model), spec.tp)).items()):
        for kernel in spec.kernels:
            for s in backends[kernel].shapes(name, k, slices, m, L, spec.rank):
                old = found.setdefault((s.kernel, s.op, s.key), s)
                if s.linear not in old.linear.split("/"):
                    found[(s.kernel, s.op, s.key)] = replace(old, linear=f"{old.linear}/{s.linear}")
    order = list(backends)
    return sorted(found.values(), key=lambda s: (order.index(s.kernel), OPS.index(s.op)))


def too_big(shape: Shape, c: dict) -> str | None:
    """Why no backend's config can run: a block below tl.dot's minimum, or past the tokens."""
    if min(c["block_m"], c["block_n"], c.get("block_k", 16)) < 16:
        return "a block below 16 (tl.dot's minimum)"
    if c["block_m"] > max(16, triton.next_power_of_2(shape.tokens)):
        return "block_m past the tokens"
    return None


def candidates(shape: Shape, backend, default: dict, rank: int, elem: int, sm90: bool, seed: int) -> list[dict]:
    """The configs worth running besides the default, in a seeded random order."""
    space = backend.space(shape)
    configs = [{**default, **dict(zip(space, values))} for values in itertools.product(*space.values())]
    viable = [c for c in configs if c != default and not too_big(shape, c)
              and not backend.waste(shape, c, rank, elem, sm90, default)]
    random.Random(f"{seed}/{shape.kernel}/{shape.op}/{shape.key}").shuffle(viable)
    return viable
