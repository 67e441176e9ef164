"""LoRA kernels: Punica-style shrink (h = s·x·Aᵀ) then expand (y += h·Bᵀ), grouped by adapter slot.

Installed as ``lorabench.kernels``. Every backend computes, for a LoRA linear with slices
``slice_starts = (0, n0, n0+n1, ...)`` over a fused output ``y[T, N]``::

    for each token t whose slot is one of active_slots[:launch_count]:
        h = scale · A[slot] @ x[t]                     # [S·R]: the rank-R piece of every slice
        y[t, slice s] += B[slot][slice s] @ h[s·R:(s+1)·R]

The slices may end before y does (``slice_starts[-1] < N``: a fully sharded row-parallel TP rank
updates its share of the outputs only), and A may hold R / TP rows per slice (a fully sharded
column-parallel rank: the other ranks' shares of h count as zero, their all-gather left out).
Tokens of slot -1 (base model) are never touched. A token whose slot lies past the launch count
is not updated either: that is what a grid with too small an adapter dimension does, and the
graph dispatcher must never let it happen (tests prove it does not).

Weight layout (one tensor each, per LoRA linear):
    lora_a: [max_loras, S·R, K]   the slices' A matrices stacked along the rank axis
    lora_b: [max_loras, N, R]     the slices' B matrices stacked along the output axis
"""

import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

if __name__ == "kernels":
    # Imported as a top-level `kernels`: the repository root is on sys.path (`python -m` or
    # `python -c` run there), so this folder shadows PyPI's `kernels` (Hugging Face's, which
    # transformers imports). Load that one in its place; this package is lorabench.kernels only.
    import importlib.machinery
    import importlib.util

    _root = Path(__file__).resolve().parents[1]
    _elsewhere = [p for p in sys.path if Path(p or ".").resolve() != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None:
        # None installed: an empty module with no file and no version, which transformers'
        # package check reads as a namespace package shadowing on sys.path, "not installed" (an
        # import error here would break its check, and every config it guards). A library that
        # only tries `import kernels` would take it as installed, then find none of its names.
        import types

        _module = types.ModuleType("kernels", "not installed (lorabench's kernels import as lorabench.kernels)")
        _module.__spec__ = importlib.machinery.ModuleSpec("kernels", None)
        sys.modules["kernels"] = _module
    else:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # what this import returns; the rest of this file goes to a discarded module
        _spec.loader.exec_module(_module)

RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM allows as --max-lora-rank; the kernels take any 1..512
MAX_RANK = 512
DTYPES = ("float16", "bfloat16", "float32")  # torch dtype names the kernels take
MAX_SLICES = 3
# The plain-torch reference (``reference.lora_delta``) runs a LoRA linear's active slots side by side
# in a few matmuls while that holds at most this many float32 values, else one slot at a time.
REFERENCE_SIDE_BY_SIDE_FLOATS = 2**26


def reference_side_by_side_floats(tokens: int, k: int, n: int, rows: int, rank: int, active: int) -> int:
    """The float32 values the reference's side-by-side path holds for one LoRA linear of input K,
    output N, A's ``rows`` (S·R) and B's ``rank`` columns, over ``tokens`` tokens of ``active``
    slots: the slots' A and B, each token's h through all of them, and the expand's spread h."""
    return active * (rows * k + n * rank) + tokens * active * (rows + rank)


# The extended GEMM (``extended_gemm``: LoRA as extra K columns of the base GEMM): a linear's tail, room
# for every slot's B, may add at most this share of its K. A step pays for its launched slots' share
# of it: with all 4 slots of rank 16 launched on qkv, E/K = 4.7 % more FLOPs, while the pair's expand
# costs 10-25 % of the GEMM there (``scripts/catk_probe.py``, H100, llama-2-7b, 2048 tokens, one adapter).
EXTEND_MAX_FRACTION = 1 / 8
# The extended GEMM's tail columns come in multiples of this: rows of K + E elements stay a multiple
# of 16 where K is. cuBLAS's fast kernels want 16-byte rows (8 elements); Triton vectorises a load
# only where it can prove the row stride divisible by 16 (it specialises integer arguments so): at
# rows of 8 modulo 16 (3 slots x 3 slices x rank 8) the shrink's x tile, read from such rows,
# compiles to 2-byte loads instead of 16-byte cp.async (tests/compile_sm90.py checks it).
TAIL_ALIGN = 16


def tail_width(slices: int, slots: int, rank: int) -> int:
    """Tail columns for ``slots`` blocks of S·R, rounded up to ``TAIL_ALIGN``: with every slot, E,
    the extended weight's extra K columns; with a step's launch count, E_n, the columns its GEMM
    reads."""
    return -(-slots * slices * rank // TAIL_ALIGN) * TAIL_ALIGN


def extends(k: int, slices: int, max_loras: int, rank: int) -> bool:
    """Whether a linear of K inputs takes the extended GEMM (its tail within ``EXTEND_MAX_FRACTION``)."""
    return tail_width(slices, max_loras, rank) <= k * EXTEND_MAX_FRACTION


@dataclass(frozen=True)
class Backend:
    """A kernel backend: one module of this package with ``lora_apply(y, x, lora_a, lora_b,
    slice_starts, meta, launch_count, scale, scratch)`` and ``NEEDS_ZEROED_SCRATCH`` (optionally
    ``LETS_CONSUMER_LAUNCH``: its kernels let the next kernel launch early, so the model
    PDL-launches the base ops)."""

    name: str
    module: str
    triton: bool  # Triton kernels: compiled on a GPU, run by Triton's interpreter on the CPU
    tunable: bool  # `lorabench tune` writes configs for it
    doc: str
    unpadded: bool = False  # reads LoRAMeta.slot_rank: computes each adapter at its own rank, skipping the padding
    extends_k: bool = False  # its module's EXTENDS_K: the model holds [W | B's tail] where it fits (``extends``)


# What sweeps measure, in report order. ``vllm`` wraps vLLM's own ops and takes vLLM's metadata
# (``lorabench.runtime.vllm_rules``) instead of ``LoRAMeta``.
BACKENDS = {b.name: b for b in (
    Backend("triton", "triton_lora", triton=True, tunable=True, doc="lorabench's shrink + expand", unpadded=True),
    Backend("fused", "fused_lora", triton=True, tunable=True, doc="lorabench's one launch per LoRA linear", unpadded=True),
    Backend("gemm", "gemm_lora", triton=True, tunable=True, doc="lorabench's shrink, then the base GEMM with the expand in its epilogue (up to 64 tokens over at most 2 launched slots; above 64 tokens, cuBLAS with the expand in its K; over more slots, cuBLAS and the pair)",
            unpadded=True, extends_k=True),
    Backend("torch", "torch_lora", triton=False, tunable=False, doc="the grid semantics in torch ops"),
    Backend("vllm", "vllm_lora", triton=True, tunable=True, doc="vLLM's own shrink + expand"),
)}


def get_backend(name: str):
    """A backend's module; ``reference`` is the ground truth (it ignores the launch count)."""
    if name == "reference":
        return importlib.import_module(".reference", __name__)
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r} (choose from {', '.join(BACKENDS)})")
    return importlib.import_module("." + BACKENDS[name].module, __name__)
