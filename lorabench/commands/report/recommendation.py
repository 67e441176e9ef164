"""The report's recommendation section, from the report's decisions (``MeasuredDecision``): per
(kernels, max_loras, workload), what is proposed and why, each strategy against max, and what
each covers when the comparison is not over every planned concurrency. Figures are the ones
recommendation.json holds."""

from lorabench.analysis.compare import NOT_COMPARABLE, Comparison, c_list
from lorabench.analysis.decision import PAYS_PCT, Basis, MeasuredDecision
from lorabench.analysis.intervals import versus
from lorabench.analysis.reasons import decided_on, reason
from lorabench.analysis.vllm import VLLM_NOTE
from lorabench.config.strategies import BASELINE


def recommendation_md(decisions: list[MeasuredDecision], incomplete: str | None = None) -> list[str]:
    out = ["## Recommendation", ""]
    if incomplete:
        out += ["This run is incomplete (see the top): each strategy is compared with max only over the concurrencies "
                "where both have every point the workload needs.", ""]
    out += [f"A strategy other than max is proposed only when the lower end of the 95 % interval of its gain over "
            f"max clears {PAYS_PCT:g} % (each point's median resampled independently); otherwise max, the fewest "
            f"graphs, **inconclusive** when the interval reaches past {PAYS_PCT:g} %. A run that kept no samples is "
            "decided on the medians alone. Strategies of one kernels and max_loras are timed in alternating turns on "
            "one GPU, so the verdicts' margin is 0; points measured on another GPU are not compared.", ""]
    for d in decisions:
        head = f"- **{d.kernels}, max_loras {d.max_loras}, workload {d.workload}**: "
        if d.chosen is None:
            out.append(head + f"nothing proposed: {reason(d)}.")
        else:
            mark = " (**inconclusive**)" if d.inconclusive else ""
            graphs_max = d.max_costs.describe() if d.max_costs else None
            out.append(head + f"`{d.chosen}` {d.costs.counts}{mark}, {round(d.gains[d.chosen].pct, 2):+.1f} % vs max, "
                       f"{d.costs.describe()} ({graphs_max} for max). {reason(d)}. vLLM: `{d.vllm.flags}`")
        out += [f"  - rejected `{r.strategy}`: {r.why}" for r in d.rejected]
        out += versus_md(d)
        out += coverage_md(d.comparison)
    notes = dict.fromkeys(d.vllm.note for d in decisions if d.chosen is not None)
    out += [f"\nvLLM: {n}" for n in notes if n != VLLM_NOTE]
    return out


def versus_md(d: MeasuredDecision) -> list[str]:
    """Sub-bullets: each strategy against max in words (with its interval, or why none), the GPU
    the comparison was made on, and what more measuring would take when inconclusive."""
    cmp = d.comparison
    out = [f"  - `{s}` vs max over {c_list(cv.compared_over)}: {versus(d.gains[s], cmp.margin_pct)}"
           for s, cv in cmp.covers.items() if s != BASELINE and cv.comparable]
    if d.basis is Basis.MEDIANS:
        out.append(f"  - {decided_on(d)}")
    if d.inconclusive:
        out.append(f"  - inconclusive: {d.more_measuring or 'more steps per point would narrow the interval'}")
    if cmp.gpu_uuid:
        out.append(f"  - compared on one GPU: {cmp.gpu_uuid}")
    return out


def coverage_md(cmp: Comparison) -> list[str]:
    """Sub-bullets of a recommendation whose comparison is not over every planned concurrency:
    each strategy's coverage, what it is compared over and its gain there; none when complete."""
    if cmp.complete:
        return []
    out = []
    for name, cv in cmp.covers.items():
        text = f"  - coverage `{name}`: {cv.text().partition(': ')[2]}"
        if cv.status == NOT_COMPARABLE:
            text += " (not comparable)"
        elif name != BASELINE:
            text += (f" ({round(100 * cmp.gain(name), 2):+.1f} % vs max there"
                     + ("" if cv.status == "complete" else "; partial: not proposed") + ")")
        out.append(text)
    return out
