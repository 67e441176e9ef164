"""What one LoRA linear adds after its base GEMM, per kernel design, on the GPU. (GPU only.)

    python scripts/linear_bench.py [--max-loras 4] [--points 1:1,8:4,8:1:4] [--variants triton,fused]
                                   [--tuned DIR] [--json OUT.json]

For each Llama-2-7B LoRA linear (qkv, o, gate_up, down) and each point (tokens : active adapters
[: launch count, by default the active count; more launched than active is what a graph captured
for more slots runs]), one CUDA graph holds ``REPEAT`` copies of "base GEMM, then the LoRA kernels",
the way a decode step runs them (the GEMM is the LoRA kernel's predecessor, which is what PDL overlaps).
Its replays are timed with CUDA events; the same graph without the LoRA kernels is the baseline,
measured alternately with it. Per-linear overhead = (with − without) / REPEAT, and the step
estimate sums the four linears × 32 layers. Variants: lorabench's ``triton`` pair and ``fused``
kernel, each with PDL on and off (``LORABENCH_PDL``), their ``+tuned`` configs with --tuned, and
``fused-v1`` (the previous fused kernel) when ``kernels/_fused_v1.py`` is present, and
``triton/split-4``: the pair with the shrink's earlier fixed 4-way split above 64 tokens, and
``triton/slot-columns`` and ``fused/slot-columns``: the earlier token tiles above one tile (a grid
column of the batch's tiles per launched slot, not the launched slots' tiles end to end).
The sweep (``lorabench sweep``) is what measures whole steps; this isolates one design choice.
"""

import argparse
import json
import os
import random
from unittest import mock

import numpy as np
import torch
from lorabench.kernels import fused_lora, lora_configs, tiles, triton_lora
from lorabench.kernels.launch import pow2_floor

from lorabench.config.batches import fixed_batch, parse_bench_points
from lorabench.config.models import lora_linears, resolve
from lorabench.runtime.graphs import capture_graph
from lorabench.runtime.lora_meta import MetaBuffer
from lorabench.runtime.timing import replay_ms
from lorabench.storage.tune_files import tuned_table

REPEAT, REPLAYS, RANK, LAYERS = 32, 40, 16, 32
TOLERANCE = 2e-2  # fp16 relative error against the reference, as tests/test_kernels.py


