"""Why, in words: every decision's reason (``reason``), written from the decision's values alone
(``lorabench.analysis.decision``), and the rule it follows (``PAYS_RULE``). recommendation.json,
report.md and the console all take their reasons from here.
"""

from lorabench.analysis.compare import NOT_COMPARABLE, PARTIAL, Comparison, c_list
from lorabench.analysis.decision import AutoDecision, Basis, MeasuredDecision, ResidencyDecision, SetChoice
from lorabench.analysis.intervals import APART_MARGIN_PCT, Gain, describe_gain, describe_more, versus
from lorabench.config.strategies import BASELINE

PLAIN = "the cost model's best set within the budgets"  # auto's reason when no rule of the report's had to step in
MEDIANS_ONLY = "decided on medians alone ({why})"
BASIS = ("expected step time = sum_n P(n|c) * median step(c, n), averaged over the swept concurrencies; "
         "a strategy is compared with max only over the concurrencies both have every needed point of, "
         "measured on the same GPU (max's)")


def pays_rule(pays_pct: float) -> str:
    return (f"a strategy other than max is recommended only when the lower end of the 95 % interval of its gain "
            f"over max clears {pays_pct:g} % (each point's median resampled independently, percentile bootstrap); "
            f"otherwise max, the fewest graphs (inconclusive when the interval reaches past {pays_pct:g} %); "
            f"a run that kept no samples is decided on the medians alone")


def reason(decision) -> str:
    """The reason of any decision."""
    match decision:
        case MeasuredDecision():
            return measured(decision)
        case AutoDecision():
            return auto(decision)
        case SetChoice():
            return set_choice(decision)
        case ResidencyDecision():
            return residency(decision)
    raise TypeError(f"not a decision: {decision!r}")


def decided_on(d: MeasuredDecision) -> str | None:
    """What the report's choice rests on, in words (None: nothing was compared)."""
    if d.fastest_ok is None:
        return None
    if d.basis is Basis.INTERVAL:
        return "the 95 % interval of the gain"
    return MEDIANS_ONLY.format(why=d.why_medians) if d.why_medians else "nothing to decide: no other strategy"


def measured(d: MeasuredDecision) -> str:
    cmp, pays = d.comparison, d.pays_pct
    if not cmp.grid:
        return f"not comparable: {cmp.why_not_comparable()}"
    if d.fastest_ok is None:
        return ("no configuration passed its correctness check (see rejected)" if cmp.candidates()
                else "no strategy that passed its correctness check has every point max has") + qualify(cmp)
    best, chosen = d.fastest_ok, d.chosen
    over = "on average over concurrency" if cmp.grid == cmp.planned else f"on average over {c_list(cmp.grid)}"
    if d.basis is not Basis.INTERVAL:
        text = (f"{best} is {d.gains[best].pct:.1f} % faster than max {over} "
                + (f"(>= the {pays:g} % that pays for extra graphs)" if best in d.cleared
                   else f"(< {pays:g} %: within noise, extra graphs do not pay)"))
    else:
        shown = chosen if chosen != BASELINE else best
        so_max = ", so max, the fewest graphs" if chosen == BASELINE else ""
        text = f"{shown} vs max {over}: {versus(d.gains[shown], cmp.margin_pct)}" if shown != BASELINE else ""
        if shown in d.cleared:
            text += f"; the interval's low end clears the {pays:g} % that pays for extra graphs"
        elif shown in d.open:
            text += f"; inconclusive: the interval's low end does not clear the {pays:g} % that pays for extra graphs{so_max}"
        elif shown != BASELINE:
            text += f"; the whole interval is below the {pays:g} % that pays for extra graphs{so_max}"
        if chosen in d.cleared and best not in (chosen, BASELINE):
            text += (f"; {best} measured faster ({versus(d.gains[best], cmp.margin_pct)}) but its interval's low end "
                     f"does not clear {pays:g} %")
    if best == BASELINE:
        text = "max is the fastest" + (" strategy that passed its correctness check" if d.rejected else "")
        if len(cmp.candidates()) == 1 and len(cmp.covers) > 1:
            text = "max is kept: no other strategy is measured at every concurrency max covers"
        elif d.basis is Basis.INTERVAL and not d.cleared and d.open:
            top = max(d.open, key=lambda s: d.gains[s].interval.estimate)
            text += f"; inconclusive: {top} vs max {over}: {versus(d.gains[top], cmp.margin_pct)}, whose interval reaches past {pays:g} %"
    if d.fastest != best:
        text = f"{d.fastest} measured fastest but failed its correctness check, so it is not proposed; " + text
    if chosen != BASELINE and chosen not in d.cleared:
        text += "; max failed its correctness check"
    if d.settle:
        text += f"; {d.settle}"
    if d.basis is not Basis.INTERVAL and len(d.ranked) > 1:
        text += "; " + MEDIANS_ONLY.format(why=d.why_medians)
    return text + qualify(cmp)


def qualify(cmp: Comparison) -> str:
    """What a decision leaves out: max's own missing concurrencies, strategies measured at part
    of max's, and those not comparable at all; '' on a complete comparison."""
    out = []
    missing = [c for c in cmp.planned if c not in cmp.grid]
    if missing and cmp.grid:
        out.append(f"max lacks {c_list(missing)}, so nothing is compared there")
    for s, cv in cmp.covers.items():
        if cv.status == PARTIAL:
            g = cmp.gain(s)
            out.append(f"{s} is not proposed: measured at {len(cv.compared_over)} of max's {len(cmp.grid)} concurrencies; "
                       f"over {c_list(cv.compared_over)} it is {100 * abs(g):.1f} % {'faster' if g > 0 else 'slower'} "
                       f"than max, and it is not comparable at {c_list(cv.lacks)}"
                       + (f" ({cv.elsewhere_text()})" if cv.elsewhere else ""))
        elif cv.status == NOT_COMPARABLE and s != BASELINE:
            out.append(f"{s} is not comparable: " + (cv.elsewhere_text() if cv.elsewhere and not cv.by_c
                                                     else "it is measured at no concurrency max covers"))
    return "".join(f"; {x}" for x in out)


