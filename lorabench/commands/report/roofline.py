"""The report's roofline section: each point's LoRA overhead against its floor."""

from pathlib import Path

import pandas as pd

from lorabench.commands.report.labels import in_order
from lorabench.commands.tables import markdown_table


def _moe(fl: pd.DataFrame) -> bool:
    return "expert_lora_bytes_per_slot" in fl and bool(fl.expert_lora_bytes_per_slot.notna().any())


def roofline_md(fl: pd.DataFrame, plot: Path | None) -> list[str]:
    """Per (kernels, max_loras, c, n), the fastest strategy's LoRA overhead against its floor."""
    if fl.empty:
        return []
    gbs, us = fl.bandwidth_gbs.median(), fl.probe_kernel_us.median()
    launches = "/".join(str(int(k)) for k in sorted(fl.min_kernels.unique()))  # LoRA linears per step
    best = fl.loc[fl.groupby(["kernels", "max_loras", "concurrency", "n_active"]).overhead_ms.idxmin()]
    best = in_order(best, by=("kernels", "max_loras", "concurrency", "n_active"))
    out = ["## Roofline: LoRA overhead vs its floor", "",
           f"floor = the LoRA bytes a step must read / bandwidth + one kernel per LoRA linear ({launches} per step) "
           f"x the cost of one more kernel in a graph; measured by each worker: bandwidth {gbs:.0f} GB/s (the faster of a "
           f"copy and an in-place add, read + write), "
           f"{us:.2f} us per extra kernel (medians). overhead = step - the same configuration's n = 0 step; "
           "the fastest strategy per point. LoRA bytes: n adapters' A and B"
           + ("; on an MoE model n adapters' attention LoRA and the expert LoRA of the (slot, expert) pairs the step's "
              "tokens route to, expected under uniform routing" if _moe(fl) else "")
           + ".", ""]
    if plot is not None:
        out += [f"![roofline]({plot.name})", ""]
    out += [markdown_table(["kernels", "max_loras", "c", "n", "strategy", "LoRA MB", "bytes us", "kernels us", "floor ms",
                      "overhead ms", "x floor"],
                     [[r.kernels, int(r.max_loras), int(r.concurrency), int(r.n_active), r.strategy, f"{r.lora_mb:.1f}",
                       f"{r.bytes_us:.1f}", f"{r.kernels_us:.1f}", r.floor_ms, r.overhead_ms, f"{r.x_floor:.2f}"]
                      for r in best.itertuples()]), ""]
    return out

