"""The report's recommendation: per (kernels, max_loras, workload), the strategy with the lowest
expected step time averaged over the concurrencies it is compared over, what it gains over
``max``, what it costs in graph memory and startup, and the vLLM flags that realise it
(``MeasuredDecision``).

Which strategies are compared over which points is ``lorabench.analysis.compare``'s: a strategy is
compared with max only over the concurrencies where both have every fixed point the workload
needs; only strategies measured at every concurrency max covers are proposed, the others are
shown with their coverage and their gain where they have points, or as not comparable.
``lorabench recommend`` prints the same decision next to strategy auto.

A strategy is only recommended over ``max`` when it is at least ``PAYS`` faster: below that the
difference is within run-to-run noise, and specialisation would spend memory and startup for
nothing. With the run's samples, "at least" means the lower end of the 95 % interval of its gain
(``Comparison.gain_interval``) clears ``PAYS``; when it does not, the answer is the fewest graphs
(max), marked ``inconclusive`` when the interval still reaches past ``PAYS``, with the steps per
point that would settle it. A run that kept no samples is decided on the medians alone, as before,
and says so. vLLM can realise ``max`` (its default) and ``pow2`` (``--specialize-active-lora``);
``dense`` and explicit lists are lorabench's own, so the vLLM flags follow the better of those two
(for ``--kernels vllm``, the chosen strategy itself).

A configuration whose correctness check failed (``correct`` False) is never proposed; it is listed
under ``rejected`` with the check's detail, and a failed vLLM ``pow2`` anywhere in the run vetoes
``--specialize-active-lora``. Gains stay relative to ``max``'s timing, measured even when wrong.
"""

import pandas as pd

from lorabench.analysis.compare import Comparison
from lorabench.analysis.decision import PAYS_PCT, Basis, Costs, MeasuredDecision, Rejection
from lorabench.analysis.intervals import Gain
from lorabench.analysis.recommendation_json import report_json
from lorabench.analysis.view import RunView
from lorabench.analysis.vllm import (
    SPECIALISED,
    UNVERIFIED_POW2,
    VLLM_DEFAULT,
    VLLM_NOTE,
    VLLM_STRATEGIES,
    VllmAdvice,
    run_flags,
    verified_pow2,
    vllm_specialised,
)
from lorabench.config.backends import backend_of
from lorabench.config.strategies import BASELINE


def recommend(df: pd.DataFrame, workloads: list[str] | None = None,
              planned: dict[tuple[str, int, str], tuple[int, ...]] | None = None, samples=None) -> dict:
    """recommendation.json's report part for rows in hand: ``measured_decisions`` of their view.
    ``planned``: the run's plan, as ``lorabench.analysis.compare.compare`` takes it; ``samples``:
    the run's samples (``lorabench.analysis.points.run_samples``)."""
    view = RunView.of(df, samples, planned=planned)
    return report_json(view, measured_decisions(view, workloads))


def measured_decisions(view: RunView, workloads: list[str] | None = None) -> list[MeasuredDecision]:
    """One decision per (kernels, max_loras, workload) of the run, each from its ``Comparison``."""
    costs = config_costs(view)
    return [measured_decision(view, cmp, costs) for cmp in view.comparisons(tuple(workloads) if workloads else None)]


def config_costs(view: RunView) -> dict[tuple[str, int, str], Costs]:
    """(kernels, max_loras, strategy) -> what the configuration's graphs cost."""
    return {(r.kernels, int(r.max_loras), r.strategy): Costs(
        list(r.captured_counts), _int(r.num_graphs), _int(r.graph_mem_bytes), float(r.startup_s),
        _int(r.num_mixed_graphs), _int(r.mixed_graph_mem_bytes), _float(r.mixed_capture_s))
        for r in view.configs.itertuples()}


def _gain(cmp: Comparison, strategy: str) -> Gain:
    if strategy == BASELINE:
        return Gain(100 * float(cmp.gain(strategy)))
    return Gain(100 * float(cmp.gain(strategy)), cmp.gain_interval(strategy), cmp.interval_why(strategy), cmp.steps(strategy))