def max_needs(d: AutoDecision) -> str:
    """What max's graphs need, when not even max fits the budgets."""
    plan = d.max_plan
    if plan is None:
        return ""
    parts = [f"{plan.graphs} LoRA graphs"]
    if plan.graph_mem_bytes is not None:
        parts.append(f"{plan.graph_mem_bytes / 2**20:.0f} MiB")
    if plan.startup_s is not None:
        parts.append(f"{plan.startup_s:.2f} s startup")
    return ": max needs " + ", ".join(parts)


def auto(d: AutoDecision) -> str:
    if not d.concurrency:
        return measured(d.measured)
    if d.chosen is None:
        return f"no capture set fits the budgets (not even max{max_needs(d)})"
    pays, L, report = d.pays_pct, d.max_loras, d.measured
    text = PLAIN
    if d.specialised:
        g, counts = d.gain, d.proposed.counts
        if g.interval is not None and not g.clears(pays):
            text = (f"the cost model's best set {counts} vs max: {describe_gain(g.interval)}; "
                    + (f"inconclusive: the interval's low end does not clear {pays:g} %" if g.open(pays) else
                       f"the whole interval is below the {pays:g} % that pays for extra graphs")
                    + ", so max, the fewest graphs" + (f"; {g.settle(pays)}" if g.settle(pays) else ""))
        elif g.interval is None:
            if not g.clears(pays):
                text = (f"the cost model's best set {counts} is only {g.pct:.2f} % faster than max "
                        f"(< {pays:g} %: extra graphs do not pay), so max")
            if g.why:
                text += "; " + MEDIANS_ONLY.format(why=g.why)
    if d.measured_as:
        why = "; ".join(report.comparison.covers[s].text() if s in report.comparison.covers else s for s in d.measured_as)
        text = (f"the cost model's best set {d.kept.counts} is {' and '.join(d.measured_as)}'s, which this run measured "
                f"({why}) and the report does not propose; measured beats modelled")
        if d.chosen.counts != [L]:
            text += f", so {report.chosen}'s set, which the report proposes"
        else:
            text += ", so max"
            if report.inconclusive:
                text += f" (the report: inconclusive; {report.more_measuring or 'more steps per point would settle it'})"
    elif d.kept.counts == [L] and report.chosen not in (None, BASELINE):
        g = round(report.gains[report.chosen].pct, 2)  # the figure recommendation.json holds
        if d.report_plan is not None and d.report_fits:
            text = (f"the cost model prices no set {pays:.0f} % faster than max, but this run measured {report.chosen} "
                    f"{g:.1f} % faster: measured beats modelled, so {report.chosen}'s set")
        elif d.report_set is not None:
            text += f"; the report proposes {report.chosen} (measured {g:.1f} % faster than max), which does not fit the budgets"
        else:
            text += f"; the report proposes {report.chosen} (measured {g:.1f} % faster than max), a set auto does not price"
    return text


def more_tokens(g: Gain) -> str:
    """A throughput gain in words: its interval's verdict, or its medians' gain and why there is no interval."""
    return describe_more(g.interval) if g.interval is not None else f"{g.pct:.1f} % more tokens/s (medians alone: {g.why})"


def set_choice(s: SetChoice) -> str:
    if s.unavailable is not None:
        return s.unavailable
    pays = s.pays_pct
    text = "max is the fastest measured set"
    if s.fastest is not None:
        text = f"{s.fastest.label} vs max: {more_tokens(s.fastest_gain)}"
        if not s.fastest_gain.clears(pays):
            text += f"; not shown to clear {pays:g} %, so max, the fewest graphs"
    if s.model is not None:
        if s.model_gain.clears(pays):
            text += f"; {s.model.label} vs {s.measured_choice.label}: {more_tokens(s.model_gain)}, so the model's set (measure it)"
        else:
            text += f"; {s.model.label} vs it: {more_tokens(s.model_gain)}, not shown to clear {pays:g} %: measured beats modelled"
    return text


def residency(d: ResidencyDecision) -> str:
    if d.unavailable is not None:
        return d.unavailable
    if d.chosen is None:
        return "no max_loras has a configuration priced within the budget: " + "; ".join(
            f"max_loras {m}: {set_choice(at)}" for m, at in d.at.items())
    c, best = d.chosen, d.best
    why = "the most tokens per second"
    if d.fewer is not None:
        g = d.fewer
        why = (f"max_loras {best.max_loras} serves the most tokens per second, "
               + (f"{describe_more(g.interval, margin_pct=APART_MARGIN_PCT)} than {c.max_loras} slots" if g.interval is not None
                  else f"{g.pct:.1f} % more than {c.max_loras} slots (medians alone: {g.why})")
               + f", not shown to clear {d.pays_pct:g} %: so {c.max_loras}, the fewer slots")
    return why + f"; {set_choice(d.at[c.max_loras])}"


def versus_card(d: ResidencyDecision) -> str:
    """The choice against the card's configuration, in words."""
    return describe_more(d.card_gain.interval, d.card_gain.why, APART_MARGIN_PCT)
