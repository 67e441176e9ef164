"""What one worker will allocate, estimated from the shapes before anything is built, so that a
configuration that cannot fit is refused in one line instead of swapping or dying mid-sweep.

The resident terms mirror ``lorabench.runtime.model.LlamaLoRA`` tensor by tensor (its parameters
and buffers; in MoE layers ``runtime.moe.MoEMLP``'s router, experts, expert LoRA slots and routing
buffers); the rest are allowances: a step's activations and the check's float32 reference, the
float32 draw that makes each random weight, CUDA graphs (a fixed part and a part per graph and
layer, as sweeps on an H200 measured) and the worker process's own runtime.
"""

import math
from dataclasses import dataclass, replace

from lorabench.config.models import (
    LORA_LINEARS_PER_LAYER,
    ModelConfig,
    layer_lora_linears,
    lora_shares,
    moe_layer,
    moe_lora_shapes,
)
from lorabench.kernels import MAX_SLICES, REFERENCE_SIDE_BY_SIDE_FLOATS, extends, reference_side_by_side_floats, tail_width

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
    extended: bool = False  # the gemm backend's model: each linear whose tail fits holds a copy of every slot's B beside W
    cache_rows: int | None = None  # the KV cache's requests (None: max_tokens, a decode step's row per token)
    logit_tokens: int | None = None  # the most tokens a step makes logits for (None: max_tokens; a mixed step: its pieces')

    @property
    def rows(self) -> int:
        return self.max_tokens if self.cache_rows is None else self.cache_rows

    @property
    def logits(self) -> int:
        return self.max_tokens if self.logit_tokens is None else self.logit_tokens


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int  # base weights and norms
    adapters: int  # max_loras slots of A and B over every LoRA linear
    kv_cache: int  # and the rotary tables, also one row per position
    activations: int  # shrink scratch, a step's tensors, the check's reference, the draw of the largest weight
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


def _adapter_elements(s: Shape, i: int = 0) -> int:
    """One slot's LoRA weights in layer ``i``, as LlamaLoRA's LoRALinear holds them and, in a MoE
    layer, MoEMLP its expert LoRA."""
    total = 0
    for name, (k, widths) in layer_lora_linears(s.cfg, i).items():
        a_div, b_div = lora_shares(name, s.cfg.tp, s.fully_sharded)
        total += len(widths) * s.rank // a_div * k + sum(widths) // b_div * s.rank
    if moe_layer(s.cfg, i):
        total += sum(math.prod(shape) for shape in moe_lora_shapes(s.cfg, s.rank).values())
    return total


def _tail_elements(s: Shape, i: int) -> int:
    """Layer ``i``'s extended linears' tails (``LoRALinear.extend``): N rows of L·S·R, S one slice
    for a row-parallel linear whose B holds a share of the outputs."""
    total = 0
    for name, (k, widths) in layer_lora_linears(s.cfg, i).items():
        slices = 1 if lora_shares(name, s.cfg.tp, s.fully_sharded)[1] > 1 else len(widths)
        if extends(k, slices, s.max_loras, s.rank):
            total += sum(widths) * tail_width(slices, s.max_loras, s.rank)
    return total


def _linears(s: Shape) -> list[tuple[int, int, int]]:
    """(K, N, slices) of each distinct LoRA linear the layers have (a dense model: its four)."""
    found = {}
    for i in range(s.cfg.layers):
        for name, (k, widths) in layer_lora_linears(s.cfg, i).items():
            found.setdefault((name, k, widths), (k, sum(widths), len(widths)))
    return list(found.values())


def _moe_layers(cfg: ModelConfig) -> int:
    return sum(moe_layer(cfg, i) for i in range(cfg.layers))


def expert_lora_bytes_per_slot(cfg: ModelConfig, rank: int, dtype: str) -> int:
    """One adapter's expert LoRA over every MoE layer (0 for a dense model)."""
    per_layer = sum(math.prod(shape) for shape in moe_lora_shapes(cfg, rank).values())
    return DTYPE_BYTES[dtype] * _moe_layers(cfg) * per_layer


