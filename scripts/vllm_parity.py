"""Does ``--kernels vllm`` time vLLM's kernels as vLLM's own ops time alone? (GPU only.)

    python scripts/vllm_parity.py [--model llama-2-7b] [--max-loras 4] [--json OUT.json]

Inside the harness: the decode-step graph of the vllm backend is replayed under torch.profiler
and every vLLM LoRA kernel is attributed, by launch order, to its (linear, op). Outside it: the
same shapes are run by calling ``vllm.lora.ops.triton_ops.lora_shrink`` / ``lora_expand``
directly, with their own ``LoRAKernelMeta`` and freshly made tensors in vLLM's layout, in the
order a decode step runs them: an L2 flush (a 256 MB read, for the rest of the step), a LoRA op
on other adapters (the previous linear's, which touches the same small metadata), the linear's
base GEMM, then the timed shrink and expand. A second variant drops the previous op and the
GEMM, which leaves the metadata and activations cold. Both sides are launched from CUDA graphs,
as vLLM launches them, and timed as CUPTI kernel durations, medians over steps; the script
prints them per shape and the largest difference.
"""

import argparse
import json
import random

import numpy as np
import torch
from lorabench.kernels import vllm_lora
from torch.profiler import ProfilerActivity, profile

from lorabench.config.batches import fixed_batch
from lorabench.config.models import resolve
from lorabench.config.strategies import strategy as strategy_named
from lorabench.runtime.dispatch import Dispatcher
from lorabench.runtime.model import LlamaLoRA
from lorabench.runtime.vllm_rules import VllmRules

LINEARS = ("qkv", "o", "gate_up", "down")
OPS = ("shrink", "expand")
STEPS = 20


def lora_kernels(prof) -> list:
    """vLLM's LoRA kernel records of a profile, in launch order: (name, microseconds)."""
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
           and ("_lora_shrink_kernel" in e.name or "_lora_expand_kernel" in e.name)]
    evs.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.elapsed_us()) for e in evs]


