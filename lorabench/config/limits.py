"""What one worker will allocate, estimated from the shapes before anything is built, so that a
configuration that cannot fit is refused in one line instead of swapping or dying mid-sweep.

The resident terms mirror ``lorabench.runtime.model.LlamaLoRA`` tensor by tensor (its parameters
and buffers); the rest are allowances: a step's activations and the check's float32 gathers, the
float32 draw that makes each random weight, CUDA graphs (a fixed part and a part per graph and
layer, as sweeps on an H200 measured) and the worker process's own runtime.
"""

from dataclasses import dataclass, replace

from lorabench.config.models import ModelConfig, lora_linears, lora_shares
from lorabench.kernels import MAX_SLICES

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
GiB, MiB, KiB = 2**30, 2**20, 2**10
GRAPHS_FIXED = 128 * MiB  # per worker on a GPU: 110-132 MiB measured for 4-15 graphs of llama-2-7b
GRAPH_PER_LAYER = 64 * KiB  # each more graph of 32 layers took about 2 MiB
RUNTIME = 512 * MiB  # the worker's torch runtime: CUDA context on a GPU, the interpreter and libraries on the CPU


@dataclass(frozen=True)
class Shape:
    """One worker's configuration, as far as memory goes."""

    cfg: ModelConfig  # layers already shortened
    max_loras: int
    rank: int
    dtype: str
    max_tokens: int  # token slots the model is built with
    context_len: int
    vllm: bool = False  # vLLM's ops keep their own contiguous copy of every adapter slice
    fully_sharded: bool = False  # --fully-sharded-loras: A or B further cut over the TP ranks


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int  # base weights and norms
    adapters: int  # max_loras slots of A and B over every LoRA linear
    kv_cache: int  # and the rotary tables, also one row per position
    activations: int  # shrink scratch, a step's tensors, the check's gathers, the draw of the largest weight
    graphs: int  # allowance for captured graphs (0 on the CPU: eager steps)
    runtime: int = RUNTIME

    @property
    def total(self) -> int:
        return self.weights + self.adapters + self.kv_cache + self.activations + self.graphs + self.runtime

    def parts(self) -> list[tuple[str, int, bool]]:
        """(name, bytes, only an allowance) of each term; no graphs term on the CPU."""
        parts = [("weights", self.weights, False), ("adapter slots", self.adapters, False),
                 ("KV cache", self.kv_cache, False), ("activations", self.activations, False)]
        if self.graphs:
            parts.append(("graphs", self.graphs, True))
        return parts + [("runtime", self.runtime, True)]

    def describe(self) -> str:
        """``weights 1.8 MiB + adapter slots 24.4 GiB + ... + runtime ~0.5 GiB = 28.0 GiB``."""
        terms = [f"{name} {'~' if rough else ''}{size(b)}" for name, b, rough in self.parts()]
        return " + ".join(terms) + f" = {size(self.total)}"


def size(b: float) -> str:
    return f"{b / GiB:.1f} GiB" if b >= 0.1 * GiB else f"{b / MiB:.1f} MiB"


def _adapter_elements(s: Shape) -> int:
    """One slot's LoRA weights in one layer, as LlamaLoRA's LoRALinear holds them."""
    total = 0
    for name, (k, widths) in lora_linears(s.cfg).items():
        a_div, b_div = lora_shares(name, s.cfg.tp, s.fully_sharded)
        total += len(widths) * s.rank // a_div * k + sum(widths) // b_div * s.rank
    return total


def _linears(s: Shape) -> list[tuple[int, int, int]]:
    """(K, N, slices) of each LoRA linear of one layer."""
    return [(k, sum(widths), len(widths)) for k, widths in lora_linears(s.cfg).values()]


