"""BENCHMARKS.md's MoE tables from one run of sweeps/moe-*.toml: per (max_loras, c, n) the step and
the LoRA overhead (step at n minus the no-LoRA step at the same c, same configuration) of
lorabench's expert-LoRA kernels and of vLLM's, their ratio, the overhead as a share of the base
step, and the bytes floor: the adapter bytes the step reads at least (its active experts' expert
LoRA, at most c·top_k (slot, expert) pairs and at most n·E, plus n adapters' attention LoRA), over
the worker's measured copy bandwidth. Then where specialisation pays: per c, the overhead at n = 1
under max and pow2 for each backend, with the expert-LoRA path each took and pow2's step against
max's (same worker, alternating turns).

The ratio's 95 % interval is a bootstrap over the four points' samples (each resampled alone).
Several runs (e.g. 4 slots and 16 slots measured apart) are read as one; a (max_loras, c, n) is
compared only within the run that measured both backends there.

    python scripts/moe_figures.py RUN_DIR [RUN_DIR ...] [--points 4:1:1,4:8:4,16:32:8,16:64:16]
"""

import argparse
from pathlib import Path

import pandas as pd

from lorabench.stats import Resampler, ratio_pct
from lorabench.storage.samples import read_samples, step_times


def table(df: pd.DataFrame, kernels: str, strategy: str) -> pd.DataFrame:
    fixed = df[(df["mode"] == "fixed") & (df.kernels == kernels) & (df.strategy == strategy) & (df.status == "ok")]
    base = fixed[fixed.n_active == 0].set_index(["max_loras", "concurrency"])
    out = fixed[fixed.n_active > 0].copy()
    key = list(zip(out.max_loras, out.concurrency))
    out["base_ms"] = [base.step_ms_median.get(k) for k in key]
    out["base_point"] = [base.point.get(k) for k in key]
    out["overhead_ms"] = out.step_ms_median - out.base_ms
    return out.set_index(["max_loras", "concurrency", "n_active"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", nargs="+")
    ap.add_argument("--points", default="4:1:1,4:8:4,16:32:8,16:64:16")
    args = ap.parse_args()
    parts, samples = [], {}
    for i, run in enumerate(args.run):  # points are keyed (run, point): each run numbers its own
        part = pd.read_parquet(Path(run) / "points.parquet")
        part["point"] = [(i, int(p)) for p in part.point]
        parts.append(part)
        samples.update({(i, int(p)): x for p, x in step_times(read_samples(Path(run))).items()})
    df = pd.concat(parts, ignore_index=True)
    rs = Resampler(samples)
    first = df.iloc[0]
    layers_bytes = first.expert_lora_bytes_per_slot / first.experts  # one (slot, expert) pair, every layer
    dense_bytes = first.lora_bytes_per_slot - first.expert_lora_bytes_per_slot  # one adapter's attention LoRA
    ours = table(df, "triton", "pow2")
    for strategy, label in (("max", "vLLM default"), ("pow2", "vLLM --specialize-active-lora")):
        theirs = table(df, "vllm", strategy)
        print(f"\n{first.model}: lorabench (pow2) vs {label}")
        print("| max_loras, c, n | base step ms | lorabench +ms | vLLM +ms | ratio [95 % interval] | lorabench share |"
              " floor µs | x floor | paths (ours / vLLM) |")
        print("|---|---|---|---|---|---|---|---|---|")
        keys = sorted(set(ours.index) & set(theirs.index))
        wanted = [tuple(int(v) for v in p.split(":")) for p in args.points.split(",")]
        for key in keys if strategy == "max" else [k for k in keys if k in wanted]:
            o, t = ours.loc[key], theirs.loc[key]
            pairs = min(key[1] * first.top_k, key[2] * first.experts)
            floor_bytes = pairs * layers_bytes + key[2] * dense_bytes
            floor_us = floor_bytes / (o.probe_copy_gbs * 1e9) * 1e6 if pd.notna(o.probe_copy_gbs) else float("nan")
            mark = " **" if key in wanted else ""
            if o.point[0] != t.point[0] or o.base_point is None or t.base_point is None:
                continue  # measured in different runs
            on, o0, tn, t0 = o.point, o.base_point, t.point, t.base_point
            iv = rs.interval(lambda m: (m[on] - m[o0]) / (m[tn] - m[t0]))  # noqa: B023  (called here, at once)
            spread = f" [{iv.low:.2f}, {iv.high:.2f}]" if iv is not None else " [no interval]"
            print(f"| {int(key[0])}, {int(key[1])}, {int(key[2])}{mark} | {o.base_ms:.3f} | {o.overhead_ms:.3f} | {t.overhead_ms:.3f} | "
                  f"{o.overhead_ms / t.overhead_ms:.2f}{spread} | {o.overhead_ms / o.base_ms:+.1%} | {floor_us:.0f} | "
                  f"{o.overhead_ms * 1e3 / floor_us:.1f} | {o.moe_lora_path} / {t.moe_lora_path} |")
    print(f"\n{first.model}: overhead ms at n = 1, max vs pow2 (path)")
    print("| backend | max_loras | " + " | ".join(f"c={c}" for c in sorted(df.concurrency.unique())) + " |")
    print("|---|---|" + "---|" * df.concurrency.nunique())
    for kernels in ("triton", "vllm"):
        tabs = {s: table(df, kernels, s) for s in ("max", "pow2")}
        for max_loras in sorted(df.max_loras.unique()):
            cells = []
            for c in sorted(df.concurrency.unique()):
                key = (max_loras, c, 1)
                if key not in tabs["max"].index or key not in tabs["pow2"].index:
                    cells.append("-")
                    continue
                m, p = tabs["max"].loc[key], tabs["pow2"].loc[key]
                iv = rs.interval(ratio_pct(m.point, p.point)) if m.point[0] == p.point[0] else None
                step = f", step {iv.estimate:+.1f} % [{iv.low:+.1f}, {iv.high:+.1f}]" if iv is not None else ""
                cells.append(f"{m.overhead_ms:.3f} / {p.overhead_ms:.3f} ({p.moe_lora_path}{step})")
            print(f"| {kernels} | {max_loras} | " + " | ".join(cells) + " |")
    checks = df.groupby(["kernels", "strategy", "max_loras"]).check_detail.first()
    print("\nchecks:")
    for key, detail in checks.items():
        print(f"- {key}: {str(detail)[:300]}")


if __name__ == "__main__":
    main()
