"""Bench: down's shrink fused into SiLU·mul at prompt sizes (``kernels/prompt_shrink.py``) against
SiLU·mul then the separate shrink, and the separate shrink's tilings after the op that feeds it
(qkv, gate_up: the norm; o: none), per linear, side by side. (GPU only.)

    python scripts/prompt_shrink_bench.py [--model llama-3.1-8b] [--tokens 2048,8192] [--active 1,4] [--grid] [--row-pad 8]

Each variant is a CUDA graph of REPEAT calls over COPIES input copies (more than the L2), timed as
the median of alternating replays (``alternating_replays``). Rows: the base op alone (its floor),
the base op then ``lora_shrink`` in its default tiling (as the ``gemm`` backend runs it) and, with
``--grid``, in every tiling of a small grid; for down, the fused kernel in its default config and
the grid's. Every variant is printed, fastest first, then the defaults again. The batch is the
step's prompts in a row, n adapters over 4 slots (one prompt each), bf16, rank 16. The producers
write into the first K columns of rows as wide as the model's extended input (K + ``tail_width``),
which the separate shrink then reads. ``--row-pad P`` widens those rows by P columns: the logs in
results/gemm/prompt-shrink-h100 ran with 8 more (and o's input in rows of K), a stride of 8 modulo
16 elements, which Triton cannot prove aligned: the shrink then loads x two bytes at a time (it
vectorises loads only on strides it specialises as divisible by 16).
"""

import argparse
import itertools

import numpy as np
import torch

from lorabench.config.models import lora_linears, resolve
from lorabench.kernels import prompt_shrink, tail_width
from lorabench.kernels.base_ops import add_rmsnorm, silu_mul
from lorabench.kernels.lora_configs import ShrinkConfig, shrink_config
from lorabench.kernels.prompt_shrink import PromptShrinkConfig, default_config
from lorabench.kernels.shrink import lora_shrink
from lorabench.runtime.graphs import capture_graph
from lorabench.runtime.lora_meta import MetaBuffer
from lorabench.runtime.timing import alternating_replays

REPEAT, COPIES, TURNS, RANK, SLOTS = 8, 4, 30, 16, 4
DTYPE = torch.bfloat16


def shrink_grid(tokens: int, k: int, n: int) -> list[ShrinkConfig]:
    block_n = shrink_config(tokens, k, n).block_n
    return [ShrinkConfig(bm, block_n, bk, sk, 4, st) for bm, bk, sk, st in
            itertools.product([32, 64], [64, 128, 256], [1, 2, 4, 8, 16], [3])]


def fused_grid() -> list[PromptShrinkConfig]:
    return [PromptShrinkConfig(16, ch, p) for ch, p in itertools.product([128, 256], [1, 2, 4, 8])]


def bench(name: str, k: int, slices: int, tokens: int, active: int, search: bool,
          row_pad: int = 0) -> list[tuple[str, float]]:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = slices * RANK
    width = k + tail_width(slices, SLOTS, RANK) + row_pad  # the extended input's row, as the model's (row_pad 0)
    # the producers' inputs: down's gate_up output, the norms' residual and delta (o's input is ext itself)
    src = [torch.randn(tokens, 2 * k if name == "down" else k, device=dev, dtype=DTYPE, generator=gen)
           for _ in range(COPIES if name != "o" else 0)]
    delta = [torch.randn(tokens, k, device=dev, dtype=DTYPE, generator=gen)
             for _ in range(COPIES if name in ("qkv", "gate_up") else 0)]
    w = torch.ones(k, device=dev, dtype=DTYPE)
    ext = [torch.randn(tokens, width, device=dev, dtype=DTYPE, generator=gen) for _ in range(COPIES)]
    a = torch.randn(SLOTS, rows, k, device=dev, dtype=DTYPE, generator=gen) * k**-0.5
    h = torch.zeros(tokens, rows, device=dev, dtype=torch.float32)
    meta = MetaBuffer(tokens, SLOTS, dev)
    per = -(-tokens // active)  # one prompt per adapter, in a row
    meta.load(meta.pack([min(t // per, active - 1) for t in range(tokens)])[0])

    def base(c):
        if name == "down":
            return silu_mul(src[c], out=ext[c][:, :k])
        if name == "o":  # attention's output, already in o's extended rows
            return ext[c][:, :k]
        return add_rmsnorm(src[c], delta[c], w, 1e-5, out=ext[c][:, :k])[0]

    def loop(fn):
        fn(0)  # compile outside the capture
        return capture_graph(lambda: [fn(i % COPIES) for i in range(REPEAT)])

    def then_shrink(cfg):
        return loop(lambda c: lora_shrink(base(c), a, h, meta.meta, active, 0.5, cfg, RANK, slices, pdl=False))

    graphs = {"base op": loop(base), f"+ shrink {shrink_config(tokens, k, rows)} (default)": then_shrink(None)}
    for cfg in shrink_grid(tokens, k, rows) if search else []:
        graphs[f"+ shrink {cfg}"] = then_shrink(cfg)
    if name == "down":
        default = default_config(tokens, k)
        for cfg in [default] + (fused_grid() if search else []):
            graphs[f"fused {cfg}{' (default)' if cfg == default else ''}"] = loop(
                lambda c, cfg=cfg: prompt_shrink.silu_mul_shrink(src[c], a, h, meta.meta, active, 0.5, RANK,
                                                                 out=ext[c][:, :k], config=cfg))
    times = alternating_replays(graphs, TURNS)
    return [(key, float(np.median(t)) * 1000 / REPEAT) for key, t in times.items()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--active", default="1,4")
    ap.add_argument("--linears", default="qkv,o,gate_up,down")
    ap.add_argument("--grid", action="store_true", help="every config of the small grid, not only the default")
    ap.add_argument("--row-pad", type=int, default=0, help="columns added to the model's extended row (8: the earlier logs' rows of qkv, gate_up, down)")
    args = ap.parse_args()
    cfg = resolve(args.model, None)
    print(torch.cuda.get_device_name(), args.model, "bf16 rank", RANK, "slots", SLOTS, "row pad", args.row_pad, flush=True)
    for tokens, active in itertools.product([int(t) for t in args.tokens.split(",")],
                                            [int(n) for n in args.active.split(",")]):
        for name, (k, slices) in lora_linears(cfg).items():
            if name not in args.linears.split(","):
                continue
            res = bench(name, k, len(slices), tokens, active, args.grid, args.row_pad)
            floor = res[0][1]
            print(f"== {name} K={k} tokens={tokens} n={active}: base op {floor:.1f} us", flush=True)
            for key, us in sorted(res[1:], key=lambda kv: kv[1]) + [kv for kv in res[1:] if "default" in kv[0]]:
                print(f"   {us:8.1f} us  (+{us - floor:.1f} over the op)  {key}", flush=True)


if __name__ == "__main__":
    main()
