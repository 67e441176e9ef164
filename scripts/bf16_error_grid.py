"""Worst error of the shrink + expand pair and of the fused kernel against an fp32 reference.

    python scripts/bf16_error_grid.py [--rank 16]                  # GPU: the whole grid
    TRITON_INTERPRET=1 python scripts/bf16_error_grid.py --quick   # CPU: a small subset

The grid follows vLLM's kernel tests: hidden sizes of real models divided by tensor parallelism,
each used as K (with N = 4096) and as N (with K = 4096); 1 to 3 slices of N columns each; 1, 4,
32 or 128 adapter slots; 1, 8, 64 or 512 tokens, about a quarter of them base-model tokens; bf16
and fp16; the kernels' default tilings (the fused kernel splits K in parts up to 64 tokens).
Inputs: x ~ N(0, 1), A ~ N(0, 1/K), B ~ N(0, 1), y ~ N(0, 1), scale 0.5. A case's error is
max |out - ref| / max(1, max |ref|), the tolerance table's kernel measure, where ref = y + the
LoRA update computed in fp32 from the same 16-bit inputs (kernels/reference.py).
"""

import argparse
import os
import random

import torch
from lorabench.kernels import fused_lora, triton_lora
from lorabench.kernels.reference import lora_delta

from lorabench.config.tolerance import TOLERANCE
from lorabench.runtime.lora_meta import MetaBuffer

HIDDEN = [2049, 4096, 5504, 8192, 13824, 14336, 18944]
GRID = {"shapes": sorted({(h, 4096) for h in HIDDEN} | {(4096, h) for h in HIDDEN}), "slices": [1, 2, 3],
        "slots": [1, 4, 32, 128], "tokens": [1, 8, 64, 512]}
QUICK = {"shapes": [(2049, 48), (8192, 48)], "slices": [1, 3], "slots": [4], "tokens": [8]}
DTYPES = [torch.bfloat16, torch.float16]
FLAG = 0.02  # the summary counts the cases above this


def errors(dtype, k, n, slices, slots, tokens, rank, device, seed):
    """One case: ({kernel: error}, the fused kernel's split_k, {kernel: norm error})."""
    g = torch.Generator(device=device).manual_seed(seed)
    rnd = random.Random(seed)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)

    x, y = randn(tokens, k), randn(tokens, slices * n)
    a, b = randn(slots, slices * rank, k, std=k**-0.5), randn(slots, slices * n, rank)
    starts = tuple(i * n for i in range(slices + 1))
    # token 0 is an adapter token, token 1 a base token, the rest a quarter base
    slot = [rnd.randrange(slots) if i == 0 or i > 1 and rnd.random() >= 0.25 else -1 for i in range(tokens)]
    buf = MetaBuffer(tokens, slots, device)
    packed, active = buf.pack(slot)
    buf.load(packed)
    ref = y.float() + lora_delta(x, a, b, starts, buf.meta.token_slot, 0.5)
    out = {}
    for name, apply in (("triton", triton_lora.lora_apply), ("fused", fused_lora.lora_apply)):
        out[name] = y.clone()
        scratch = torch.zeros(tokens, slices * rank, dtype=torch.float32, device=device)
        apply(out[name], x, a, b, starts, buf.meta, active, 0.5, scratch)
    big = ref.abs().max().clamp(min=1)
    split = fused_lora.config_for(tokens, k, n, rank, slices, active).split_k
    return ({m: ((o.float() - ref).abs().max() / big).item() for m, o in out.items()}, split,
            {m: ((o.float() - ref).norm() / ref.norm()).item() for m, o in out.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small subset (for the CPU interpreter)")
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("no GPU: run with TRITON_INTERPRET=1 (and --quick)")
    grid = QUICK if args.quick else GRID
    print(f"error = max|out - ref| / max(1, max|ref|), ref in fp32; worst over slices {grid['slices']}, slots "
          f"{grid['slots']}, tokens {grid['tokens']}; rank {args.rank}; "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu (interpreter)'}")
    print("triton: the shrink + expand pair; fused: the fused kernel; fused split_k: its K parts in those cases")
    print(f"{'dtype':<9} {'K':>6} {'N':>6} {'cases':>5} {'triton':>8} {'fused':>8}  fused split_k")
    worst = {}  # (dtype, kernel) -> [worst error, its case, cases above FLAG, cases, worst norm error]
    seed = 0
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        for k, n in grid["shapes"]:
            row, splits, cases = {"triton": 0.0, "fused": 0.0}, set(), 0
            for slices in grid["slices"]:
                for slots in grid["slots"]:
                    for tokens in grid["tokens"]:
                        seed += 1
                        errs, split, norms = errors(dtype, k, n, slices, slots, tokens, args.rank, device, seed)
                        splits.add(split)
                        cases += 1
                        for kernel, e in errs.items():
                            w = worst.setdefault((name, kernel), [0.0, None, 0, 0, 0.0])
                            if e > w[0]:
                                w[:2] = e, f"K={k} N={n} slices={slices} slots={slots} tokens={tokens}"
                            w[2] += e > FLAG
                            w[3] += 1
                            w[4] = max(w[4], norms[kernel])
                            row[kernel] = max(row[kernel], e)
            print(f"{name:<9} {k:>6} {n:>6} {cases:>5} {row['triton']:>8.4f} {row['fused']:>8.4f}  "
                  f"{','.join(map(str, sorted(splits)))}", flush=True)
    print(f"\nsummary (tolerance table: bfloat16 {TOLERANCE['bfloat16'].kernel}, float16 {TOLERANCE['float16'].kernel};"
          f" norm = worst |out - ref| / |ref| over the whole output)")
    for (name, kernel), (e, case, above, cases, norm) in worst.items():
        print(f"{name:<9} {kernel:<6}  worst {e:.4f} ({case}), {above} of {cases} cases above {FLAG}, norm {norm:.4f}")


if __name__ == "__main__":
    main()