def in_harness(d: Dispatcher, slots: list[int], layers: int) -> dict:
    prep = d.prepare(slots)
    d.load(prep)
    for _ in range(3):
        d.run(prep.route)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            d.run(prep.route)
        torch.cuda.synchronize()
    ks = lora_kernels(prof)
    per_step = layers * len(LINEARS) * len(OPS)
    if len(ks) != STEPS * per_step:
        raise RuntimeError(f"expected {STEPS * per_step} LoRA kernels, profiled {len(ks)}")
    times = {(lin, op): [] for lin in LINEARS for op in OPS}
    for i, (name, us) in enumerate(ks):
        lin, op = LINEARS[(i // 2) % len(LINEARS)], OPS[i % 2]
        assert op in name, (i, name)
        times[(lin, op)].append(us)
    return {k: float(np.median(v)) for k, v in times.items()}, d.grid_of(prep.route)


def standalone(model: LlamaLoRA, slots: list[int], max_loras: int, specialize: bool, counts: list[int],
               before: str = "gemm") -> dict:
    """vLLM's ops called directly on the same shapes and batch, after an L2 flush; ``before="gemm"``
    adds what precedes them in a decode step (a previous LoRA op, the base GEMM)."""
    lora_shrink, lora_expand, kernel_meta_cls, _ = vllm_lora.load_ops()
    layer = model.layers[0]
    meta = kernel_meta_cls.make(max_loras, 64, "cuda", captured_lora_counts=counts)
    meta.prepare_tensors(torch.tensor(slots, dtype=torch.int32, device="cuda"))
    t = len(slots)
    args = meta.meta_args(t, specialize)
    flush_buf = torch.ones(128 * 2**20, dtype=torch.float16, device="cuda")
    flush_out = torch.empty((), dtype=torch.float32, device="cuda")
    out = {}
    for lin in LINEARS:
        m = getattr(layer, lin)
        k = m.weight.shape[1]
        rank = m.lora_b.shape[-1]
        slices = len(m.slice_starts) - 1
        # Fresh tensors in vLLM's own layout, made here, not the harness's copies.
        a = tuple(torch.randn(max_loras, 1, rank, k, device="cuda", dtype=torch.float16) / 64 for _ in range(slices))
        b = tuple(torch.randn(max_loras, 1, m.slice_starts[s + 1] - m.slice_starts[s], rank, device="cuda",
                              dtype=torch.float16) / 4 for s in range(slices))
        w = torch.randn_like(m.weight) / 64  # the base weight's shape, a different tensor
        x = torch.randn(t, k, device="cuda", dtype=torch.float16)
        y = torch.randn(t, m.slice_starts[-1], device="cuda", dtype=torch.float16)
        buf = torch.empty(slices, t, rank, dtype=torch.float32, device="cuda")
        for _ in range(3):
            lora_shrink(x, a, buf, *args, 1.0)
            lora_expand(buf, b, y, *args, offset_start=0, add_inputs=True)
        torch.cuda.synchronize()

        a_prev = tuple(torch.randn_like(t_) for t_ in a)  # stands for the previous linear's adapters

        def one_call_each():
            torch.sum(flush_buf, dim=0, dtype=torch.float32, out=flush_out)  # the rest of the step
            if before == "gemm":
                lora_shrink(x, a_prev, buf, *args, 1.0)  # the previous LoRA op: warms the metadata
                torch.matmul(x, w.t(), out=y)  # this linear's base GEMM
            lora_shrink(x, a, buf, *args, 1.0)
            lora_expand(buf, b, y, *args, offset_start=0, add_inputs=True)

        # Launched from a CUDA graph, as vLLM (and the harness) launch them.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            one_call_each()
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                graph.replay()
            torch.cuda.synchronize()
        ks = lora_kernels(prof)
        if before == "gemm":
            ks = [k for i, k in enumerate(ks) if i % 3]  # drop the stand-in previous op
        for op in OPS:
            out[(lin, op)] = float(np.median([us for name, us in ks if op in name]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-2-7b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = resolve(args.model, args.layers)
    m = args.max_loras
    model = LlamaLoRA(cfg, max_loras=m, rank=16, max_tokens=8, context_len=1024, dtype=torch.float16, device="cuda")
    results, worst = [], 0.0
    for strategy in ("max", "pow2"):
        rules = VllmRules(strategy_named(strategy), m, model.max_tokens, "cuda")
        d = Dispatcher(model, vllm_lora, max_loras=m, capture_sizes=[1, 8], counts=None, use_graphs=True, rules=rules)
        d.warm_up()
        d.capture()
        rng = random.Random(0)
        for c, n in [(1, 1), (8, min(4, m))]:
            slots = fixed_batch(c, n, m, rng)
            harness, grid = in_harness(d, slots, cfg.layers)
            alone = standalone(model, slots, m, rules.specialize, rules.counts)
            cold = standalone(model, slots, m, rules.specialize, rules.counts, before="flush")
            for key in harness:
                diff = harness[key] / alone[key] - 1
                worst = max(worst, abs(diff))
                results.append({"strategy": strategy, "c": c, "n": n, "grid": grid, "linear": key[0], "op": key[1],
                                "harness_us": round(harness[key], 2), "standalone_us": round(alone[key], 2),
                                "diff_pct": round(100 * diff, 2), "standalone_l2_flushed_us": round(cold[key], 2)})
            tot_h, tot_a = sum(harness.values()), sum(alone.values())
            print(f"vllm {strategy} max_loras={m} c={c} n={n} grid={grid}: LoRA kernels per layer {tot_h:.1f} us in the "
                  f"harness vs {tot_a:.1f} us alone ({100 * (tot_h / tot_a - 1):+.1f} %)")
            for r in results[-len(harness):]:
                print(f"  {r['linear']:>7} {r['op']:<6} harness {r['harness_us']:7.2f} us  alone {r['standalone_us']:7.2f} us"
                      f"  {r['diff_pct']:+6.2f} %   (alone, L2-flushed only: {r['standalone_l2_flushed_us']:7.2f} us)")
        del d
        torch.cuda.empty_cache()
    print(f"largest per-kernel difference: {100 * worst:.2f} % (target: within 5 %)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "vllm": vllm_lora.version(), "model": cfg.name,
                       "max_loras": m, "worst_abs_diff_pct": round(100 * worst, 2), "rows": results}, f, indent=2)


if __name__ == "__main__":
    main()
