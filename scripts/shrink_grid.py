"""Every shrink config of a small grid, timed the way `lorabench tune` times them. (GPU only.)

    python scripts/shrink_grid.py [--json OUT.json]

The evidence for ``triton_lora.shrink_config``'s default: for each Llama-2-7B shrink shape at the
decode buckets (tokens 1 and 8 with 1 or 4 launched slots, tokens 32 with 32), the default and
every block_k x split_k x num_warps x num_stages of the grid (block_m and block_n as the default's)
run once against the default's output, then 20 launches per CUDA graph are timed over 100 replays
(``lorabench.commands.tune.search.time_cuda``, PDL off as the tune runs). It prints each shape's default against its best.
"""

import argparse
import itertools
import json
import os
from dataclasses import asdict

import torch
from lorabench.kernels import triton_lora

from lorabench.commands.tune.backends import TritonPair
from lorabench.commands.tune.search import measure, time_cuda
from lorabench.commands.tune.shapes import build_shapes, too_big
from lorabench.config.tolerance import TOLERANCE
from lorabench.config.tune_spec import TuneSpec

GRID = {"block_k": [64, 128, 256], "split_k": [8, 16, 32, 64], "num_warps": [2, 4, 8], "num_stages": [2, 3]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write every timed config here")
    args = ap.parse_args()
    os.environ["LORABENCH_PDL"] = "0"  # read per launch: isolated launches, as the tune times them
    spec = TuneSpec(kernels=["triton"], model="llama-2-7b", rank=16, dtype="float16", max_loras=[4, 32],
                    tokens=[1, 8, 32], budget_s=0, out="", device="cuda")
    backend, tol = TritonPair(), TOLERANCE["float16"].kernel
    shapes = [s for s in build_shapes(spec, {"triton": backend})
              if s.op == "shrink" and (s.tokens < 32 and s.active <= 4 or s.active == 32)]
    rows = []
    print(f"{'shape':<36} {'default (bk, sk, warps, stages)':<32} {'us':>6} {'best':>6} {'default/best':>12}")
    for s in shapes:
        problem = backend.problem(s, 16, torch.float16, "cuda", 0)
        default = asdict(triton_lora.default_config(*s.key))
        result, ref = measure(backend, problem, default, None, tol, time_cuda)
        rows.append({"shape": list(s.key), "linear": s.linear, "config": default, "default": True, **result})
        for values in itertools.product(*GRID.values()):
            cfg = {**default, **dict(zip(GRID, values))}
            if cfg == default or too_big(s, cfg) or backend.waste(s, cfg, 16, 2, True, default):
                continue
            r, _ = measure(backend, problem, cfg, ref, tol, time_cuda)
            rows.append({"shape": list(s.key), "linear": s.linear, "config": cfg, "default": False, **r})
        ok = [r["us"] for r in rows if r["shape"] == list(s.key) and r["status"] == "ok"]
        d = tuple(default[k] for k in GRID)
        print(f"{str(s.key):<36} {str(d):<32} {result['us']:6.2f} {min(ok):6.2f} {result['us'] / min(ok):11.2f}x", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f)


if __name__ == "__main__":
    main()
