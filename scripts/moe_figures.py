"""BENCHMARKS.md's MoE tables from one run of sweeps/moe-*.toml: per (max_loras, c, n) the step and
the LoRA overhead (step at n minus the no-LoRA step at the same c, same configuration) of
lorabench's expert-LoRA kernels and of vLLM's, their ratio, the overhead as a share of the base
step, and the bytes floor: the adapter bytes the step reads at least (its active experts' expert
LoRA: the (slot, expert) pairs its tokens route to, expected under uniform routing, plus n
adapters' attention LoRA: ``analysis.roofline.step_lora_bytes``), over the worker's
measured copy bandwidth. Then where specialisation pays: per c, the overhead at n = 1
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

from lorabench.analysis.intervals import interval_of
from lorabench.analysis.roofline import step_lora_bytes
from lorabench.stats import Resampler, ratio_pct
from lorabench.storage.samples import read_samples, step_times


def table(df: pd.DataFrame, kernels: str, strategy: str) -> pd.DataFrame:
    """The backend's fixed points with n > 0, each with its run's n = 0 step, keyed (run, max_loras, c, n)."""
    fixed = df[(df["mode"] == "fixed") & (df.kernels == kernels) & (df.strategy == strategy) & (df.status == "ok")]
    base = fixed[fixed.n_active == 0].set_index(["run", "max_loras", "concurrency"])
    out = fixed[fixed.n_active > 0].copy()
    key = list(zip(out.run, out.max_loras, out.concurrency))
    out["base_ms"] = [base.step_ms_median.get(k) for k in key]
    out["base_point"] = [base.point.get(k) for k in key]
    out["overhead_ms"] = out.step_ms_median - out.base_ms
    return out.dropna(subset=["base_ms"]).set_index(["run", "max_loras", "concurrency", "n_active"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", nargs="+")
    ap.add_argument("--points", default="4:1:1,4:8:4,16:32:8,16:64:16")
    args = ap.parse_args()
    parts, samples = [], {}
    for i, run in enumerate(args.run):  # points are keyed (run, point): each run numbers its own
        part = pd.read_parquet(Path(run) / "points.parquet")
        part["run"] = i
        part["point"] = [(i, int(p)) for p in part.point]
        parts.append(part)
        samples.update({(i, int(p)): x for p, x in step_times(read_samples(Path(run))).items()})
    df = pd.concat(parts, ignore_index=True)
    if df.model.nunique() > 1:  # the floor is one model's bytes
        raise SystemExit(f"moe_figures.py: the runs hold {', '.join(sorted(df.model.unique()))}: one model per call")
    rs = Resampler(samples)
    first = df.iloc[0]
    wanted = [tuple(int(v) for v in p.split(":")) for p in args.points.split(",")]
    ours = table(df, "triton", "pow2")
    for strategy, label in (("max", "vLLM default"), ("pow2", "vLLM --specialize-active-lora")):
        theirs = table(df, "vllm", strategy)
        print(f"\n{first.model}: lorabench (pow2) vs {label}")
        print("| max_loras, c, n | base step ms | lorabench +ms | vLLM +ms | ratio [95 % interval] | lorabench share |"
              " floor µs | x floor | paths (ours / vLLM) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for key in sorted(set(ours.index) & set(theirs.index)):  # both backends within one run
            point = tuple(int(v) for v in key[1:])
            if strategy != "max" and point not in wanted:
                continue
            o, t = ours.loc[key], theirs.loc[key]
            floor_bytes = step_lora_bytes(point[1], point[2], first.lora_bytes_per_slot, first.expert_lora_bytes_per_slot,
                                          int(first.experts), int(first.top_k))
            floor_us = floor_bytes / (o.probe_copy_gbs * 1e9) * 1e6 if pd.notna(o.probe_copy_gbs) else float("nan")
            on, o0, tn, t0 = o.point, o.base_point, t.point, t.base_point
            iv, _ = interval_of(rs, lambda m: (m[on] - m[o0]) / (m[tn] - m[t0]), (on, o0, tn, t0))  # noqa: B023
            spread = f" [{iv.low:.2f}, {iv.high:.2f}]" if iv is not None else " [no interval]"
            mark = " **" if point in wanted else ""
            print(f"| {point[0]}, {point[1]}, {point[2]}{mark} | {o.base_ms:.3f} | {o.overhead_ms:.3f} | {t.overhead_ms:.3f} | "
                  f"{o.overhead_ms / t.overhead_ms:.2f}{spread} | {o.overhead_ms / o.base_ms:+.1%} | {floor_us:.0f} | "
                  f"{o.overhead_ms * 1e3 / floor_us:.1f} | {o.moe_lora_path} / {t.moe_lora_path} |")
    print(f"\n{first.model}: overhead ms at n = 1, max vs pow2 (path; pow2's step against max's, same worker)")
    print("| backend | max_loras | " + " | ".join(f"c={c}" for c in sorted(df.concurrency.unique())) + " |")
    print("|---|---|" + "---|" * df.concurrency.nunique())
    for kernels in ("triton", "vllm"):
        tabs = {s: table(df, kernels, s) for s in ("max", "pow2")}
        for run, max_loras in sorted(set(zip(df.run, df.max_loras))):
            cells = []
            for c in sorted(df.concurrency.unique()):
                key = (run, max_loras, c, 1)
                if key not in tabs["max"].index or key not in tabs["pow2"].index:
                    cells.append("-")
                    continue
                m, p = tabs["max"].loc[key], tabs["pow2"].loc[key]
                iv, _ = interval_of(rs, ratio_pct(m.point, p.point), (m.point, p.point))
                step = f", step {iv.estimate:+.1f} % [{iv.low:+.1f}, {iv.high:+.1f}]" if iv is not None else ""
                cells.append(f"{m.overhead_ms:.3f} / {p.overhead_ms:.3f} ({p.moe_lora_path}{step})")
            print(f"| {kernels} | {max_loras} | " + " | ".join(cells) + " |")
    checks = df.groupby(["run", "kernels", "strategy", "max_loras"]).check_detail.first()
    print("\nchecks:")
    for (run, *key), detail in checks.items():
        print(f"- {args.run[run]} {tuple(key)}: {str(detail)[:300]}")


if __name__ == "__main__":
    main()
