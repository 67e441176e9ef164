"""The report's expert-LoRA section (MoE models): which path each bucket's graph runs, and what
specialising by active count changes there. On the per-entry path the grid ignores the active
count, so a specialised capture set can only change the attention LoRA's grid."""

import pandas as pd

from lorabench.commands.tables import markdown_table
from lorabench.config.backends import label_order
from lorabench.config.strategies import BASELINE

PER_ENTRY = "per-entry"  # the rows' moe_lora_path value (kernels.moe_lora.PER_ENTRY: the report imports no triton)


def moe_md(over: pd.DataFrame, u: str) -> list[str]:
    """Per (kernels, max_loras, c): the expert-LoRA path of c's bucket, each strategy's LoRA
    overhead at n = 1 (the point where a specialised grid differs most from max's), and each
    strategy's step against max's there."""
    if "moe_lora_path" not in over or over.moe_lora_path.isna().all():
        return []
    one = over[over.n_active == 1]
    if one.empty:
        return ["## Expert LoRA's path", "", "Not tabled: the run measured no n = 1 point (see --active-counts).", ""]
    strats = sorted(one.strategy.unique(), key=lambda s: (s != BASELINE, s))
    against = [s for s in strats if s != BASELINE] if BASELINE in strats else []  # each set's step vs max's
    out = ["## Expert LoRA's path", "",
           "Each bucket's graph runs the expert LoRA on the backend's path for its tokens: `per-entry` (one program "
           "per routed (token, expert) entry; its grid ignores the active count, so specialising changes only the "
           "attention LoRA there), `sorted` (entries grouped by (adapter, expert); one program column per captured "
           "adapter slot, so specialising shrinks it) or `in-gemm` / `in-gemm+shrink` (inside the expert GEMM, walking the "
           f"captured slots: specialising shortens the walk). LoRA overhead at n = 1 over the same set's n = 0 step ({u}, "
           "median), and each set's n = 1 step against max's.", ""]
    moot = []
    for (k, m), g in sorted(one.groupby(["kernels", "max_loras"]), key=lambda kv: (label_order(kv[0][0]), kv[0][1])):
        rows, per_entry = [], []
        for c, at in g.groupby("concurrency"):  # in order of c
            if (at.moe_lora_path == PER_ENTRY).all():
                per_entry.append(int(c))
            by = at.drop_duplicates("strategy").set_index("strategy")
            row = [int(c), int(at.graph_tokens.iloc[0]), _paths(by, strats)]
            for s in strats:
                row.append(f"{by.step_ms_median[s] - by.base_ms[s]:.3f}" if s in by.index else "-")
            for s in against:
                row.append(f"{100 * (by.step_ms_median[s] / by.step_ms_median[BASELINE] - 1):+.1f} %"
                           if s in by.index and BASELINE in by.index else "-")
            rows.append(row)
        if per_entry:
            moot.append(f"- {k}, max_loras = {m}: per-entry (specialisation moot for the experts) at c = "
                        f"{', '.join(map(str, per_entry))}")
        out += [f"**{k}, max_loras = {m}**\n",
                markdown_table(["c", "bucket", "expert-LoRA path", *(f"{s} overhead" for s in strats),
                                *(f"{s} vs {BASELINE}" for s in against)], rows), ""]
    return out + (moot + [""] if moot else [])


def _paths(by: pd.DataFrame, strats: list[str]) -> str:
    """The bucket's path, or each set's where they differ (lorabench's rule reads the launch count)."""
    paths = {s: by.moe_lora_path[s] for s in strats if s in by.index}
    if len(set(paths.values())) == 1:
        return next(iter(paths.values()))
    return "; ".join(f"{s}: {p}" for s, p in paths.items())
