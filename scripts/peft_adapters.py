"""A folder of PEFT LoRA adapters with random weights at a dense model's shapes, in PEFT's own
layout (``adapter_config.json``; ``adapter_model.safetensors`` holding
``base_model.model.model.layers.<i>.<module>.lora_A/B.weight``), for timing ``--adapters DIR``
where no real adapters are at hand: ranks and targets cycle over the lists given.

    python scripts/peft_adapters.py OUT --model llama-3.1-8b --count 64 --ranks 8,16,32,64 \\
        --targets all,attention [--dtype bfloat16] [--seed 0]

``all``: q, k, v, o, gate, up and down; ``attention``: q, k, v and o. Adapter i has rank
ranks[i % len(ranks)], targets targets[(i // len(ranks)) % len(targets)] and lora_alpha 2r.
Prints one line per adapter (its rank, targets and MiB) and the total.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from lorabench.config.models import resolve

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
TARGETS = {"all": (*ATTENTION, "gate_proj", "up_proj", "down_proj"), "attention": ATTENTION}


def shapes(model: str) -> tuple[int, dict[str, tuple[str, int, int]]]:
    """The model's layers, and per PEFT module its (parent, in features, out features)."""
    cfg = resolve(model)
    if cfg.moe is not None:
        raise SystemExit(f"{model}: a MoE model; this script writes dense adapters only")
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    h, i = cfg.hidden, cfg.intermediate
    return cfg.layers, {"q_proj": ("self_attn", h, q), "k_proj": ("self_attn", h, kv), "v_proj": ("self_attn", h, kv),
                        "o_proj": ("self_attn", q, h), "gate_proj": ("mlp", h, i), "up_proj": ("mlp", h, i),
                        "down_proj": ("mlp", i, h)}


def write_adapter(folder: Path, layers: int, modules: dict, targets: tuple[str, ...], rank: int, dtype: torch.dtype,
                  gen: torch.Generator, device: str) -> int:
    """One adapter folder; returns its weights' bytes."""
    tensors = {}
    for layer in range(layers):
        for t in targets:
            parent, k, n = modules[t]
            key = f"base_model.model.model.layers.{layer}.{parent}.{t}"
            a = torch.randn(rank, k, generator=gen, device=device) * k**-0.5
            b = torch.randn(n, rank, generator=gen, device=device) * 0.01
            tensors[f"{key}.lora_A.weight"] = a.to(dtype).cpu()
            tensors[f"{key}.lora_B.weight"] = b.to(dtype).cpu()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets), "bias": "none",
              "use_dora": False, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {}, "lora_dropout": 0.0,
              "task_type": "CAUSAL_LM"}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--count", type=int, default=4)
    p.add_argument("--ranks", default="16")
    p.add_argument("--targets", default="all")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    ranks = [int(r) for r in a.ranks.split(",")]
    targets = [TARGETS[t] for t in a.targets.split(",")]
    layers, modules = shapes(a.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(a.seed)
    total = 0
    for i in range(a.count):
        rank, chosen = ranks[i % len(ranks)], targets[(i // len(ranks)) % len(targets)]
        size = write_adapter(a.out / f"adapter-{i:03d}", layers, modules, chosen, rank, getattr(torch, a.dtype), gen,
                             device)
        total += size
        print(f"adapter-{i:03d}: rank {rank}, {len(chosen)} modules x {layers} layers, {size / 2**20:.1f} MiB")
    print(f"{a.count} adapters, {total / 2**30:.2f} GiB in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
