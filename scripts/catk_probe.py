"""Probe: LoRA's expand as extra K columns of the base cuBLAS GEMM. (GPU only.)

    python scripts/catk_probe.py [--models llama-2-7b] [--tokens 1,8,32,64,2048,8192] [--slots 4,16,32]
                                 [--linears qkv,o,gate_up,down]

y = [x | hm] · [W | B_0 … B_{L-1}]ᵀ: hm holds each token's h in its slot's R columns, zero
elsewhere, so one cuBLAS GEMM computes the base product and every token's expand. Per linear and
token count: cuBLAS on W alone (contiguous), on W as the leading K columns of the widest extended
weight (the n = 0 graph's GEMM), on the extended GEMM at L slots (each its own weight of whole rows:
K + L·R, without the slices' zero blocks the model's qkv and gate_up hold), and the pair (cuBLAS +
shrink + expand, one adapter at 4 slots). Each graph holds REPEAT GEMMs over COPIES weight copies
(more than the L2). An earlier version sliced one weight to each K (rows wider than K): cuBLAS hit
an illegal address there at 8192 tokens on Llama-3.1-8B's down (K 14400 of rows 14592).
"""

import argparse
import random

import numpy as np
import torch
from lorabench.kernels import triton_lora

from lorabench.config.batches import fixed_batch
from lorabench.config.models import lora_linears, resolve
from lorabench.runtime.graphs import capture_graph
from lorabench.runtime.lora_meta import MetaBuffer
from lorabench.runtime.timing import alternating_replays

REPEAT, COPIES, REPLAYS, RANK = 16, 4, 30, 16  # as scripts/gemm_bench.py's
DTYPE = torch.bfloat16


def probe(name, k, slices, tokens, slot_counts) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    n = sum(slices)
    x = torch.randn(tokens, k, device=dev, dtype=DTYPE, generator=gen)
    w = [torch.randn(n, k, device=dev, dtype=DTYPE, generator=gen) * k**-0.5 for _ in range(COPIES)]
    y = torch.empty(tokens, n, device=dev, dtype=DTYPE)
    graphs = {}

    def loop(fn):
        def run():
            for i in range(REPEAT):
                fn(i % COPIES)
        return capture_graph(run)

    graphs["cublas"] = loop(lambda c: torch.matmul(x, w[c].t(), out=y))
    for slots in slot_counts:  # each its own weight of whole rows, as the model holds it
        ke = k + slots * RANK
        w_ext = [torch.cat([wc, torch.randn(n, ke - k, device=dev, dtype=DTYPE, generator=gen) * k**-0.5], 1)
                 for wc in w]
        xe = torch.cat([x, torch.randn(tokens, ke - k, device=dev, dtype=DTYPE, generator=gen)], 1)
        if slots == max(slot_counts):  # W read as the first K columns of the widest rows (a step with no adapter)
            graphs["view"] = loop(lambda c, w_ext=w_ext: torch.matmul(x, w_ext[c][:, :k].t(), out=y))
        graphs[f"cat{slots}"] = loop(lambda c, xe=xe, w_ext=w_ext: torch.matmul(xe, w_ext[c].t(), out=y))
    # the pair at 4 slots, one adapter
    starts = tuple(int(v) for v in np.cumsum((0,) + tuple(slices)))
    a = torch.randn(4, len(slices) * RANK, k, device=dev, dtype=DTYPE, generator=gen) * k**-0.5
    b = torch.randn(4, n, RANK, device=dev, dtype=DTYPE, generator=gen) * RANK**-0.5
    scratch = torch.zeros(REPEAT, tokens, len(slices) * RANK, device=dev, dtype=torch.float32)
    meta = MetaBuffer(tokens, 4, dev)
    meta.load(meta.pack(fixed_batch(tokens, 1, 4, random.Random(0)))[0])

    def pair():
        scratch.zero_()
        for i in range(REPEAT):
            torch.matmul(x, w[i % COPIES].t(), out=y)
            triton_lora.lora_apply(y, x, a, b, starts, meta.meta, 1, 0.5, scratch[i])

    graphs["pair4x1"] = capture_graph(pair)
    res = {key: float(np.median(t)) * 1000 / REPEAT for key, t in alternating_replays(graphs, REPLAYS).items()}
    base = res["cublas"]
    out = {"linear": name, "k": k, "n": n, "tokens": tokens, "cublas_us": base}
    out.update({f"{key}_over_us": v - base for key, v in res.items() if key != "cublas"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-2-7b")
    ap.add_argument("--tokens", default="1,8,32,64,2048,8192")
    ap.add_argument("--slots", default="4,16,32")
    ap.add_argument("--linears", default="qkv,o,gate_up,down")
    args = ap.parse_args()
    slot_counts = [int(s) for s in args.slots.split(",")]
    for model in args.models.split(","):
        cfg = resolve(model, None)
        for tokens in [int(t) for t in args.tokens.split(",")]:
            total = {}
            for name, (k, slices) in lora_linears(cfg).items():
                if name not in args.linears.split(","):
                    continue
                r = probe(name, k, slices, tokens, slot_counts)
                print(model, {kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in r.items()}, flush=True)
                for kk, v in r.items():
                    if kk.endswith("_us"):
                        total[kk] = total.get(kk, 0.0) + v * cfg.layers / 1000
            print(f"== {model} tokens={tokens} per step (ms, x{cfg.layers} layers): "
                  + ", ".join(f"{kk[:-3]} {v:.3f}" for kk, v in total.items()), flush=True)


if __name__ == "__main__":
    main()
