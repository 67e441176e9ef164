"""A compact Llama-style decoder for decode steps, with LoRA on q, k, v, o, gate, up and down.

Llama, Mistral, Qwen2 (biases on q, k, v) and Qwen3 (per-head q and k norms) differ only in
what ``ModelConfig`` says; so do the MoE decoders (Qwen3-MoE, Mixtral, OLMoE with its
whole-width q and k norms, Qwen2-MoE with a shared expert), whose MoE layers replace the MLP by
``runtime.moe.MoEMLP`` and its LoRA by expert LoRA. Built at a tensor-parallel rank's shapes (``models.shard``), it is
that rank's step without its all-reduces.

One forward = one decode step: ``T`` tokens, one per request, each attending over its own static
KV cache of ``context_len`` positions. Weights are random, created on the device from the shapes
of ``lorabench.config.models`` (qkv, o, gate_up, down: the LoRA linears, fused as servers fuse them).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lorabench.config.models import (
    LORA_LINEARS_PER_LAYER,
    ModelConfig,
    layer_lora_linears,
    lora_shares,
    moe_layer,
)
from lorabench.kernels import MAX_SLICES, extended_gemm, extends, producer_shrink, prompt_shrink, tail_width
from lorabench.kernels.base_ops import add_rmsnorm, qk_rmsnorm, qk_rmsnorm_full, rope_and_cache, rotate, silu_mul
from lorabench.kernels.meta import LoRAMeta
from lorabench.kernels.varlen_attention import varlen_attention
from lorabench.runtime.mixed_attention import MixedLayout, attend, blocks_of, check_layout, index_of
from lorabench.runtime.moe import MoEMLP, expert_weights


@dataclass(frozen=True)
class LoRAStep:
    """What one forward needs to apply LoRA: the backend, the batch metadata, the launch count."""

    backend: object  # a kernels backend module: lora_apply (or linear_apply), NEEDS_ZEROED_SCRATCH
    meta: LoRAMeta
    launch_count: int
    scale: float


def _randn(shape, std, dtype, device, gen):
    return (torch.randn(shape, device=device, dtype=torch.float32, generator=gen) * std).to(dtype)


class LoRALinear(nn.Module):
    """A fused linear (output = slices side by side) with ``max_loras`` resident adapter slots."""

    def __init__(self, in_features, slice_sizes, max_loras, rank, dtype, device, gen, bias=False, shares=(1, 1)):
        """shares: (A's rank divisor, B's output divisor) under fully sharded LoRA
        (``models.lora_shares``): A holds rank / a rows per slice, B the first N / b outputs."""
        super().__init__()
        n = sum(slice_sizes)
        a_div, b_div = shares
        self.weight = nn.Parameter(_randn((n, in_features), in_features**-0.5, dtype, device, gen), False)
        self.bias = nn.Parameter(_randn((n,), 0.02, dtype, device, gen), False) if bias else None
        if b_div > 1:  # a row-parallel linear (one slice): LoRA updates this rank's share of the outputs
            slice_sizes = (n // b_div,)
        self.lora_n = sum(slice_sizes)
        self.slice_starts = tuple(sum(slice_sizes[:i]) for i in range(len(slice_sizes) + 1))
        a_shape = (max_loras, len(slice_sizes) * rank // a_div, in_features)
        self.lora_a = nn.Parameter(_randn(a_shape, in_features**-0.5, dtype, device, gen), False)
        self.lora_b = nn.Parameter(_randn((max_loras, self.lora_n, rank), rank**-0.5, dtype, device, gen), False)
        self.weight_ext: torch.Tensor | None = None  # [N, K + E]: the weight, then the launched slots' B (``extend``)

    def extend(self) -> bool:
        """Hold the weight as the first K columns of ``weight_ext`` = [W | tail], the extended GEMM's
        operand (``extended_gemm``), where the tail (room for every slot's B) fits its bound; whether it does."""
        k, slices = self.weight.shape[1], len(self.slice_starts) - 1
        slots, _, rank = self.lora_b.shape
        if self.weight_ext is None and extends(k, slices, slots, rank):
            width = k + tail_width(slices, slots, rank)
            ext = torch.zeros(self.weight.shape[0], width, dtype=self.weight.dtype, device=self.weight.device)
            ext[:, :k] = self.weight
            self.weight = nn.Parameter(ext[:, :k], False)  # a view: the base GEMM reads it in place
            self.weight_ext = ext  # its tail: the launched slots' B, written by each step that reads it
        return self.weight_ext is not None

    def takes_extended(self, lora: LoRAStep | None, tokens: int) -> bool:
        """Whether a step of ``tokens`` runs this linear as the extended GEMM: a backend that asks
        for it (``EXTENDS_K``: ``gemm`` above its ``GEMM_MAX_TOKENS``) on an extended weight."""
        return (self.weight_ext is not None and lora is not None and lora.launch_count > 0
                and getattr(lora.backend, "EXTENDS_K", False) and tokens > lora.backend.GEMM_MAX_TOKENS)

    def input_view(self, lora: LoRAStep | None, tokens: int) -> torch.Tensor | None:
        """Where the op producing this linear's input writes it: the first K columns of a new
        extended input where the step takes the extended GEMM, else None (its own tensor)."""
        if not self.takes_extended(lora, tokens):
            return None
        return extended_gemm.input_buffer(tokens, self.weight.shape[1], self.weight_ext.shape[1], self.weight.dtype,
                                          self.weight.device)

    def pad(self, slot_ranks: list[int], rank: int) -> None:
        """Zero every slot's A rows and B columns past its adapter's own rank (vLLM's padding)."""
        slices = len(self.slice_starts) - 1
        rows = self.lora_a.shape[1] // slices  # the rank, or this rank's share of it (fully sharded)
        for slot, r in enumerate(slot_ranks):
            if r < rank:
                for s in range(slices):
                    self.lora_a.data[slot, s * rows + min(r, rows):(s + 1) * rows] = 0
                self.lora_b.data[slot, :, r:] = 0

    def shrinks_in_producer(self, lora: LoRAStep | None, tokens: int, prompt: bool = False) -> bool:
        """Whether the op producing this linear's input also computes its shrink (``gemm``): at decode
        sizes where the backend runs its own GEMM (``producer_shrink``, ``runs_gemm``); at prompt
        sizes where the producer has a kernel for them (``prompt``: SiLU·mul's, ``prompt_shrink``),
        the linear runs as the extended GEMM and its A fits."""
        if lora is None or lora.launch_count <= 0 or not getattr(lora.backend, "SHRINK_IN_PRODUCER", False):
            return False
        if tokens <= producer_shrink.MAX_TOKENS and lora.backend.runs_gemm(tokens, lora.launch_count):
            return True
        return prompt and self.takes_extended(lora, tokens) and self.lora_a.shape[1] <= prompt_shrink.MAX_ROWS

    def shrink_args(self, lora: LoRAStep, scratch: torch.Tensor) -> tuple:
        """What ``producer_shrink`` takes after its input: A, h (zero), the batch, the launch count, scale, rank."""
        return self.lora_a, scratch, lora.meta, lora.launch_count, lora.scale, self.lora_b.shape[2]

    def forward(self, x, lora: LoRAStep | None, scratch: torch.Tensor, shrunk: bool = False):
        """``shrunk``: scratch holds h already (``shrinks_in_producer``)."""
        linear_apply = getattr(lora.backend, "linear_apply", None) if lora is not None else None
        if linear_apply is not None and not lora.backend.runs_gemm(x.shape[0], lora.launch_count):
            x_ext = extended_gemm.extended_of(x, self.weight_ext.shape[1]) if self.takes_extended(lora, x.shape[0]) else None
            if x_ext is not None:  # prefill sizes, x written into an extended input: one cuBLAS GEMM holds the expand
                return extended_gemm.extended_linear(x_ext, self.weight.shape[1], self.weight_ext, self.bias, self.lora_a,
                                                     self.lora_b, self.slice_starts, lora.meta, lora.launch_count,
                                                     lora.scale, scratch, shrunk=shrunk)
            if shrunk:  # the pair would shrink again into an h that holds the producer's
                raise ValueError(f"{x.shape[0]} tokens: the producer shrank for a linear that does not run extended")
            linear_apply = None  # otherwise cuBLAS and the backend's lora_apply (the pair)
        if linear_apply is not None:  # the backend runs the base GEMM too, its LoRA inside (``gemm``)
            return linear_apply(x, self.weight, self.bias, self.lora_a, self.lora_b, self.slice_starts, lora.meta,
                                lora.launch_count, lora.scale, scratch, shrunk=shrunk)
        y = F.linear(x, self.weight, self.bias)
        if lora is not None:  # slice_starts may end before y does: a fully sharded rank's share of the outputs (offset 0)
            lora.backend.lora_apply(
                y, x, self.lora_a, self.lora_b, self.slice_starts, lora.meta, lora.launch_count, lora.scale, scratch
            )
        return y


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index, max_loras, rank, max_tokens, context_len, dtype, device, gen,
                 fully_sharded, cache_rows, experts=None):
        super().__init__()
        d, kvh = cfg.head_dim, cfg.kv_heads
        args = (max_loras, rank, dtype, device, gen)
        shapes = layer_lora_linears(cfg, index)
        shares = {name: lora_shares(name, cfg.tp, fully_sharded) for name in shapes}
        self.cfg = cfg
        self.attn_norm = nn.Parameter(torch.ones(cfg.hidden, dtype=dtype, device=device), False)
        self.qkv = LoRALinear(*shapes["qkv"], *args, bias=cfg.qkv_bias, shares=shares["qkv"])
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(d, dtype=dtype, device=device), False)
            self.k_norm = nn.Parameter(torch.ones(d, dtype=dtype, device=device), False)
        if cfg.qk_norm_full:  # OLMoE: one norm over all of q, one over all of k
            self.q_norm = nn.Parameter(torch.ones(cfg.heads * d, dtype=dtype, device=device), False)
            self.k_norm = nn.Parameter(torch.ones(kvh * d, dtype=dtype, device=device), False)
        self.o = LoRALinear(*shapes["o"], *args, bias=cfg.o_bias, shares=shares["o"])
        self.mlp_norm = nn.Parameter(torch.ones(cfg.hidden, dtype=dtype, device=device), False)
        self.gate_up = LoRALinear(*shapes["gate_up"], *args, shares=shares["gate_up"]) if "gate_up" in shapes else None
        self.down = LoRALinear(*shapes["down"], *args, shares=shares["down"]) if "down" in shapes else None
        self.moe = None
        if moe_layer(cfg, index):  # the dense pair, where there is one, is its shared expert
            shared = (self.gate_up, self.down) if self.gate_up is not None else None
            self.gate_up = self.down = None
            self.moe = MoEMLP(cfg, max_loras, rank, max_tokens, dtype, device, gen, shared, experts)
        # Static KV cache; random, not zero, so attention reads real-looking data.
        cache_shape = (cache_rows, kvh, context_len, d)
        self.register_buffer("cache_k", _randn(cache_shape, 1.0, dtype, device, gen), persistent=False)
        self.register_buffer("cache_v", _randn(cache_shape, 1.0, dtype, device, gen), persistent=False)

    def attention_input(self, x, delta, lora, scratch, fused, pdl):
        """The block up to attention: (q, k, v side by side [T, (H + 2 KVH) D], the residual stream x + delta).
        x: residual stream [T, hidden]; delta: the previous block's output still to be added
        (fused into this block's first norm). pdl: PDL-launch the base ops that follow a LoRA
        kernel (it lets them launch early); the first layer's first norm follows the embedding
        gather instead."""
        cfg = self.cfg
        qkv, x = self._norm_then(self.qkv, x, delta, self.attn_norm, lora, scratch[0], fused, pdl and delta is not None)
        if cfg.qk_norm:
            qkv = qk_rmsnorm(qkv, self.q_norm, self.k_norm, cfg.heads, cfg.kv_heads, cfg.norm_eps)
        elif cfg.qk_norm_full:
            qkv = qk_rmsnorm_full(qkv, self.q_norm, self.k_norm, cfg.norm_eps)
        return qkv, x

    def attention(self, qkv, pos, rope, fused, pdl, layout: MixedLayout | None = None, out=None):
        """Attention [T, H D]. layout: a mixed step's pieces (``mixed_attention``); None: a decode
        step, token t in cache row t attending to the whole cache (the benchmark's fixed context).
        out: a [T, H D] buffer to write into (a mixed step's fused kernel writes it directly; a decode
        step copies into it): the piecewise graphs' static one, or o's extended input (``input_view``)."""
        cfg, t = self.cfg, qkv.shape[0]
        if layout is not None:
            return self._mixed_attention(qkv, rope, layout, fused, out).reshape(t, cfg.heads * cfg.head_dim)
        q = rope_and_cache(qkv, *rope, pos, self.cache_k, self.cache_v, cfg.heads, cfg.kv_heads, fused, pdl)
        attn = F.scaled_dot_product_attention(
            q.unsqueeze(2), self.cache_k[:t], self.cache_v[:t], enable_gqa=cfg.heads != cfg.kv_heads
        ).reshape(t, cfg.heads * cfg.head_dim)
        return attn if out is None else out.copy_(attn)

    def after_attention(self, attn, x, lora, scratch, fused, pdl, moe_state=None):
        """The block from attention on: o, then the MLP (or MoE). Returns (residual stream, this
        block's delta). moe_state: (each slot's expert LoRA enabled in this layer [L + 1], reuse the last routing)."""
        attn_out = self.o(attn, lora, scratch[1])
        if self.moe is not None:
            h, x = add_rmsnorm(x, attn_out, self.mlp_norm, self.cfg.norm_eps, fused, pdl)
            return x, self.moe(h, lora, scratch, *moe_state, fused, pdl)
        gate_up, x = self._norm_then(self.gate_up, x, attn_out, self.mlp_norm, lora, scratch[2], fused, pdl)
        if fused and self.down.shrinks_in_producer(lora, x.shape[0], prompt=True):
            if self.down.takes_extended(lora, x.shape[0]):  # prompt sizes: into down's extended input
                act = prompt_shrink.silu_mul_shrink(gate_up, *self.down.shrink_args(lora, scratch[3]),
                                                    out=self.down.input_view(lora, x.shape[0]))
            else:
                act = producer_shrink.silu_mul_shrink(gate_up, *self.down.shrink_args(lora, scratch[3]), pdl)
            return x, self.down(act, lora, scratch[3], shrunk=True)
        act = silu_mul(gate_up, fused, pdl, out=self.down.input_view(lora, x.shape[0]))
        return x, self.down(act, lora, scratch[3])

    def _mixed_attention(self, qkv, rope, layout, fused, out=None):
        """Rotary q and k at each token's position (the layout's), then attention over each piece's
        cached context: two kernels (``fused``), or torch ops. [T, H, D], written into ``out`` [T, H D]
        when given (by the second kernel itself)."""
        cfg, t, d = self.cfg, qkv.shape[0], self.cfg.head_dim
        check_layout(layout, t, self.cache_k.shape)  # before the rotary tables are indexed at its positions
        index = index_of(layout, qkv.device)
        out = None if out is None else out.view(t, cfg.heads, d)
        if fused:
            q = rope_and_cache(qkv, *rope, index.positions, self.cache_k, self.cache_v, cfg.heads, cfg.kv_heads,
                               rows=index.token_rows)
            table = blocks_of(layout, qkv.device, cfg.heads // cfg.kv_heads)[1]
            return varlen_attention(q, self.cache_k, self.cache_v, table, out)
        q, k, v = qkv.split([cfg.heads * d, cfg.kv_heads * d, cfg.kv_heads * d], dim=-1)
        cos, sin = rope[0][index.positions], rope[1][index.positions]
        q, k = rotate(q.reshape(t, cfg.heads, d), cos, sin), rotate(k.reshape(t, cfg.kv_heads, d), cos, sin)
        attn = attend(q, k, v.reshape(t, cfg.kv_heads, d), self.cache_k, self.cache_v, layout)
        return attn if out is None else out.copy_(attn)

    def _norm_then(self, linear, x, delta, norm, lora, scratch, fused, pdl):
        """(linear(rmsnorm(x + delta)), x + delta): the norm computes the linear's shrink too where it can."""
        if fused and linear.shrinks_in_producer(lora, x.shape[0]):
            slices = len(linear.slice_starts) - 1
            a, h, meta, launch, scale, rank = linear.shrink_args(lora, scratch)
            normed, x = producer_shrink.add_rmsnorm_shrink(x, delta, norm, self.cfg.norm_eps, a, h, meta, launch, scale,
                                                           rank, slices, pdl)
            return linear(normed, lora, scratch, shrunk=True), x
        normed, x = add_rmsnorm(x, delta, norm, self.cfg.norm_eps, fused, pdl, out=linear.input_view(lora, x.shape[0]))
        return linear(normed, lora, scratch), x


class LlamaLoRA(nn.Module):
    """The decoder. ``forward(input_ids[T], positions[T], lora)`` returns logits [T, vocab];
    ``lora=None`` runs the base model with no LoRA kernels at all (the n = 0 graph)."""

    def __init__(self, cfg: ModelConfig, *, max_loras, rank, max_tokens, context_len, dtype, device, seed=0,
                 slot_ranks: tuple[int, ...] = (), fully_sharded: bool = False, cache_rows: int | None = None,
                 extended: bool = False):
        """slot_ranks: each slot's adapter's own rank, its weights zero-padded to ``rank`` as vLLM
        pads them (empty: every adapter of rank ``rank``); ``slot_rank`` holds them on the device
        for kernels that skip the padding. fully_sharded: a TP rank's LoRA cut as vLLM's
        ``--fully-sharded-loras`` cuts it (``models.lora_shares``); its collectives are left out.
        cache_rows: the KV cache's requests (default ``max_tokens``: a decode step's token t reads
        row t); fewer where steps hold prefill chunks of many tokens from few requests.
        extended: hold each LoRA linear whose tail fits as [W | B's tail] (``LoRALinear.extend``),
        for a backend that runs the extended GEMM (``EXTENDS_K``); each step copies its launched slots' B there."""
        super().__init__()
        gen = torch.Generator(device=device).manual_seed(seed)
        self.cfg, self.max_tokens, self.context_len = cfg, max_tokens, context_len
        self.cache_rows = max_tokens if cache_rows is None else cache_rows
        self.embed = nn.Parameter(_randn((cfg.vocab, cfg.hidden), 1.0, dtype, device, gen), False)
        experts = expert_weights(cfg, dtype, device, gen) if cfg.moe is not None and cfg.moe.shared_weights else None
        self.layers = nn.ModuleList(
            Block(cfg, i, max_loras, rank, max_tokens, context_len, dtype, device, gen, fully_sharded, self.cache_rows,
                  experts)
            for i in range(cfg.layers)
        )
        self.norm = nn.Parameter(torch.ones(cfg.hidden, dtype=dtype, device=device), False)
        self.fused = torch.device(device).type == "cuda"  # fused Triton ops on the GPU, torch twins elsewhere
        self.lm_head = nn.Parameter(_randn((cfg.vocab, cfg.hidden), cfg.hidden**-0.5, dtype, device, gen), False)
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim)
        angles = torch.outer(torch.arange(context_len, device=device).float(), inv_freq)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        # One float32 shrink-output slab per LoRA linear, zeroed once per step (split-K atomics).
        widest = MAX_SLICES * rank
        shape = (cfg.layers, LORA_LINEARS_PER_LAYER, max_tokens, widest)
        self.register_buffer("scratch", torch.zeros(shape, dtype=torch.float32, device=device), persistent=False)
        own = list(slot_ranks) or [rank] * max_loras
        if len(own) != max_loras or not all(1 <= r <= rank for r in own):
            raise ValueError(f"slot ranks {own} must be {max_loras} ranks of 1..{rank}")
        self.register_buffer("slot_rank", torch.tensor(own, dtype=torch.int32, device=device), persistent=False)
        for m in self.modules():
            if isinstance(m, (LoRALinear, MoEMLP)):
                m.pad(own, rank)
        self.extended = [m for m in self.modules() if isinstance(m, LoRALinear) and m.extend()] if extended else []
        # Expert LoRA per layer and slot, each MoE layer's adapter_enabled as vLLM keeps it ([max_loras + 1],
        # the last unused): 0 where the slot's adapter has none on that layer's experts.
        enabled = None
        if cfg.moe is not None:
            enabled = torch.ones(cfg.layers, max_loras + 1, dtype=torch.int32, device=device)
            enabled[:, -1] = 0
        self.register_buffer("expert_lora_enabled", enabled, persistent=False)
        self.reuse_routing = False  # MoE layers replay the last step's routing (the check's reference)

    def forward(self, input_ids, positions, lora: LoRAStep | None = None, layout: MixedLayout | None = None):
        """layout: a mixed step (decode tokens and prefill chunks, ``mixed_attention``); positions
        then come from it (None)."""
        t = input_ids.shape[0]
        if layout is not None:
            if layout.tokens != t:
                raise ValueError(f"{t} tokens for a layout of {layout.tokens}")
            positions = index_of(layout, input_ids.device).positions
        x, out = self.first_piece(input_ids, lora)
        for i in range(len(self.layers)):
            attn = self.attention(i, out, positions, lora, layout)
            x, out = self.piece(i + 1, attn, x, lora)
        return self.logits(out)  # the last piece's output: the final hidden states

    # The step in pieces split at attention, as vLLM's PIECEWISE graphs split it: piece 0 runs up to
    # the first layer's attention, piece i (1..L-1) from layer i-1's attention to layer i's, piece L
    # from the last attention to the final norm. ``forward`` runs them with attention between, then
    # the logits of every token; a mixed step takes only its pieces' last tokens' (``logits``), as
    # vLLM samples them outside its graphs.
    def first_piece(self, input_ids, lora: LoRAStep | None):
        """Piece 0: the embedding and the first layer up to attention: (x, qkv)."""
        t = input_ids.shape[0]
        if lora is not None and lora.backend.NEEDS_ZEROED_SCRATCH:
            self.scratch[:, :, :t].zero_()
        qkv, x = self.layers[0].attention_input(self.embed[input_ids], None, lora, self.scratch[0], self.fused,
                                                self._pdl(lora, t))
        return x, qkv

    def attention(self, i: int, qkv, positions, lora: LoRAStep | None, layout: MixedLayout | None, out=None):
        """Layer i's attention, between pieces i and i + 1 (into ``out`` when given; else into o's
        extended input where the step takes o's extended GEMM)."""
        if out is None:
            out = self.layers[i].o.input_view(lora, qkv.shape[0])
        return self.layers[i].attention(qkv, positions, (self.rope_cos, self.rope_sin), self.fused,
                                        self._pdl(lora, qkv.shape[0]), layout, out)

    def piece(self, i: int, attn, x, lora: LoRAStep | None):
        """Piece i >= 1: layer i-1 from its attention's output on, then layer i up to attention:
        (x, qkv); the last piece (i = L) ends with the final norm instead: (x, hidden states)."""
        pdl, prev = self._pdl(lora, x.shape[0]), self.layers[i - 1]
        enabled = self.expert_lora_enabled
        moe_state = (None if enabled is None else enabled[i - 1], self.reuse_routing)
        x, delta = prev.after_attention(attn, x, lora, self.scratch[i - 1], self.fused, pdl, moe_state)
        if i < len(self.layers):
            qkv, x = self.layers[i].attention_input(x, delta, lora, self.scratch[i], self.fused, pdl)
            return x, qkv
        h, _ = add_rmsnorm(x, delta, self.norm, self.cfg.norm_eps, self.fused, pdl)
        return x, h

    def attention_buffer(self, tokens: int) -> torch.Tensor:
        """A zeroed [tokens, H D] buffer for attention's output: the first columns of o's extended
        input where the layers' o are extended (every layer's o has the same shape)."""
        o = self.layers[0].o
        width = o.weight.shape[1] if o.weight_ext is None else o.weight_ext.shape[1]
        buf = torch.zeros(tokens, width, dtype=self.embed.dtype, device=self.embed.device)
        return buf[:, :o.weight.shape[1]]

    def logits(self, h):
        """The logits of final hidden states [T, hidden]: [T, vocab]."""
        return F.linear(h, self.lm_head)

    @staticmethod
    def _pdl(lora: LoRAStep | None, tokens: int) -> bool:
        """Whether the base ops PDL-launch: under a backend whose kernels let them launch early, at
        the token counts its ``pdl_at`` allows, where it has one (``gemm``)."""
        if lora is None or not getattr(lora.backend, "LETS_CONSUMER_LAUNCH", False):
            return False
        pdl_at = getattr(lora.backend, "pdl_at", None)
        return pdl_at is None or pdl_at(tokens, lora.launch_count)

    def lora_bytes_per_slot(self) -> int:
        """One adapter's A and B over every LoRA linear and, in MoE layers, every expert."""
        dense = sum(m.lora_a[0].nbytes + m.lora_b[0].nbytes for m in self.modules() if isinstance(m, LoRALinear))
        return dense + self.expert_lora_bytes_per_slot()

    def lora_io_bytes_per_token(self) -> int:
        """What the dense LoRA linears move per adapter token besides their adapters, when LoRA runs
        beside the base GEMM: each one's input read once (the shrink) and its LoRA outputs read and
        written once (the expand adds into them)."""
        return sum((m.weight.shape[1] + 2 * m.lora_n) * m.weight.element_size()
                   for m in self.modules() if isinstance(m, LoRALinear))

    def expert_lora_bytes_per_slot(self) -> int:
        return sum(m.lora_bytes_per_slot() for m in self.modules() if isinstance(m, MoEMLP))
