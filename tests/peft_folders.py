"""PEFT adapter folders for the tests, in PEFT's layout (``adapter_config.json``, and
``adapter_model.safetensors`` holding ``base_model.model.model.layers.<i>.<module>.lora_A/B.weight``),
written with safetensors, at the tiny presets' shapes unless told otherwise."""

import json

import numpy as np
from safetensors.numpy import save

PREFIX = "base_model.model.model.layers"
HIDDEN, Q, KV, INTER = 128, 128, 64, 256  # tiny: 4 heads of 32, 2 KV heads, intermediate 256
DENSE = {"q_proj": ("self_attn", HIDDEN, Q), "k_proj": ("self_attn", HIDDEN, KV), "v_proj": ("self_attn", HIDDEN, KV),
         "o_proj": ("self_attn", Q, HIDDEN), "gate_proj": ("mlp", HIDDEN, INTER), "up_proj": ("mlp", HIDDEN, INTER),
         "down_proj": ("mlp", INTER, HIDDEN)}


def pair(r: int, k: int, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    return (rng.standard_normal((r, k)).astype(np.float32) * k**-0.5,
            rng.standard_normal((n, r)).astype(np.float32) * r**-0.5)


def module_tensors(layer: int, path: str, r: int, k: int, n: int, rng) -> dict[str, np.ndarray]:
    a, b = pair(r, k, n, rng)
    return {f"{PREFIX}.{layer}.{path}.lora_A.weight": a, f"{PREFIX}.{layer}.{path}.lora_B.weight": b}


def adapter_files(name: str, r: int = 8, alpha: float = 16, targets=("q_proj", "v_proj"), layers=(0, 1),
                  tensors: dict | None = None, config: dict | None = None, seed: int = 0) -> dict[str, str | bytes]:
    """One adapter folder's files (under ``name/``): ``targets`` of the dense modules in each of
    ``layers`` at rank ``r``, plus ``tensors`` (name -> array) as they are; ``config`` overrides
    adapter_config.json's settings."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for i in layers:
        for t in targets:
            where, k, n = DENSE[t]
            out |= module_tensors(i, f"{where}.{t}", r, k, n, rng)
    out |= tensors or {}
    settings = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
                "use_dora": False, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {}} | (config or {})
    return {f"{name}/adapter_config.json": json.dumps(settings), f"{name}/adapter_model.safetensors": save(out)}


def write(root, files: dict) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
