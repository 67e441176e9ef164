"""BENCHMARKS.md's MoE tables from one run of sweeps/moe-*.toml: per (max_loras, c, n) the step and
the LoRA overhead (step at n minus the no-LoRA step at the same c, same configuration) of
lorabench's expert-LoRA kernels and of vLLM's, their ratio, the overhead as a share of the base
step, and the bytes floor: the adapter bytes the step reads at least (its active experts' expert
LoRA, at most c·top_k (slot, expert) pairs and at most n·E, plus n adapters' attention LoRA), over
the worker's measured copy bandwidth. Then where specialisation pays: per c, the overhead at n = 1
under max and pow2 for each backend, with the expert-LoRA path each took.

    python scripts/moe_figures.py RUN_DIR [--points 4:1:1,4:8:4,16:32:8,16:64:16]
"""

import argparse

import pandas as pd


def table(df: pd.DataFrame, kernels: str, strategy: str) -> pd.DataFrame:
    fixed = df[(df["mode"] == "fixed") & (df.kernels == kernels) & (df.strategy == strategy) & (df.status == "ok")]
    base = fixed[fixed.n_active == 0].set_index(["max_loras", "concurrency"]).step_ms_median
    out = fixed[fixed.n_active > 0].copy()
    out["base_ms"] = [base.get((r.max_loras, r.concurrency)) for r in out.itertuples()]
    out["overhead_ms"] = out.step_ms_median - out.base_ms
    return out.set_index(["max_loras", "concurrency", "n_active"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--points", default="4:1:1,4:8:4,16:32:8,16:64:16")
    args = ap.parse_args()
    df = pd.read_parquet(f"{args.run}/points.parquet")
    first = df.iloc[0]
    layers_bytes = first.expert_lora_bytes_per_slot / first.experts  # one (slot, expert) pair, every layer
    dense_bytes = first.lora_bytes_per_slot - first.expert_lora_bytes_per_slot  # one adapter's attention LoRA
    ours = table(df, "triton", "pow2")
    for strategy, label in (("max", "vLLM default"), ("pow2", "vLLM --specialize-active-lora")):
        theirs = table(df, "vllm", strategy)
        print(f"\n{first.model}: lorabench (pow2) vs {label}")
        print("| max_loras, c, n | base step ms | lorabench +ms | vLLM +ms | ratio | lorabench share | floor µs | x floor |"
              " paths (ours / vLLM) |")
        print("|---|---|---|---|---|---|---|---|---|")
        keys = sorted(set(ours.index) & set(theirs.index))
        wanted = [tuple(int(v) for v in p.split(":")) for p in args.points.split(",")]
        for key in keys if strategy == "max" else [k for k in keys if k in wanted]:
            o, t = ours.loc[key], theirs.loc[key]
            pairs = min(key[1] * first.top_k, key[2] * first.experts)
            floor_bytes = pairs * layers_bytes + key[2] * dense_bytes
            floor_us = floor_bytes / (o.probe_copy_gbs * 1e9) * 1e6 if pd.notna(o.probe_copy_gbs) else float("nan")
            mark = " **" if key in wanted else ""
            print(f"| {key[0]}, {key[1]}, {key[2]}{mark} | {o.base_ms:.3f} | {o.overhead_ms:.3f} | {t.overhead_ms:.3f} | "
                  f"{o.overhead_ms / t.overhead_ms:.2f} | {o.overhead_ms / o.base_ms:+.1%} | {floor_us:.0f} | "
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
                cells.append(f"{m.overhead_ms:.3f} / {p.overhead_ms:.3f} ({p.moe_lora_path})")
            print(f"| {kernels} | {max_loras} | " + " | ".join(cells) + " |")
    checks = df.groupby(["kernels", "strategy", "max_loras"]).check_detail.first()
    print("\nchecks:")
    for key, detail in checks.items():
        print(f"- {key}: {str(detail)[:300]}")


if __name__ == "__main__":
    main()
