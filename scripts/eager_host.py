"""Where an eager step's host time goes, on a GPU. (GPU only.)

    python scripts/eager_host.py [--model llama-3.1-8b] [--layers 32] [--tokens 512,2048] [--kernels triton]
                                 [--max-loras 16] [--kernel-rows 0]

For each token count, a prefill step of 16 requests (one prompt chunk beside 15 single-token
requests, context 2048) run eagerly without an adapter (n = 0) and with one
(n = 1). For each, 10 steps with the stream drained before each: the host time of the step's
launches (median), the time the host spent inside Triton's launcher (``JITFunction.run``, every
Triton kernel's launch, lorabench's and vLLM's alike), and from ``torch.profiler`` the CUDA
runtime calls that took the host's time (launches, allocations, synchronisations). The prefill
sweep on an H100 saw an eager 2048-token step's launches take ~29 ms more with LoRA at every n,
against ~0.1 ms at 512 tokens under PIECEWISE graphs; this says whether that is Triton's launcher,
the driver (a launch that blocks) or an allocation or a sync, and how it scales with tokens.
With ``--kernel-rows K``, also the step's K costliest kernels by GPU time (one profiled step):
where a prefill step's LoRA time goes on the GPU side (the shrinks, packs, GEMMs).
"""

import argparse
import random
import statistics
import time

import torch
import triton.runtime.jit as triton_jit
from lorabench.kernels import get_backend
from torch.profiler import ProfilerActivity, profile

from lorabench.config.batches import prefill_step
from lorabench.config.models import resolve
from lorabench.config.strategies import capture_counts
from lorabench.runtime.dispatch import Dispatcher, MixedBatch
from lorabench.runtime.mixed_attention import MixedLayout
from lorabench.runtime.model import LlamaLoRA

REQUESTS, CONTEXT, STEPS = 16, 2048, 10


class LauncherClock:
    """Host time inside Triton's ``JITFunction.run`` (every Triton launch), and how many."""

    def __init__(self):
        self.seconds, self.calls, self._run = 0.0, 0, triton_jit.JITFunction.run
        clock = self

        def run(fn, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return clock._run(fn, *args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - t0
                clock.calls += 1

        triton_jit.JITFunction.run = run

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--kernels", default="triton", choices=["triton", "fused", "gemm"])  # lorabench's rules
    ap.add_argument("--max-loras", type=int, default=16)
    ap.add_argument("--kernel-rows", type=int, default=0, help="kernels listed by GPU time per step (0: none)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    tokens = [int(t) for t in args.tokens.split(",")]
    backend = get_backend(args.kernels)
    model = LlamaLoRA(resolve(args.model, args.layers), max_loras=args.max_loras, rank=16, max_tokens=max(tokens),
                      context_len=CONTEXT, dtype=torch.bfloat16, device="cuda", cache_rows=REQUESTS,
                      extended=getattr(backend, "EXTENDS_K", False))  # as the sweep's worker builds it
    d = Dispatcher(model, backend, max_loras=args.max_loras, capture_sizes=[1],
                   counts=capture_counts("max", args.max_loras), use_graphs=True)
    d.warm_up()
    clock = LauncherClock()
    print(f"{torch.cuda.get_device_name()}, {args.model}, {args.kernels}: eager prefill steps, ms of host time per step")
    for t in tokens:
        for n in (0, 1):
            step = prefill_step(t, n, args.max_loras, REQUESTS, CONTEXT, random.Random(t))
            batch = MixedBatch(step.token_adapters, MixedLayout.of(step, {p.request: p.request for p in step.pieces}))
            prep = d.prepare_step(batch)
            for _ in range(3):  # compiles what this token count needs
                d.launch(prep)
            launch_ms, triton_ms, step_ms = [], [], []
            for _ in range(STEPS):
                d.load(prep)
                torch.cuda.synchronize()
                clock.reset()
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                t0 = time.perf_counter()
                d.run(prep.route, prep.layout)
                launch_ms.append((time.perf_counter() - t0) * 1e3)
                stop.record()
                torch.cuda.synchronize()
                triton_ms.append(clock.seconds * 1e3)
                step_ms.append(start.elapsed_time(stop))
            calls = clock.calls
            print(f"T={t:<5d} n={n}  launches {statistics.median(launch_ms):7.2f}  in Triton's launcher "
                  f"{statistics.median(triton_ms):7.2f} ({calls} launches, {1e3 * statistics.median(triton_ms) / max(calls, 1):.1f} µs each)"
                  f"  step (GPU) {statistics.median(step_ms):7.2f}")
            d.load(prep)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                d.run(prep.route, prep.layout)
                torch.cuda.synchronize()
            rows = [e for e in prof.key_averages() if e.key.startswith(("cuda", "cu")) and e.self_cpu_time_total > 0]
            for e in sorted(rows, key=lambda e: -e.self_cpu_time_total)[:6]:
                print(f"    {e.key:32s} {e.count:5d} calls  {e.self_cpu_time_total / 1e3:7.2f} ms host")
            kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
            if args.kernel_rows:
                total = sum(e.self_device_time_total for e in kernels) / 1e3
                print(f"    GPU kernels: {total:.2f} ms in {sum(e.count for e in kernels)} launches")
            for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:args.kernel_rows]:
                print(f"    {e.self_device_time_total / 1e3:8.3f} ms {e.count:5d}x  {e.key[:100]}")


if __name__ == "__main__":
    main()
