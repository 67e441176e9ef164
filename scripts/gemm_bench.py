"""The gemm backend's base GEMM against cuBLAS, and each LoRA linear's overhead per design. (GPU only.)

    python scripts/gemm_bench.py [--models llama-2-7b,llama-3.1-8b] [--tokens 1,8,16,32,64]
                                 [--prefill 512,2048,8192] [--grid 1,32,2048] [--points 4:1:1,4:8:4,32:32:8,32:32:32]
                                 [--json OUT.json]

Base: for each LoRA linear's shape (qkv, o, gate_up, down) and token count, one CUDA graph holds
``REPEAT`` GEMMs over ``COPIES`` weight copies in turn (more bytes than the L2 holds, so every GEMM
streams its weight from HBM, as in a step), timed with CUDA events against the same graph of
``torch.matmul`` (cuBLAS), the two replayed alternately. ``--grid`` also times a small grid of
tilings at those token counts (first model only) and reports the best. Each kernel's result is checked against torch.

Points (max_loras:tokens:active adapters, launched = active): per linear, the LoRA overhead of
``triton`` (cuBLAS, then lorabench's shrink + expand) and ``gemm`` (the shrink, then the GEMM with
the expand in its epilogue) — as configured, with its first epilogue step's h and B loaded before
the K loop (``gemm_early``) and after it (``gemm_late``; ``GemmConfig.preload``), with epilogue
steps twice as wide (``gemm_wide``), without PDL (``gemm_nopdl``) and with the gathered epilogue
(``gemm_gather``: each token its own slot's B, ``GemmConfig.gather``) —
each graph against the cuBLAS-only graph in the same loop, and the step estimate (the four linears
× the model's layers). Results are checked against the reference. ``gemm`` here is
``linear_apply`` itself, at any token count: in whole steps the backend runs it up to
``GEMM_MAX_TOKENS`` over at most ``EPILOGUE_MAX_LAUNCH`` launched slots only (the pair elsewhere), and without PDL from ``PDL_MAX_TOKENS`` on (where
``gemm_nopdl`` is ``gemm``).
"""

import argparse
import json
import os
import random
from dataclasses import replace

import numpy as np
import torch
from lorabench.kernels import gemm_configs, gemm_lora, triton_lora
from lorabench.kernels.reference import lora_delta

from lorabench.config.batches import fixed_batch
from lorabench.config.models import lora_linears, resolve
from lorabench.runtime.graphs import capture_graph
from lorabench.runtime.lora_meta import MetaBuffer
from lorabench.runtime.timing import alternating_replays

REPEAT, COPIES, REPLAYS, RANK = 16, 4, 30, 16
TOLERANCE = 2e-2
DTYPE = torch.bfloat16


def timed(graphs: dict) -> dict:
    """Median and 10–90 % spread (µs per GEMM) of alternating replays of each graph."""
    us = {name: t * 1000 / REPEAT for name, t in alternating_replays(graphs, REPLAYS).items()}
    return {name: (float(np.median(t)), float(np.percentile(t, 90) - np.percentile(t, 10))) for name, t in us.items()}