def split_4(fn):
    """``fn`` with the shrink's earlier split above decode sizes: K in 4 parts (at most one
    128-wide block each), whatever the token tiles (``lora_configs.prefill_split``)."""
    split = lambda tokens, k, n, block_m, block_n: min(4, pow2_floor(k // 128))  # noqa: E731
    return mock.patch.object(lora_configs, "prefill_split", split)(fn)


def slot_columns(fn):
    """``fn`` with the earlier token tiles above one tile (the shrink's, the expand's, the fused
    kernel's): a grid column of the batch's tiles per launched slot, instead of the launched slots'
    tiles end to end."""
    return mock.patch.object(tiles, "PACKED_TILES", False)(fn)


def variants(tuned: str | None) -> dict:
    """name -> (apply function, PDL on)."""
    v = {"triton": (triton_lora.lora_apply, True), "triton/no-pdl": (triton_lora.lora_apply, False),
         "triton/split-4": (split_4(triton_lora.lora_apply), True),
         "triton/slot-columns": (slot_columns(triton_lora.lora_apply), True),
         "fused": (fused_lora.lora_apply, True), "fused/no-pdl": (fused_lora.lora_apply, False),
         "fused/slot-columns": (slot_columns(fused_lora.lora_apply), True)}
    try:
        from lorabench.kernels import _fused_v1
        v["fused-v1"] = (_fused_v1.lora_apply, False)
    except ImportError:
        pass
    if tuned:
        table = tuned_table(tuned)
        triton_lora.load_tuned(table)
        fused_lora.load_tuned(table)
        saved = {"triton": dict(triton_lora.TUNED_CONFIGS), "fused": dict(fused_lora.TUNED_CONFIGS)}
        triton_lora.TUNED_CONFIGS.clear()
        fused_lora.TUNED_CONFIGS.clear()

        def with_table(module, name, fn):
            def apply(*args, **kw):
                module.TUNED_CONFIGS.update(saved[name])
                try:
                    fn(*args, **kw)
                finally:
                    module.TUNED_CONFIGS.clear()
            return apply

        v["triton+tuned"] = (with_table(triton_lora, "triton", triton_lora.lora_apply), True)
        v["fused+tuned"] = (with_table(fused_lora, "fused", fused_lora.lora_apply), True)
    return v


def time_pair(g_base, g_lora) -> tuple[list[float], list[float]]:
    """Alternating replays of both graphs, each timed with CUDA events (ms)."""
    for g in (g_base, g_lora) * 3:
        g.replay()
    base, lora = [], []
    for _ in range(REPLAYS):
        base.append(replay_ms(g_base))
        lora.append(replay_ms(g_lora))
    return base, lora


def bench_linear(name, k, slices, tokens, active, launch, max_loras, apply, pdl, seed=0) -> dict:
    dev, dt = torch.device("cuda"), torch.float16
    gen = torch.Generator(device=dev).manual_seed(seed)
    n = sum(slices)
    starts = tuple(int(v) for v in np.cumsum((0,) + tuple(slices)))
    x = torch.randn(tokens, k, device=dev, dtype=dt, generator=gen)
    w = torch.randn(n, k, device=dev, dtype=dt, generator=gen) * k**-0.5
    a = torch.randn(max_loras, len(slices) * RANK, k, device=dev, dtype=dt, generator=gen) * k**-0.5
    b = torch.randn(max_loras, n, RANK, device=dev, dtype=dt, generator=gen) * RANK**-0.5
    y = torch.empty(tokens, n, device=dev, dtype=dt)
    scratch = torch.zeros(REPEAT, tokens, len(slices) * RANK, device=dev, dtype=torch.float32)
    meta = MetaBuffer(tokens, max_loras, dev)
    slots = fixed_batch(tokens, active, max_loras, random.Random(seed))
    meta.load(meta.pack(slots)[0])
    os.environ["LORABENCH_PDL"] = "1" if pdl else "0"

    def base():
        for _ in range(REPEAT):
            torch.matmul(x, w.t(), out=y)

    def with_lora():
        scratch.zero_()  # as the model does, once per step
        for i in range(REPEAT):
            torch.matmul(x, w.t(), out=y)
            apply(y, x, a, b, starts, meta.meta, launch, 0.5, scratch[i])

    g_base, g_lora = capture_graph(base), capture_graph(with_lora)
    tb, tl = time_pair(g_base, g_lora)
    g_base.replay()  # correctness: the LoRA graph's y against the reference, for the last copy
    g_lora.replay()
    torch.cuda.synchronize()
    from lorabench.kernels.reference import lora_delta

    ref = (x @ w.t()).float() + lora_delta(x, a, b, starts, meta.meta.token_slot[:tokens], 0.5)
    err = ((y.float() - ref).norm() / ref.norm()).item()
    over = (np.median(tl) - np.median(tb)) * 1000 / REPEAT
    return {"linear": name, "tokens": tokens, "active": active, "launch": launch, "base_us": np.median(tb) * 1000 / REPEAT,
            "overhead_us": over, "spread_us": (np.percentile(tl, 90) - np.percentile(tl, 10)) * 1000 / REPEAT,
            "rel_err": err, "correct": err < TOLERANCE}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--points", default="1:1,8:4", help="tokens:active[:launch count] points")
    ap.add_argument("--variants", default=None, help="the variants to run (default: all)")
    ap.add_argument("--tuned", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        points = [(p.tokens, p.active, p.launch or p.active) for p in parse_bench_points(args.points, args.max_loras)]
    except ValueError as err:
        ap.error(str(err))
    chosen = variants(args.tuned)
    if args.variants:
        unknown = set(args.variants.split(",")) - set(chosen)
        if unknown:
            ap.error(f"unknown variants {sorted(unknown)}; known: {', '.join(chosen)}")
        chosen = {name: chosen[name] for name in args.variants.split(",")}
    rows = []
    print(f"{torch.cuda.get_device_name()}; per-linear LoRA overhead after the base GEMM, µs "
          f"(median of {REPLAYS} replays of {REPEAT} copies); step estimate = sum × {LAYERS} layers")
    for vname, (apply, pdl) in chosen.items():
        for tokens, active, launch in points:
            per = []
            for lname, (k, slices) in lora_linears(resolve("llama-2-7b")).items():
                r = bench_linear(lname, k, slices, tokens, active, launch, args.max_loras, apply, pdl)
                per.append(r)
                rows.append({"variant": vname, "max_loras": args.max_loras, **r})
            cells = "  ".join(f"{r['linear']} {r['overhead_us']:5.2f}±{r['spread_us']:.2f}" for r in per)
            worst = max(r["rel_err"] for r in per)
            step = sum(r["overhead_us"] for r in per) * LAYERS / 1000
            verdict = "" if worst < TOLERANCE else "  WRONG (timings of a wrong result)"
            print(f"{vname:15s} c={tokens:<3d} n={active:<3d} L={launch:<3d} {cells}  step≈{step:.3f} ms  max rel err {worst:.1e}{verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
