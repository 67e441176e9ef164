"""Model shapes: the presets a sweep can build, and the LoRA linears of one layer.

Weights are random (the benchmark needs shapes and bytes, not a checkpoint), so a model is its
shapes. LoRA sits on q, k, v, o, gate, up and down, fused the way servers fuse them: qkv (3
slices), o (1), gate_up (2), down (1), each one shrink + expand (or one fused kernel) per step.
"""

from dataclasses import dataclass, replace


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

LORA_LINEARS = ("qkv", "o", "gate_up", "down")  # per layer, in the order a step runs them
LORA_LINEARS_PER_LAYER = len(LORA_LINEARS)


def preset(name: str, layers: int | None = None) -> ModelConfig:
    """A preset's shapes, optionally shortened to ``layers`` layers."""
    cfg = PRESETS[name]
    return replace(cfg, layers=layers) if layers else cfg


def lora_linears(cfg: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each LoRA linear of a layer: (input features K, output slice widths)."""
    d = cfg.head_dim
    return {"qkv": (cfg.hidden, (cfg.heads * d, cfg.kv_heads * d, cfg.kv_heads * d)), "o": (cfg.heads * d, (cfg.hidden,)),
            "gate_up": (cfg.hidden, (cfg.intermediate, cfg.intermediate)), "down": (cfg.intermediate, (cfg.hidden,))}