def rel(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def grid_configs(tokens: int) -> list:
    bm = gemm_configs.default_config(tokens, 4096, 4096).block_m
    if tokens > 64:
        return [gemm_configs.GemmConfig(m, n, k, w, s, g) for m, n in ((128, 128), (128, 256), (256, 128))
                for k in (64, 128) for w in (8,) for s in (3, 4) for g in (8,)]
    return [gemm_configs.GemmConfig(bm, n, k, w, s) for n in (16, 32, 64, 128) for k in (128, 256, 512)
            for w in (4, 8) for s in (3, 4, 5) if n * k <= 32768]


def bench_base(name, k, n, tokens, grid) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, k, device=dev, dtype=DTYPE, generator=gen)
    ws = [torch.randn(n, k, device=dev, dtype=DTYPE, generator=gen) * k**-0.5 for _ in range(COPIES)]
    y = torch.empty(tokens, n, device=dev, dtype=DTYPE)
    ref = (x.float() @ ws[-1].float().t())

    def cublas():
        for i in range(REPEAT):
            torch.matmul(x, ws[i % COPIES].t(), out=y)

    def triton_with(cfg):
        def run():
            for i in range(REPEAT):
                gemm_lora._launch(y, x, ws[i % COPIES], None, None, None, (0,), None, 0, cfg, False)
        return run

    default = gemm_configs.default_config(tokens, k, n)
    graphs = {"cublas": capture_graph(cublas), "default": capture_graph(triton_with(default))}
    errs = {"default": rel(y, ref)}
    res = timed(graphs)
    best = ("default", *res["default"])
    if grid:
        for cfg in grid_configs(tokens):
            if cfg == default:
                continue
            try:
                g = capture_graph(triton_with(cfg))
            except Exception as err:  # a tiling the compiler refuses (shared memory) is skipped
                print(f"  skip {cfg}: {type(err).__name__}")
                continue
            r = timed({"cublas": graphs["cublas"], "c": g})
            if rel(y, ref) > TOLERANCE:
                continue
            if r["c"][0] < best[1]:
                best = (cfg, *r["c"])
            del g
    return {"linear": name, "k": k, "n": n, "tokens": tokens, "cublas_us": res["cublas"][0],
            "cublas_spread_us": res["cublas"][1], "gemm_us": res["default"][0], "gemm_spread_us": res["default"][1],
            "gemm_vs_cublas": res["default"][0] / res["cublas"][0], "default": gemm_configs.config_dict(default),
            "best": gemm_configs.config_dict(best[0]) if best[0] != "default" else "default",
            "best_us": best[1], "best_vs_cublas": best[1] / res["cublas"][0], "rel_err": errs["default"],
            "bytes_floor_us": (n * k * 2) / 4.8e6}


