"""Strategy ``auto``: the capture set that minimises the expected step time under a workload,
within a graph-memory and a startup budget (``AutoDecision``).

Sets are priced by the cost model (``lorabench.analysis.costmodel``) over the concurrencies where
max has every point the workload needs (``lorabench.analysis.compare``'s grid, what the report
compares over), and found by an exact search (``lorabench.analysis.search``). The model's best
set is then held to the report's rules, so that ``lorabench report`` and ``lorabench recommend``
never contradict each other on a run:

- a set other than max is proposed only when it is at least ``PAYS`` faster than max: with the
  run's samples, the lower end of the 95 % interval of its predicted gain (the cost model's
  pricing on every fixed point's bootstrap medians, each resampled independently); a run that
  kept no samples is decided on the medians alone;
- only points measured on max's GPU price anything (``lorabench.analysis.points.same_gpu``);
- measured beats modelled: the model's best set is taken only if the run did not measure it or
  the report proposes it; where the model keeps max but the report proposes a measured set (one
  that fits the budgets), auto takes that set;
- the vLLM flags are the report's (they follow what was measured).
"""

import pandas as pd

from lorabench.analysis import search
from lorabench.analysis.compare import COMPLETE
from lorabench.analysis.costmodel import Plan, Pricing
from lorabench.analysis.decision import PAYS, PAYS_PCT, AutoDecision, MeasuredDecision
from lorabench.analysis.recommend import config_costs, measured_decision
from lorabench.analysis.recommendation_json import auto_json
from lorabench.analysis.view import RunView
from lorabench.analysis.vllm import (
    SPECIALISED,
    UNVERIFIED_POW2,
    VLLM_NOTE,
    VllmAdvice,
    run_flags,
    verified_pow2,
)
from lorabench.config.backends import backend_of
from lorabench.config.strategies import BASELINE, STRATEGIES, Vllm, strategy
from lorabench.config.workload import Workload, parse_workload


def auto_recommendations(df: pd.DataFrame, workload: str, memory_bytes: float | None = None,
                         startup_s: float | None = None, kernels: list[str] | None = None,
                         max_loras: list[int] | None = None,
                         planned: dict[tuple[str, int, str], tuple[int, ...]] | None = None,
                         samples=None) -> list[dict]:
    """recommendation.json's ``auto`` entries for rows in hand: ``auto_decisions`` of their view.
    ``planned``: the run's plan, as ``lorabench.analysis.compare.compare`` takes it; ``samples``:
    the run's samples (``lorabench.analysis.points.run_samples``)."""
    view = RunView.of(df, samples, planned=planned)
    return [auto_json(d) for d in auto_decisions(view, workload, memory_bytes, startup_s, kernels, max_loras)]


def auto_decisions(view: RunView, workload: str, memory_bytes: float | None = None, startup_s: float | None = None,
                   kernels: list[str] | None = None, max_loras: list[int] | None = None) -> list[AutoDecision]:
    """Per (kernels, max_loras) of lorabench's kernels in the run: the ``auto`` set under the
    workload and budgets, next to ``max``, ``pow2`` and ``dense`` as the same cost model prices
    them, and next to the report's choice among the measured strategies."""
    wl = parse_workload(workload)
    comparisons = {(c.kernels, c.max_loras): c for c in view.comparisons((wl.name,))}
    costs = config_costs(view)
    out = []
    for (k, m), _ in view.compared.groupby(["kernels", "max_loras"]):
        if (kernels and k not in kernels) or (max_loras and int(m) not in max_loras):
            continue
        if backend_of(k) == "vllm":
            continue  # vLLM captures max or pow2 only; its own rules are not lorabench's dispatch
        measured = measured_decision(view, comparisons[(k, int(m))], costs)  # the report's, on the same comparison
        out.append(auto_decision(view, measured, wl, memory_bytes, startup_s))
    return out


