"""How lorabench's Triton kernels launch here: in Triton's CPU interpreter (``TRITON_INTERPRET=1``)
or compiled, and on sm90+ with programmatic dependent launch (PDL).

Decode kernels are latency-bound: under PDL a kernel starts while its predecessor finishes, loads
its weights, and waits (``pdl_wait``) only before it touches what the predecessor writes. Used by
the shrink, the expand, the fused kernel and the base ops.
"""

import functools
import os

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter returns garbage from tl.dot on bf16 operands (exact on fp16 and fp32),
# so under the interpreter bf16 tiles are upcast to fp32 before the dot. GPU code is unaffected.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Programs a split kernel aims its grid at: about 4 resident per SM of a 132-SM H100 or H200, one wave. Fewer
# leave A's stream short of reads in flight; past it a second, partial wave costs (the prompt shrink at
# 2048 tokens: 4 parts 18.8 µs, 5 parts 33.4, BENCHMARKS.md).
WAVE_PROGRAMS = 528


def upcast(dtype: torch.dtype) -> bool:
    """A kernel's UPCAST: dots in fp32, for bf16 operands under the interpreter only."""
    return INTERPRET and dtype == torch.bfloat16


def dot_width(n: int) -> int:
    """A dot operand's axis of n: the next power of two, at least 16 (``tl.dot``'s smallest)."""
    return max(16, next_pow2(n))


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host. Triton's own (``triton.cdiv``, ``triton.next_power_of_2``) are
    constexpr functions since 3.5, ~4 µs a host call: a LoRA launch computed a dozen of them."""
    return -(-int(a) // int(b))


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0, as ``triton.next_power_of_2``), on the host."""
    return 1 << (int(n) - 1).bit_length() if n > 0 else 0


def pow2_floor(n: int) -> int:
    """The largest power of two <= n (1 for n <= 1), on the host."""
    return 1 << (max(1, int(n)).bit_length() - 1)


def _index(device: torch.device) -> int:
    """A CUDA device's index (``cuda`` alone: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _sm90_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The device's SMs; 1 off a GPU (the interpreter runs programs one by one)."""
    return _sm_count(_index(device)) if device.type == "cuda" else 1


def pdl_enabled(device: torch.device) -> bool:
    """Whether lorabench's Triton kernels launch with programmatic dependent launch on ``device``:
    CUDA sm90 or newer, not the interpreter, and not switched off with ``LORABENCH_PDL=0``."""
    if INTERPRET or device.type != "cuda" or os.environ.get("LORABENCH_PDL", "1") == "0":
        return False
    return _sm90_or_newer(_index(device))


def pdl_launch(use: bool) -> dict:
    """Launch options for a kernel that takes ``USE_PDL``: ``launch_pdl`` only when used (the
    interpreter and older Triton launchers do not know it)."""
    return {"launch_pdl": True} if use else {}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the kernel this one was PDL-launched after has finished and its writes are
    visible. Every program of a PDL-launched kernel calls it before it writes and before it
    exits, so a grid's completion still implies its predecessors' (stream order stays transitive)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