def bench_lora(name, k, slices, max_loras, tokens, active, seed=0) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    n = sum(slices)
    starts = tuple(int(v) for v in np.cumsum((0,) + tuple(slices)))
    x = torch.randn(tokens, k, device=dev, dtype=DTYPE, generator=gen)
    ws = [torch.randn(n, k, device=dev, dtype=DTYPE, generator=gen) * k**-0.5 for _ in range(COPIES)]
    a = torch.randn(max_loras, len(slices) * RANK, k, device=dev, dtype=DTYPE, generator=gen) * k**-0.5
    b = torch.randn(max_loras, n, RANK, device=dev, dtype=DTYPE, generator=gen) * RANK**-0.5
    y = torch.empty(tokens, n, device=dev, dtype=DTYPE)
    scratch = torch.zeros(REPEAT, tokens, len(slices) * RANK, device=dev, dtype=torch.float32)
    meta = MetaBuffer(tokens, max_loras, dev)
    meta.load(meta.pack(fixed_batch(tokens, active, max_loras, random.Random(seed)))[0])
    out = {}

    def cublas():
        for i in range(REPEAT):
            torch.matmul(x, ws[i % COPIES].t(), out=y)

    def pair():
        scratch.zero_()
        for i in range(REPEAT):
            torch.matmul(x, ws[i % COPIES].t(), out=y)
            triton_lora.lora_apply(y, x, a, b, starts, meta.meta, active, 0.5, scratch[i])
        out["triton"] = y

    def gemm(preload=None, name="gemm", gather=False):
        cfg = replace(gemm_configs.config_for(tokens, k, n), gather=gather)  # the walk unless asked
        cfg = cfg if preload is None else replace(cfg, preload=preload)

        def run():
            scratch.zero_()
            for i in range(REPEAT):
                out[name] = gemm_lora.linear_apply(x, ws[i % COPIES], None, a, b, starts, meta.meta, active, 0.5, scratch[i],
                                                   config=cfg)
        return run

    graphs = {"cublas": capture_graph(cublas), "triton": capture_graph(pair), "gemm": capture_graph(gemm()),
              "gemm/early": capture_graph(gemm(True, "gemm/early")), "gemm/late": capture_graph(gemm(False, "gemm/late")),
              "gemm/gather": capture_graph(gemm(None, "gemm/gather", gather=True))}
    elements = gemm_lora.EPILOGUE_ELEMENTS
    gemm_lora.EPILOGUE_ELEMENTS = 2 * elements
    try:
        graphs["gemm/wide"] = capture_graph(gemm(None, "gemm/wide"))
    finally:
        gemm_lora.EPILOGUE_ELEMENTS = elements
    os.environ["LORABENCH_PDL"] = "0"
    try:
        graphs["gemm/no-pdl"] = capture_graph(gemm(None, "gemm/no-pdl"))
    finally:
        os.environ.pop("LORABENCH_PDL")
    res = timed(graphs)
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    w = ws[(REPEAT - 1) % COPIES]
    ref = (x.float() @ w.float().t()) + lora_delta(x, a, b, starts, meta.meta.token_slot[:tokens], 0.5)
    return {"linear": name, "max_loras": max_loras, "tokens": tokens, "active": active, "cublas_us": res["cublas"][0],
            "triton_over_us": res["triton"][0] - res["cublas"][0], "gemm_over_us": res["gemm"][0] - res["cublas"][0],
            "triton_spread_us": res["triton"][1], "gemm_spread_us": res["gemm"][1],
            "gemm_nopdl_over_us": res["gemm/no-pdl"][0] - res["cublas"][0],
            "gemm_early_over_us": res["gemm/early"][0] - res["cublas"][0],
            "gemm_late_over_us": res["gemm/late"][0] - res["cublas"][0],
            "gemm_wide_over_us": res["gemm/wide"][0] - res["cublas"][0],
            "gemm_gather_over_us": res["gemm/gather"][0] - res["cublas"][0],
            "triton_err": rel(out["triton"], ref),
            "gemm_err": max(rel(out[v], ref) for v in ("gemm", "gemm/early", "gemm/late", "gemm/wide", "gemm/no-pdl",
                                                       "gemm/gather"))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-2-7b,llama-3.1-8b")
    ap.add_argument("--tokens", default="1,8,16,32,64")
    ap.add_argument("--prefill", default="512,2048,8192")
    ap.add_argument("--grid", default="", help="token counts at which a grid of tilings is timed too (e.g. 1,32,2048)")
    ap.add_argument("--points", default="4:1:1,4:8:4,32:32:8,32:32:32", help="max_loras:tokens:active")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",") if t] + [int(t) for t in args.prefill.split(",") if t]
    grid = {int(t) for t in args.grid.split(",") if t}
    points = [tuple(int(v) for v in p.split(":")) for p in args.points.split(",") if p]
    rows = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "base": [], "lora": []}
    print(f"{rows['device']}; bf16; µs per GEMM, median of {REPLAYS} replays of {REPEAT} over {COPIES} weight copies")
    models = args.models.split(",")
    for model in models:
        cfg = resolve(model)
        for lname, (k, slices) in lora_linears(cfg).items():
            n = sum(slices)
            for t in tokens:
                try:
                    r = bench_base(lname, k, n, t, t in grid and model == models[0])
                except Exception as err:  # one line, and the next shape
                    print(f"{model:13s} {lname:8s} [{n}x{k}] M={t:<5d} failed: {type(err).__name__}: {str(err)[:160]}")
                    rows["base"].append({"model": model, "linear": lname, "k": k, "n": n, "tokens": t, "failed": str(err)})
                    continue
                rows["base"].append({"model": model, **r})
                best = "" if r["best"] == "default" else f"  best {r['best_us']:.2f} ({r['best_vs_cublas']:.3f}x) {r['best']}"
                print(f"{model:13s} {lname:8s} [{n}x{k}] M={t:<5d} cublas {r['cublas_us']:8.2f}  gemm {r['gemm_us']:8.2f} "
                      f"({r['gemm_vs_cublas']:.3f}x)  floor {r['bytes_floor_us']:.2f}  err {r['rel_err']:.1e}{best}", flush=True)
        for max_loras, t, active in points:
            per = [bench_lora(lname, k, slices, max_loras, t, active) for lname, (k, slices) in lora_linears(cfg).items()]
            rows["lora"].extend({"model": model, **r} for r in per)
            layers = cfg.layers
            variants = ("triton", "gemm", "gemm_early", "gemm_late", "gemm_wide", "gemm_nopdl", "gemm_gather")
            step = {v: sum(r[f"{v}_over_us"] for r in per) * layers / 1000 for v in variants}
            cells = "  ".join(f"{r['linear']} " + "/".join(f"{r[f'{v}_over_us']:.2f}" for v in variants) for r in per)
            worst = max(max(r["triton_err"], r["gemm_err"]) for r in per)
            steps = ", ".join(f"{v} {ms:.3f}" for v, ms in step.items())
            print(f"{model:13s} ({max_loras},{t},{active}) {'/'.join(variants)} µs: {cells}  step≈ ms: {steps}  "
                  f"max err {worst:.1e}{'  WRONG' if worst > TOLERANCE else ''}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
