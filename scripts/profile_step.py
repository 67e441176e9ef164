"""Where a decode step's time goes, on a GPU: the floor, graph replays, a kernel breakdown, host cost.

    python scripts/profile_step.py [--model llama-2-7b] [--layers 32] [--max-loras 4]

Prints: the device-to-device copy bandwidth (the ceiling the floor uses) and the step's byte
floor; graph replay medians at (c, n) with the stream synced per step and back to back; the top
kernels of an eager step by GPU time (torch.profiler); the host cost of building and loading the
batch metadata in a tight loop.
"""

import argparse
import random
import time

import numpy as np
import torch
from lorabench.kernels import get_backend
from torch.profiler import ProfilerActivity, profile

from lorabench.config.batches import fixed_batch
from lorabench.config.models import resolve
from lorabench.runtime.dispatch import Dispatcher
from lorabench.runtime.model import LlamaLoRA


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-2-7b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--kernels", default="triton")
    ap.add_argument("--at", default="8:4", help="c:n points whose eager step is profiled (launch count: n's power of two)")
    ap.add_argument("--rows", type=int, default=14, help="kernels listed per profile")
    args = ap.parse_args()
    cfg = resolve(args.model, args.layers)

    src = torch.randn(2**30, device="cuda", dtype=torch.float32)  # 4 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    bw = 2 * src.nbytes * 10 / (time.perf_counter() - t0)
    del src, dst
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s (read + write)")

    m = args.max_loras
    model = LlamaLoRA(cfg, max_loras=m, rank=16, max_tokens=8, context_len=1024, dtype=torch.float16, device="cuda")
    base_bytes = sum(p.nbytes for n, p in model.named_parameters() if "lora" not in n and n != "embed")
    print(f"{cfg.name} x{cfg.layers}: base weights read per step {base_bytes / 1e9:.2f} GB -> floor {base_bytes / bw * 1e3:.3f} ms"
          f"; LoRA bytes per slot {model.lora_bytes_per_slot() / 1e6:.1f} MB")
    d = Dispatcher(model, get_backend(args.kernels), max_loras=m, capture_sizes=[1, 8], counts=sorted({min(m, 1 << (i - 1).bit_length()) for i in range(1, m + 1)}), use_graphs=True)
    d.warm_up()
    d.capture()
    rng = random.Random(0)
    for c, n in [(1, 0), (1, 1), (8, 0), (8, 4)]:
        prep = d.prepare(fixed_batch(c, n, m, rng, base_tokens=c if n == 0 else 0))
        d.load(prep)
        synced, ev = [], [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(100)]
        for s, e in ev:
            s.record()
            d.run(prep.route)
            e.record()
            e.synchronize()
        synced = [s.elapsed_time(e) for s, e in ev]
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(100):
            d.run(prep.route)
        e.record()
        e.synchronize()
        print(f"c={c} n={n} launch={prep.route.launch}: synced median {np.median(synced):.3f} ms "
              f"(p10 {np.percentile(synced, 10):.3f}, p90 {np.percentile(synced, 90):.3f}); back-to-back {s.elapsed_time(e) / 100:.3f} ms")

    for point in args.at.split(","):
        c, n = (int(v) for v in point.split(":"))
        prep = d.prepare(fixed_batch(c, n, m, rng))
        d.load(prep)
        launch = prep.route.launch
        for _ in range(2):
            d.forward(c, launch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                d.forward(c, launch)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.self_device_time_total for e in events) / 3 / 1e3
        print(f"== eager step c={c} n={n} launch={launch} ({args.kernels}): kernels sum {total:.3f} ms per step")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:args.rows]:
            print(f"  {e.self_device_time_total / 3 / 1e3:8.3f} ms  {e.count // 3:5d}x  {e.key[:90]}")

    batches = [fixed_batch(8, 4, m, rng) for _ in range(16)]
    host = []
    for i in range(3000):
        t0 = time.perf_counter_ns()
        p = d.prepare(batches[i % 16])
        d.load(p)
        host.append((time.perf_counter_ns() - t0) / 1e3)
    host = np.array(host[500:])
    print(f"host prepare+load, tight loop, c=8: median {np.median(host):.1f} us, p10 {np.percentile(host, 10):.1f}, p90 {np.percentile(host, 90):.1f}")
    t = []
    for i in range(2000):
        t0 = time.perf_counter_ns()
        d.prepare(batches[i % 16])
        t.append((time.perf_counter_ns() - t0) / 1e3)
    print(f"  of which prepare (pack + route): median {np.median(t[200:]):.1f} us")
    mb, packed = d.rules.meta_buf, d.prepare(batches[0]).packed
    parts = {"event sync": lambda: mb.copied.synchronize(), "numpy fill": lambda: mb.staging_np.__setitem__(slice(None), packed),
             "copy_ call": lambda: mb.buffer.copy_(mb.staging, non_blocking=True), "event record": lambda: mb.copied.record()}
    for name, fn in parts.items():
        ts = []
        for _ in range(2000):
            t0 = time.perf_counter_ns()
            fn()
            ts.append((time.perf_counter_ns() - t0) / 1e3)
        torch.cuda.synchronize()
        print(f"  load part {name}: median {np.median(ts[200:]):.1f} us")


if __name__ == "__main__":
    main()
