"""The report's prefill section: LoRA overhead per prompt size and active count, against its floor,
and each backend's overhead against the first backend's (``analysis.prefill``)."""

from pathlib import Path

import pandas as pd

from lorabench.analysis.prefill import overhead_ratio
from lorabench.commands.report.labels import backends, in_order
from lorabench.commands.tables import cell, markdown_table
from lorabench.config.backends import backend_of
from lorabench.config.strategies import report_order
from lorabench.kernels import BACKENDS


def prefill_md(pre: pd.DataFrame, u: str, plot: Path | None, samples=None) -> list[str]:
    """Per (kernels, max_loras, strategy): each prefill point's step, LoRA overhead and floor; then,
    per (max_loras, strategy) measured with several backends, each one's overhead over the first's."""
    if pre.empty:
        return []
    r = pre.iloc[0]
    out = ["## Prefill steps: LoRA overhead by prompt tokens", "",
           f"Each prefill point is one step of T prompt tokens (chunks of at most {int(r.context_len)} tokens from "
           "`requests` requests, n adapters among them), timed as the decode points are. overhead = the step - the "
           "same configuration's step of the same T tokens with no adapter (no LoRA kernels). floor = (n x LoRA "
           "bytes per slot + T x each LoRA linear's input read once and output read and written once) / the worker's "
           "bandwidth (the faster of a copy and an in-place add) + one kernel per LoRA linear: what LoRA beside the base GEMMs must move. `route`: "
           "`piecewise` (the step replays its bucket's PIECEWISE graphs, attention eager between them) or `eager` "
           "(past --max-cudagraph-capture-size).", ""]
    if plot is not None:
        out += [f"![LoRA overhead vs tokens per step]({plot.name})", ""]
    for (k, m, s), g in in_order(pre, by=("kernels", "max_loras", "strategy")).groupby(
            ["kernels", "max_loras", "strategy"], sort=False):
        rows = [[int(p.prefill_tokens), int(p.n_active), int(p.concurrency), p.mixed_route, p.step_ms_median,
                 p.overhead_ms if p.n_active else None, cell(p.overhead_pct, "{:+.1f} %") if p.n_active else None,
                 p.floor_ms, cell(p.x_floor, "{:.2f}")]
                for p in g.sort_values(["prefill_tokens", "n_active"]).itertuples()]
        out += [f"**{k}, max_loras = {m}, {s}** ({u}, median)\n",
                markdown_table(["T", "n", "requests", "route", "step", "overhead", "overhead %", "floor", "x floor"],
                               rows), ""]
        if getattr(BACKENDS.get(backend_of(k)), "extends_k", False):
            out += [f"`{k}` runs a prompt step's linears, where their slots' B fit, as one GEMM with the expand inside "
                    "its K (y written once): the floor above is the pair's design, which it can go under. Its model "
                    "holds those weights in wider rows, which its n = 0 step reads too: compare that step with "
                    "another backend's.", ""]
    out += _ratios(pre, samples)
    return out


def _ratios(pre: pd.DataFrame, samples) -> list[str]:
    out = []
    for (m, s), g in sorted(pre[pre.n_active > 0].groupby(["max_loras", "strategy"]),
                            key=lambda kv: (kv[0][0], report_order(kv[0][1]))):
        ks = backends(g)
        if len(ks) < 2 or g.base_point.isna().any():
            continue
        at = g.set_index(["kernels", "prefill_tokens", "n_active"])
        rows = []
        for t, n in sorted(set(zip(g.prefill_tokens, g.n_active))):
            first = at.loc[(ks[0], t, n)] if (ks[0], t, n) in at.index else None
            cells = []
            for k in ks[1:]:
                if first is None or (k, t, n) not in at.index:
                    cells.append("-")
                    continue
                ratio, iv = overhead_ratio(samples, first, at.loc[(k, t, n)])
                cells.append(f"{ratio:.2f}" + (f" [{iv[0]:.2f}, {iv[1]:.2f}]" if iv else ""))
            rows.append([int(t), int(n), *cells])
        out += [f"**max_loras = {m}, {s}**: {ks[0]}'s LoRA overhead over each other backend's "
                "(95 % interval from the four points' samples)\n",
                markdown_table(["T", "n", *(f"{ks[0]} / {k}" for k in ks[1:])], rows), ""]
    return out