def model_bytes(s: Shape) -> tuple[int, int, int, int]:
    """What ``LlamaLoRA`` holds as parameters and buffers: (weights with norms, adapter slots, KV
    cache with the rotary tables, shrink scratch with the small buffers)."""
    cfg, b = s.cfg, DTYPE_BYTES[s.dtype]
    attention = 2 * cfg.hidden  # two norms
    attention += cfg.qkv_bias * (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim + cfg.o_bias * cfg.hidden  # biases
    attention += cfg.qk_norm * 2 * cfg.head_dim  # Qwen3's q and k norms, one head wide
    attention += cfg.qk_norm_full * (cfg.heads + cfg.kv_heads) * cfg.head_dim  # OLMoE's, all heads wide
    layer_weights = 0
    for i in range(cfg.layers):  # the base linears: attention, and the dense or shared expert MLP
        layer_weights += attention + sum(sum(widths) * k for k, widths in layer_lora_linears(cfg, i).values())
    moe, moe_layers = cfg.moe, _moe_layers(cfg)
    if moe is not None:  # router, w13 and w2 of every expert (one set where the layers share it), the shared expert's gate
        e, inter = moe.experts, moe.intermediate
        expert_sets = min(moe_layers, 1) if moe.shared_weights else moe_layers
        layer_weights += moe_layers * (e * cfg.hidden + (moe.shared_gate and moe.shared_intermediate > 0) * cfg.hidden)
        layer_weights += expert_sets * e * 3 * inter * cfg.hidden
    weights = b * (2 * cfg.vocab * cfg.hidden + cfg.hidden + layer_weights)  # embed, lm_head, final norm
    adapters = b * s.max_loras * sum(_adapter_elements(s, i) for i in range(cfg.layers))
    if s.extended:  # B again, in the extended weights' tails (zeros beside each slice's block)
        adapters += b * sum(_tail_elements(s, i) for i in range(cfg.layers))
    kv_cache = b * cfg.layers * 2 * s.rows * cfg.kv_heads * s.context_len * cfg.head_dim
    kv_cache += 4 * 2 * s.context_len * (cfg.head_dim // 2)  # rope_cos, rope_sin: float32, per position too
    scratch = 4 * cfg.layers * LORA_LINEARS_PER_LAYER * s.max_tokens * MAX_SLICES * s.rank
    scratch += 4 * s.max_loras  # each slot's own rank (int32)
    if moe is not None:  # each MoE layer's routing (topk_ids int64, topk_weights float32), and
        # each layer's slots' expert LoRA on or off (int32, vLLM's adapter_enabled per layer: max_loras + 1, the
        # last unused; a row for every layer, dense ones unread)
        scratch += moe_layers * (8 + 4) * s.max_tokens * moe.top_k + 4 * cfg.layers * (s.max_loras + 1)
    return weights, adapters, kv_cache, scratch


def step_bytes(s: Shape, cuda: bool) -> int:
    """One decode step's tensors at max_tokens (float32 upper bound, inputs and outputs). On a GPU
    in float32, grouped-query attention runs torch's math kernel, which repeats the KV heads for
    every query head (the flash kernels, and the CPU's, read them in place)."""
    cfg, t = s.cfg, s.max_tokens
    qkv = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
    step = 2 * 4 * (t * (4 * cfg.hidden + qkv + 3 * cfg.intermediate) + s.logits * cfg.vocab)
    if cfg.moe is not None:  # router logits; per routed entry: w13's output, SiLU·mul, w2's output
        moe = cfg.moe
        step += 4 * t * (moe.experts + moe.top_k * (2 * moe.intermediate + moe.intermediate + cfg.hidden))
    if cuda and s.dtype == "float32" and cfg.heads != cfg.kv_heads:
        step += DTYPE_BYTES[s.dtype] * 2 * t * cfg.heads * s.context_len * cfg.head_dim
    return step


def estimate(s: Shape, graphs: int, cuda: bool) -> MemoryEstimate:
    """The memory one worker needs for ``s`` with ``graphs`` captured graphs (none on the CPU)."""
    cfg, b, t = s.cfg, DTYPE_BYTES[s.dtype], s.max_tokens
    weights, adapters, kv_cache, scratch = model_bytes(s)
    if s.vllm:  # its per-slice copies of the dense LoRA linears; expert LoRA is handed over as views
        adapters += adapters - s.max_loras * expert_lora_bytes_per_slot(s.cfg, s.rank, s.dtype)
    linears = _linears(s)
    # The check's reference in float32 (kernels/reference.py): every token's input, h and update, a
    # slice's product, and either the active slots side by side (their A and B, each token's h through
    # all of them: reference_side_by_side_floats, their A and B also gathered in the model's dtype)
    # or, past its limit, one slot's A and B.
    active = min(s.max_loras, t)

    def reference_bytes(k, n, slices):
        rows, alone = slices * s.rank, 4 * t * (k + 2 * n + slices * s.rank)
        side = reference_side_by_side_floats(t, k, n, rows, s.rank, active)
        if side <= REFERENCE_SIDE_BY_SIDE_FLOATS:
            return alone + 4 * side + b * active * (rows * k + n * s.rank)
        return alone + 4 * (rows * k + n * s.rank)

    gathers = max(reference_bytes(k, n, slices) for k, n, slices in linears)
    # Each random weight is drawn in float32 and scaled (two float32 copies) before its cast.
    largest = max([cfg.vocab * cfg.hidden, s.rows * cfg.kv_heads * s.context_len * cfg.head_dim]
                  + [n * k for k, n, _ in linears]
                  + [s.max_loras * max(slices * s.rank * k, n * s.rank) for k, n, slices in linears]
                  + _moe_draws(s))
    draw = (4 if b == 4 else 8) * largest
    buffers = 16 * t + 8 * (2 * t + 2 * s.max_loras + 1)  # input ids, positions, metadata buffers
    step = step_bytes(s, cuda)
    activations = scratch + step + gathers + draw + buffers
    graph_bytes = GRAPHS_FIXED + graphs * (cfg.layers * GRAPH_PER_LAYER + 4 * s.logits * cfg.vocab) + step if cuda else 0
    return MemoryEstimate(weights, adapters, kv_cache, activations, graph_bytes)


def _moe_draws(s: Shape) -> list[int]:
    """Elements of MoEMLP's largest random weights, each drawn whole: w13 [E, 2I, hidden] and every
    slot's expert LoRA tensor [S, L, E, ...]."""
    if s.cfg.moe is None:
        return []
    w13 = s.cfg.moe.experts * 2 * s.cfg.moe.intermediate * s.cfg.hidden
    return [w13] + [s.max_loras * math.prod(shape) for shape in moe_lora_shapes(s.cfg, s.rank).values()]


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
    cfg = s.cfg
    if max(saved_slots, saved_context) < total / 2:
        experts = f", {cfg.moe.experts} experts" if cfg.moe else ""
        return f"{cfg.name} ({cfg.layers} layers{experts}, {s.dtype}) at {s.max_tokens} token slots"
    if saved_slots >= saved_context:
        if cfg.moe is None:
            return f"max_loras {s.max_loras}"
        expert = expert_lora_bytes_per_slot(cfg, s.rank, s.dtype)
        return f"max_loras {s.max_loras} at {size(expert)} of expert LoRA per slot"
    return f"context_len {s.context_len} at {s.max_tokens} token slots"