def auto_decision(view: RunView, meas: MeasuredDecision, wl: Workload, memory_bytes: float | None,
                  startup_s: float | None) -> AutoDecision:
    """The model's best set at meas's (kernels, max_loras), held to the report's rules."""
    k, m = meas.kernels, meas.max_loras
    budgets = dict(memory_bytes=memory_bytes, startup_s=startup_s)
    if not meas.comparison.grid:
        return AutoDecision(meas, meas.capture_sizes, (), **budgets)
    model = view.cost_model(k, m)
    pricing = Pricing(model, {c: wl.active_count_pmf(c, m) for c in meas.comparison.grid})
    known = dict(measured=meas, capture_sizes=tuple(model.capture_sizes), concurrency=tuple(pricing.conc), **budgets)
    proposed = search.best(pricing, memory_bytes, startup_s)
    base = {name: p for name, p in search.baselines(pricing).items() if p is not None}
    if proposed is None:
        return AutoDecision(baselines=base, **known)
    gain = pricing.gain(proposed.counts, view.samples) if proposed.counts != [m] else None
    kept = proposed if gain is None or gain.clears(PAYS_PCT) else base[BASELINE]
    sets = {s: list(counts) for s, (counts, _) in view.measured_sets(k, m).items()
            if not (s in STRATEGIES and STRATEGIES[s].bucket_grid)}  # agnostic: max's counts, another grid
    same = tuple(s for s, counts in sets.items() if counts == kept.counts and s != BASELINE)
    measured_as = same if meas.chosen not in same else ()
    chosen, report_set, report_plan, report_fits = kept, None, None, False
    if measured_as:  # the model's set is one the run measured and the report does not propose: max, or the report's set
        chosen = base[BASELINE]
        if meas.chosen in sets and sets[meas.chosen] != [m]:
            report_set = tuple(sets[meas.chosen])
    elif kept.counts == [m] and meas.chosen not in (None, BASELINE) and meas.chosen in sets:
        report_set = tuple(sets[meas.chosen])  # the model keeps max, the report measured a faster set
    if report_set is not None:
        report_plan = pricing.plan(list(report_set))
        report_fits = report_plan is not None and search.fits(report_plan, memory_bytes, startup_s)
        chosen = report_plan if report_fits else chosen
    counts = ",".join(map(str, chosen.counts))
    validate = (f"lorabench sweep --max-loras {m} --strategy '[{counts}]' "
                f"--concurrency {','.join(map(str, model.concurrency))} "
                f"--capture-sizes {','.join(map(str, model.capture_sizes))} --kernels {k} --workload {wl.name}")
    return AutoDecision(chosen=chosen, proposed=proposed, gain=gain, measured_as=measured_as, report_set=report_set,
                        report_plan=report_plan, report_fits=report_fits, baselines=base,
                        vllm=_vllm(view, meas, chosen, base), validate=validate, **known)


def _vllm(view: RunView, meas: MeasuredDecision, chosen: Plan, base: dict[str, Plan]) -> VllmAdvice:
    """The report's flags (they follow what was measured), or where the report realises nothing,
    the better of vLLM's two sets as the model prices them."""
    m = meas.max_loras
    realisable = [s.counts(m) for s in STRATEGIES.values() if s.vllm in (Vllm.DEFAULT, Vllm.SPECIALISE)]
    note = ("vLLM captures max_loras+1 or, with --specialize-active-lora, powers of two: "
            + ("the auto set is one of those" if chosen.counts in realisable else "the auto set is lorabench's own"))
    flags = meas.vllm.flags
    if flags is None:  # the report realises nothing here (every measured strategy wrong): the model's rule
        specialise = chosen.counts != strategy(BASELINE).counts(m) and _pow2_pays(base)
        flags = run_flags(view.compared.iloc[0], m, specialise)
        note += "; the flags give the better of vLLM's two as the model prices them"
        if specialise and not verified_pow2(view.verdicts):
            note += "; " + UNVERIFIED_POW2
        return VllmAdvice(flags, note)
    note += "; the flags are the report's (from what was measured)"
    if meas.vllm.note != VLLM_NOTE:
        note += f": {meas.vllm.note}"
    pow2 = meas.comparison.covers.get(SPECIALISED)
    if pow2 is None or pow2.status != COMPLETE:
        p, mx = base.get(SPECIALISED), base.get(BASELINE)
        if p is not None and mx is not None and _pow2_pays(base):
            note += (f"; pow2 is not measured at every concurrency max is: the model predicts it "
                     f"{100 * (1 - p.expected_ms / mx.expected_ms):.1f} % faster than max, so measure it "
                     f"before enabling --specialize-active-lora")
    return VllmAdvice(flags, note)


def _pow2_pays(base: dict[str, Plan]) -> bool:
    """vLLM's flag follows the rule ``lorabench report`` uses: pow2 at least PAYS faster than max."""
    p, m = base.get(SPECIALISED), base.get(BASELINE)
    return p is not None and m is not None and p.expected_ms <= m.expected_ms * (1 - PAYS)
