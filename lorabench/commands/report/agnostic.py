"""The report's count-agnostic section: does one graph per bucket (``agnostic``) make specialising
by active count unnecessary?"""

import numpy as np
import pandas as pd

from lorabench.commands.tables import markdown_table, mib
from lorabench.config.backends import label_order
from lorabench.config.strategies import BASELINE, STRATEGIES

BUCKET_GRID = [name for name, s in STRATEGIES.items() if s.bucket_grid]  # agnostic

AGNOSTIC_WITHIN = 0.03  # count-agnostic is as good as specialised when within 3 % of the best at every point


def agnostic_md(over: pd.DataFrame, cfg: pd.DataFrame, u: str) -> list[str]:
    """Does the count-agnostic grid make specialisation unnecessary? Per (kernels, max_loras, c,
    n): agnostic's step against the fastest other strategy that passed its check."""
    over = over[over.n_active > 0]  # n = 0 runs the same no-LoRA graph under every strategy
    ag = over[over.strategy.isin(BUCKET_GRID)]
    if ag.empty:
        return []
    wrong = {(c.kernels, c.max_loras, c.strategy) for c in cfg.itertuples() if c.correct is False}
    failed = sorted({(k, int(m)) for k, m, s in zip(ag.kernels, ag.max_loras, ag.strategy) if (k, m, s) in wrong})
    ag = ag[[(k, m, s) not in wrong for k, m, s in zip(ag.kernels, ag.max_loras, ag.strategy)]]  # wrong can look fast
    others = over[~over.strategy.isin(BUCKET_GRID)]
    others = others[[(k, m, s) not in wrong for k, m, s in zip(others.kernels, others.max_loras, others.strategy)]]
    out = ["## Count-agnostic vs specialised", "",
           "`agnostic` captures one LoRA graph per bucket with min(bucket, max_loras) programs on the adapter axis, "
           "whatever n; `best other` is the fastest other strategy of the same kernels that passed its check, "
           f"per point ({u}, median). Specialisation is unnecessary where agnostic is within "
           f"{100 * AGNOSTIC_WITHIN:.0f} % everywhere.", ""]
    out += [f"**{k}, max_loras = {m}**: agnostic failed its correctness check (see Correctness); not compared.\n"
            for k, m in failed]
    summary = []
    for (k, m), g in sorted(ag.groupby(["kernels", "max_loras"]), key=lambda kv: (label_order(kv[0][0]), kv[0][1])):
        rows, worst = [], -np.inf
        for r in g.sort_values(["concurrency", "n_active"]).itertuples():
            o = others[(others.kernels == k) & (others.max_loras == m) & (others.concurrency == r.concurrency)
                       & (others.n_active == r.n_active)]
            if o.empty:
                continue
            b = o.loc[o.step_ms_median.idxmin()]
            gap = r.step_ms_median / b.step_ms_median - 1
            worst = max(worst, gap)
            rows.append([int(r.concurrency), int(r.n_active), f"{r.step_ms_median:.3f} [{int(r.graph_loras)}]",
                         f"{b.step_ms_median:.3f} ({b.strategy} [{int(b.graph_loras)}])", f"{100 * gap:+.1f} %"])
        if not rows:
            continue
        out += [f"**{k}, max_loras = {m}**\n", markdown_table(["c", "n", "agnostic [grid]", "best other", "agnostic vs best"], rows), ""]
        c_ag = cfg[(cfg.kernels == k) & (cfg.max_loras == m) & cfg.strategy.isin(BUCKET_GRID)].iloc[0]
        c_max = cfg[(cfg.kernels == k) & (cfg.max_loras == m) & (cfg.strategy == BASELINE)]
        cost = (f"{int(c_ag.num_graphs)} graphs / {mib(c_ag.graph_mem_bytes)} MiB / {c_ag.startup_s:.2f} s startup"
                + (f" (max: {int(c_max.num_graphs.iloc[0])} / {mib(c_max.graph_mem_bytes.iloc[0])} MiB / "
                   f"{c_max.startup_s.iloc[0]:.2f} s)" if len(c_max) else ""))
        verdict = "yes" if worst <= AGNOSTIC_WITHIN else "no"
        summary.append([k, int(m), f"{100 * worst:+.1f} %", verdict, cost])
    out += [markdown_table(["kernels", "max_loras", "worst agnostic vs best", f"within {100 * AGNOSTIC_WITHIN:.0f} % everywhere", "agnostic's graphs (max's)"],
                     summary), ""]
    return out

