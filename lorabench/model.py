"""A compact Llama-style decoder for decode steps, with LoRA on q, k, v, o, gate, up and down.

One forward = one decode step: ``T`` tokens, one per request, each attending over its own static
KV cache of ``context_len`` positions. Weights are random, created on the device (the benchmark
needs shapes and bytes, not a checkpoint). LoRA linears are fused the way servers fuse them:
qkv (3 slices), o (1), gate_up (2), down (1), each one shrink + expand per step.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lorabench.kernels import MAX_SLICES, LoRAMeta


@dataclass(frozen=True)
class ModelConfig:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


PRESETS = {
    "llama-2-7b": ModelConfig("llama-2-7b", 32, 4096, 32, 32, 11008, 32000),
    "llama-3-8b": ModelConfig("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, rope_theta=500000.0),
    "tiny": ModelConfig("tiny", 2, 128, 4, 2, 256, 512),
}


@dataclass(frozen=True)
class LoRAStep:
    """What one forward needs to apply LoRA: the backend, the batch metadata, the launch count."""

    backend: object  # a kernels backend module: lora_apply, NEEDS_ZEROED_SCRATCH
    meta: LoRAMeta
    launch_count: int
    scale: float


def _randn(shape, std, dtype, device, gen):
    return (torch.randn(shape, device=device, dtype=torch.float32, generator=gen) * std).to(dtype)


class LoRALinear(nn.Module):
    """A fused linear (output = slices side by side) with ``max_loras`` resident adapter slots."""

    def __init__(self, in_features, slice_sizes, max_loras, rank, dtype, device, gen):
        super().__init__()
        n = sum(slice_sizes)
        self.slice_starts = tuple(sum(slice_sizes[:i]) for i in range(len(slice_sizes) + 1))
        self.weight = nn.Parameter(_randn((n, in_features), in_features**-0.5, dtype, device, gen), False)
        a_shape = (max_loras, len(slice_sizes) * rank, in_features)
        self.lora_a = nn.Parameter(_randn(a_shape, in_features**-0.5, dtype, device, gen), False)
        self.lora_b = nn.Parameter(_randn((max_loras, n, rank), rank**-0.5, dtype, device, gen), False)

    def forward(self, x, lora: LoRAStep | None, scratch: torch.Tensor):
        y = F.linear(x, self.weight)
        if lora is not None:
            lora.backend.lora_apply(
                y, x, self.lora_a, self.lora_b, self.slice_starts, lora.meta, lora.launch_count, lora.scale, scratch
            )
        return y


class RMSNorm(nn.Module):
    def __init__(self, dim, eps, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), False)

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def apply_rope(x, cos, sin):
    """Rotary embedding, rotate-half form. x: [T, H, D]; cos, sin: [T, D/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, max_loras, rank, max_tokens, context_len, dtype, device, gen):
        super().__init__()
        h, d, kvh = cfg.heads, cfg.head_dim, cfg.kv_heads
        args = (max_loras, rank, dtype, device, gen)
        self.cfg = cfg
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps, dtype, device)
        self.qkv = LoRALinear(cfg.hidden, (h * d, kvh * d, kvh * d), *args)
        self.o = LoRALinear(h * d, (cfg.hidden,), *args)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps, dtype, device)
        self.gate_up = LoRALinear(cfg.hidden, (cfg.intermediate, cfg.intermediate), *args)
        self.down = LoRALinear(cfg.intermediate, (cfg.hidden,), *args)
        # Static KV cache; random, not zero, so attention reads real-looking data.
        cache_shape = (max_tokens, kvh, context_len, d)
        self.register_buffer("cache_k", _randn(cache_shape, 1.0, dtype, device, gen), persistent=False)
        self.register_buffer("cache_v", _randn(cache_shape, 1.0, dtype, device, gen), persistent=False)

    def forward(self, x, token_idx, pos, cos, sin, lora, scratch):
        cfg, t = self.cfg, x.shape[0]
        q_size, kv_size = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        q, k, v = self.qkv(self.attn_norm(x), lora, scratch[0]).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rope(q.view(t, cfg.heads, cfg.head_dim), cos, sin)
        k = apply_rope(k.view(t, cfg.kv_heads, cfg.head_dim), cos, sin)
        self.cache_k[token_idx, :, pos] = k
        self.cache_v[token_idx, :, pos] = v.view(t, cfg.kv_heads, cfg.head_dim)
        attn = F.scaled_dot_product_attention(
            q.unsqueeze(2), self.cache_k[:t], self.cache_v[:t], enable_gqa=cfg.heads != cfg.kv_heads
        )
        x = x + self.o(attn.reshape(t, q_size), lora, scratch[1])
        gate, up = self.gate_up(self.mlp_norm(x), lora, scratch[2]).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up, lora, scratch[3])


class LlamaLoRA(nn.Module):
    """The decoder. ``forward(input_ids[T], positions[T], lora)`` returns logits [T, vocab];
    ``lora=None`` runs the base model with no LoRA kernels at all (the n = 0 graph)."""

    LORA_LINEARS_PER_LAYER = 4

    def __init__(self, cfg: ModelConfig, *, max_loras, rank, max_tokens, context_len, dtype, device, seed=0):
        super().__init__()
        gen = torch.Generator(device=device).manual_seed(seed)
        self.cfg, self.max_tokens, self.context_len = cfg, max_tokens, context_len
        self.embed = nn.Parameter(_randn((cfg.vocab, cfg.hidden), 1.0, dtype, device, gen), False)
        self.layers = nn.ModuleList(
            Block(cfg, max_loras, rank, max_tokens, context_len, dtype, device, gen) for _ in range(cfg.layers)
        )
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps, dtype, device)
        self.lm_head = nn.Parameter(_randn((cfg.vocab, cfg.hidden), cfg.hidden**-0.5, dtype, device, gen), False)
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim)
        angles = torch.outer(torch.arange(context_len, device=device).float(), inv_freq)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self.register_buffer("token_idx", torch.arange(max_tokens, device=device), persistent=False)
        # One float32 shrink-output slab per LoRA linear, zeroed once per step (split-K atomics).
        widest = MAX_SLICES * rank
        shape = (cfg.layers, self.LORA_LINEARS_PER_LAYER, max_tokens, widest)
        self.register_buffer("scratch", torch.zeros(shape, dtype=torch.float32, device=device), persistent=False)

    def forward(self, input_ids, positions, lora: LoRAStep | None = None):
        t = input_ids.shape[0]
        if lora is not None and lora.backend.NEEDS_ZEROED_SCRATCH:
            self.scratch[:, :, :t].zero_()
        x = self.embed[input_ids]
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for i, layer in enumerate(self.layers):
            x = layer(x, self.token_idx[:t], positions, cos, sin, lora, self.scratch[i])
        return F.linear(self.norm(x), self.lm_head)

    def lora_bytes_per_slot(self) -> int:
        return sum(m.lora_a[0].nbytes + m.lora_b[0].nbytes for m in self.modules() if isinstance(m, LoRALinear))