def model_bytes(s: Shape) -> tuple[int, int, int, int]:
    """What ``LlamaLoRA`` holds as parameters and buffers: (weights with norms, adapter slots, KV
    cache with the rotary tables, shrink scratch)."""
    cfg, b = s.cfg, DTYPE_BYTES[s.dtype]
    per_layer = 2 * cfg.hidden + sum(n * k for k, n, _ in _linears(s))  # two norms, the base linears
    per_layer += cfg.qkv_bias * (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim + cfg.o_bias * cfg.hidden  # biases
    per_layer += cfg.qk_norm * 2 * cfg.head_dim  # Qwen3's q and k norms
    weights = b * (2 * cfg.vocab * cfg.hidden + cfg.hidden + cfg.layers * per_layer)  # embed, lm_head, final norm
    adapters = b * cfg.layers * s.max_loras * _adapter_elements(s)
    kv_cache = b * cfg.layers * 2 * s.max_tokens * cfg.kv_heads * s.context_len * cfg.head_dim
    kv_cache += 4 * 2 * s.context_len * (cfg.head_dim // 2)  # rope_cos, rope_sin: float32, per position too
    scratch = 4 * cfg.layers * len(_linears(s)) * s.max_tokens * MAX_SLICES * s.rank
    scratch += 4 * s.max_loras  # each slot's own rank (int32)
    return weights, adapters, kv_cache, scratch


def step_bytes(s: Shape, cuda: bool) -> int:
    """One decode step's tensors at max_tokens (float32 upper bound, inputs and outputs). On a GPU
    in float32, grouped-query attention runs torch's math kernel, which repeats the KV heads for
    every query head (the flash kernels, and the CPU's, read them in place)."""
    cfg, t = s.cfg, s.max_tokens
    qkv = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
    step = 2 * 4 * t * (4 * cfg.hidden + qkv + 3 * cfg.intermediate + cfg.vocab)
    if cuda and s.dtype == "float32" and cfg.heads != cfg.kv_heads:
        step += DTYPE_BYTES[s.dtype] * 2 * t * cfg.heads * s.context_len * cfg.head_dim
    return step


def estimate(s: Shape, graphs: int, cuda: bool) -> MemoryEstimate:
    """The memory one worker needs for ``s`` with ``graphs`` captured graphs (none on the CPU)."""
    cfg, b, t = s.cfg, DTYPE_BYTES[s.dtype], s.max_tokens
    weights, adapters, kv_cache, scratch = model_bytes(s)
    if s.vllm:
        adapters *= 2
    linears = _linears(s)
    # The check's reference gathers each token's A and B, then makes them float32.
    gathers = (b + 4) * t * max(slices * s.rank * k + n * s.rank for k, n, slices in linears)
    # Each random weight is drawn in float32 and scaled (two float32 copies) before its cast.
    largest = max([cfg.vocab * cfg.hidden, t * cfg.kv_heads * s.context_len * cfg.head_dim]
                  + [n * k for k, n, _ in linears]
                  + [s.max_loras * max(slices * s.rank * k, n * s.rank) for k, n, slices in linears])
    draw = (4 if b == 4 else 8) * largest
    buffers = 16 * t + 8 * (2 * t + 2 * s.max_loras + 1)  # input ids, positions, metadata buffers
    step = step_bytes(s, cuda)
    activations = scratch + step + gathers + draw + buffers
    graph_bytes = GRAPHS_FIXED + graphs * (cfg.layers * GRAPH_PER_LAYER + 4 * t * cfg.vocab) + step if cuda else 0
    return MemoryEstimate(weights, adapters, kv_cache, activations, graph_bytes)


def graph_count(counts: list[int], max_loras: int, capture_sizes: list[int], bucket_grid: bool, vllm: bool) -> int:
    """Graphs a worker captures, no-LoRA graphs included (``runtime.dispatch`` keys: only
    reachable launch counts per bucket; vLLM's rules: every key, its base id's too, per bucket)."""
    if vllm:
        return len(capture_sizes) * (len(counts) + 2)
    total = 0
    for bucket in capture_sizes:
        top = min(bucket, max_loras)
        if bucket_grid:
            total += 2
        else:  # the counts that some n in 1..top rounds up to, and the no-LoRA graph
            total += 1 + len([c for c in counts if c < top]) + 1
    return total


def culprit(s: Shape, graphs: int, cuda: bool) -> str:
    """What to name as not fitting: the setting whose smallest value would save the most
    (max_loras or context_len), or else the model itself."""
    total = estimate(s, graphs, cuda).total
    saved_slots = total - estimate(replace(s, max_loras=1), graphs, cuda).total
    saved_context = total - estimate(replace(s, context_len=1), graphs, cuda).total
    if max(saved_slots, saved_context) < total / 2:
        return f"{s.cfg.name} ({s.cfg.layers} layers, {s.dtype}) at {s.max_tokens} token slots"
    if saved_slots >= saved_context:
        return f"max_loras {s.max_loras}"
    return f"context_len {s.context_len} at {s.max_tokens} token slots"
