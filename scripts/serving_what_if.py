"""A serving run's loops priced again with other request lengths or loop lengths, from the run's
own points (``lorabench.analysis.serving_price``: the same pricing the report sets against the
measured loop). A prediction, not a measurement: it says what the loop's schedule does to TTFT
and ITL when only the lengths change, each step at the price of the points the run measured.

    python scripts/serving_what_if.py results/serving/llama-3.1-8b --input-tokens 1200-2000 \\
        --output-tokens 600 --steps 3000,30000 [--max-loras 32] [--workload zipf:1]

One line per (serving configuration, lengths, steps): output tokens/s, mean step, TTFT p50 and
p99, ITL p50 and p99 (ms), and the requests the TTFT percentiles count.
"""

import argparse

from lorabench.analysis.points import ok_points
from lorabench.analysis.serving_price import predict
from lorabench.storage.results import load_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run")
    ap.add_argument("--input-tokens", default=None, help="N or LO-HI (default: the run's)")
    ap.add_argument("--output-tokens", default=None, help="N or LO-HI (default: the run's)")
    ap.add_argument("--steps", default=None, help="comma-separated loop lengths (default: the run's)")
    ap.add_argument("--max-loras", type=int, default=None)
    ap.add_argument("--workload", default=None)
    args = ap.parse_args()
    rows = load_run(args.run)
    ok = ok_points(rows)
    runs = ok[ok["mode"] == "serving"]
    if args.max_loras is not None:
        runs = runs[runs.max_loras == args.max_loras]
    if args.workload is not None:
        runs = runs[runs.workload == args.workload]
    for r in runs.itertuples():
        inp = args.input_tokens or r.input_tokens
        out = args.output_tokens or str(r.output_tokens)
        for steps in [int(s) for s in args.steps.split(",")] if args.steps else [int(r.timed_steps)]:
            p = predict(rows, r._replace(input_tokens=inp, output_tokens=out, timed_steps=steps))
            if p.why:
                print(f"{r.kernels} {int(r.max_loras)} {r.workload}: not priced: {p.why}")
                continue
            f = p.predicted
            print(f"{r.kernels:>8} max_loras {int(r.max_loras):>3} {r.workload:>8} in {inp:>9} out {out:>7} steps {steps:>6}: "
                  f"{f['output_tokens_per_s']:7.1f} tok/s, step {f['step_ms_mean']:.2f}, TTFT p50 {f['ttft_ms_p50']:.1f} "
                  f"p99 {f['ttft_ms_p99']:.1f}, ITL p50 {f['itl_ms_p50']:.2f} p99 {f['itl_ms_p99']:.1f} ms "
                  f"({p.ttft_requests} requests)")


if __name__ == "__main__":
    main()