def measured_decision(view: RunView, cmp: Comparison, costs: dict[tuple[str, int, str], Costs]) -> MeasuredDecision:
    """Among the strategies the run measured, what to run at cmp's (kernels, max_loras, workload):
    the fastest that passed its check, covers every concurrency max covers, and is at least PAYS
    faster than max; else max. Strategies measured at part of max's concurrencies are shown with
    their gain there and never proposed; those sharing none are not comparable."""
    k, m = cmp.kernels, cmp.max_loras
    wrong = view.wrong
    bad = wrong[(wrong.kernels == k) & (wrong.max_loras == m)]
    comparable = [s for s, cv in cmp.covers.items() if cv.comparable]
    score = {s: cmp.covers[s].mean_ms() for s in cmp.candidates()}
    known = dict(comparison=cmp, capture_sizes=tuple(int(x) for x in view.first.capture_sizes),
                 fastest=min(score, key=score.get) if score else None,
                 gains={s: _gain(cmp, s) for s in sorted(comparable)},
                 rejected=tuple(Rejection(r.strategy, r.check_detail) for r in bad.itertuples()),
                 max_costs=costs.get((k, m, BASELINE)))
    if not cmp.grid:
        return MeasuredDecision(vllm=VllmAdvice(None, f"nothing to realise: {cmp.why_not_comparable()}"), **known)
    passing = {s: v for s, v in score.items() if s not in set(bad.strategy)}
    if not passing:
        return MeasuredDecision(vllm=VllmAdvice(None, "nothing to realise: every measured strategy is wrong"), **known)
    gains = known["gains"]
    ranked = tuple(sorted(passing, key=passing.get))
    others = [s for s in passing if s != BASELINE]
    lacking = [s for s in others if gains[s].interval is None]
    cleared, open_, settle, why = (), (), None, None
    if not others:
        basis = Basis.NONE
    elif lacking:
        basis, why = Basis.MEDIANS, gains[lacking[0]].why
        cleared = tuple(s for s in others if gains[s].clears(PAYS_PCT))
    else:
        basis = Basis.INTERVAL
        cleared = tuple(s for s in others if gains[s].clears(PAYS_PCT))
        open_ = tuple(s for s in others if s not in cleared and gains[s].open(PAYS_PCT))
        if not cleared and open_:
            settle = gains[max(open_, key=lambda s: gains[s].interval.estimate)].settle(PAYS_PCT)
    if basis is Basis.INTERVAL and cleared:
        chosen = min(cleared, key=passing.get)
    elif basis is not Basis.INTERVAL and ranked[0] in cleared:
        chosen = ranked[0]
    else:
        chosen = ranked[0] if BASELINE not in passing else BASELINE
    vllm = _vllm(view, k, m, chosen, passing, gains, cleared)
    return MeasuredDecision(vllm=vllm, chosen=chosen, ranked=ranked, basis=basis, why_medians=why, cleared=cleared,
                            open=open_, settle=settle, costs=costs[(k, m, chosen)], **known)


def _vllm(view: RunView, kernels: str, max_loras: int, chosen: str, passing: dict, gains: dict[str, Gain],
          cleared: tuple[str, ...]) -> VllmAdvice:
    """The flags that realise the choice: vLLM's own kernels run the chosen set when vLLM has it;
    otherwise the better of vLLM's two sets, pow2 only when it pays; never pow2 where a vllm/pow2
    configuration of the run failed its check."""
    if backend_of(kernels) == "vllm" and chosen in VLLM_STRATEGIES:
        realises = chosen
    else:
        vllm_best = max((s for s in VLLM_STRATEGIES if s in passing), key=lambda s: gains[s].pct, default=VLLM_DEFAULT)
        realises = SPECIALISED if vllm_best == SPECIALISED and SPECIALISED in cleared else VLLM_DEFAULT
    note = VLLM_NOTE
    broken_pow2 = view.wrong[vllm_specialised(view.wrong)]
    if len(broken_pow2):
        same = broken_pow2[broken_pow2.max_loras == max_loras]
        b = (same if len(same) else broken_pow2).iloc[0]
        note = (f"--specialize-active-lora is not proposed: vLLM's own pow2 at max_loras {int(b.max_loras)} "
                f"failed its correctness check in this run: {b.check_detail}")
        realises = VLLM_DEFAULT if realises == SPECIALISED else realises
    elif realises == SPECIALISED and not verified_pow2(view.verdicts):
        note = UNVERIFIED_POW2
    return VllmAdvice(run_flags(view.first, max_loras, realises == SPECIALISED), note, realises)


def _int(v):
    return None if v is None or pd.isna(v) else int(v)


def _float(v):
    return None if v is None or pd.isna(v) else float(v)
