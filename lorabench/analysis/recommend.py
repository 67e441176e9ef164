"""Recommended configurations: per (kernels, max_loras, workload), the strategy with the lowest
expected step time averaged over the concurrencies it is compared over, what it gains over
``max``, what it costs in graph memory and startup, and the vLLM flags that realise it.

Which strategies are compared over which points is ``lorabench.analysis.compare``'s: a strategy is
compared with max only over the concurrencies where both have every fixed point the workload
needs; only strategies measured at every concurrency max covers are proposed, the others are
shown with their coverage and their gain where they have points, or as not comparable.
``lorabench recommend`` prints the same entry (``measured_choice``) next to strategy auto.

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

import numpy as np
import pandas as pd

from lorabench.analysis.compare import (
    NOT_COMPARABLE,
    PARTIAL,
    Comparison,
    c_list,
    compare,
    resampler,
    steps_hint,
)
from lorabench.analysis.points import configs, ok_points, verdicts, with_columns
from lorabench.config.backends import backend_of
from lorabench.config.strategies import BASELINE, STRATEGIES, Vllm

PAYS = 0.02  # a strategy must be >= 2 % faster than max to be worth its graphs
VLLM_DEFAULT = next(s.name for s in STRATEGIES.values() if s.vllm is Vllm.DEFAULT)  # max
SPECIALISED = next(s.name for s in STRATEGIES.values() if s.vllm is Vllm.SPECIALISE)  # pow2: --specialize-active-lora
VLLM_STRATEGIES = (VLLM_DEFAULT, SPECIALISED)  # the sets vLLM's flags can realise
VLLM_NOTE = "vLLM captures max_loras+1 (and powers of two with --specialize-active-lora): it counts the base slot too"


UNVERIFIED_POW2 = (
    "check before enabling: vLLM 0.33's --specialize-active-lora drops adapter updates on batches that mix "
    "base and adapter requests (lorabench check on an H200, BENCHMARKS.md); this run has no passing vllm/pow2 "
    "configuration to show your vLLM is free of it (lorabench check --kernels vllm --strategy pow2)"
)


def vllm_specialised(rows: pd.DataFrame) -> pd.Series:
    """Which rows are vLLM's own kernels under --specialize-active-lora (vllm/pow2)."""
    return (rows.kernels.map(backend_of) == "vllm") & (rows.strategy == SPECIALISED)


def verified_pow2(checked: pd.DataFrame) -> bool:
    """Did a vllm/pow2 configuration of this run pass its check?"""
    return bool((vllm_specialised(checked) & checked.correct.map(lambda v: v is True)).any())


def vllm_flags(max_loras: int, rank: int, specialise: bool, tp: int = 1, fully_sharded: bool = False) -> str:
    flags = f"--enable-lora --max-loras {max_loras} --max-lora-rank {rank}"
    flags += f" --tensor-parallel-size {tp}" if tp > 1 else ""
    flags += " --fully-sharded-loras" if fully_sharded else ""
    return flags + (" --specialize-active-lora" if specialise else "")


def tp_of(row) -> int:
    """The row's tensor-parallel size (1 for runs from before the column)."""
    tp = row.get("tp")
    return 1 if tp is None or pd.isna(tp) else int(tp)


def fully_sharded_of(row) -> bool:
    return row.get("fully_sharded_loras") is True or row.get("fully_sharded_loras") == 1


def recommend(df: pd.DataFrame, workloads: list[str] | None = None,
              planned: dict[tuple[str, int, str], tuple[int, ...]] | None = None, samples=None) -> dict:
    """The report's recommendation: one entry per (kernels, max_loras, workload), each from that
    triple's ``Comparison`` (``lorabench.analysis.compare``: which strategies are compared with max
    over which concurrencies). ``planned``: the run's plan, as ``lorabench.analysis.compare.compare`` takes it;
    ``samples``: the run's samples (``lorabench.analysis.points.run_samples``) or a Resampler over them."""
    df = with_columns(df)
    first = ok_points(df).iloc[0]  # failed rows may lack the model's columns
    rank = int(first["rank"])
    recs = [measured_choice(df, cmp) for cmp in compare(df, workloads, planned, samples=resampler(samples))]
    return _clean({
        "run_id": first.run_id, "device": first.device, "gpu_name": first.gpu_name, "model": first.model,
        "layers": _int(first.layers), "rank": rank, "dtype": first["dtype"], "tp": tp_of(first),
        "allreduce": "left out" if tp_of(first) > 1 else None,
        "gpu_uuids": sorted({r["gpu_uuid"] for r in recs if r["gpu_uuid"]}),
        "pays_threshold_pct": 100 * PAYS,
        "pays_rule": PAYS_RULE,
        "basis": BASIS,
        "recommendations": recs,
    })


BASIS = ("expected step time = sum_n P(n|c) * median step(c, n), averaged over the swept concurrencies; "
         "a strategy is compared with max only over the concurrencies both have every needed point of, "
         "measured on the same GPU (max's)")
PAYS_RULE = (f"a strategy other than max is recommended only when the lower end of the 95 % interval of its gain "
             f"over max clears {100 * PAYS:g} % (each point's median resampled independently, percentile bootstrap); "
             f"otherwise max, the fewest graphs (inconclusive when the interval reaches past {100 * PAYS:g} %); "
             f"a run that kept no samples is decided on the medians alone")
MEDIANS_ONLY = "decided on medians alone ({why})"


def _decide(cmp: Comparison, passing: dict[str, float], gain: dict[str, float]) -> dict:
    """Which of the passing complete strategies pays for its graphs, by the interval of its gain
    when the samples give one to every one of them, else by the medians. Returns ``pays`` (the
    strategies that do), ``on`` ("interval" or "medians"), ``why`` (no interval: why),
    ``inconclusive`` and ``more`` (what more measuring would take)."""
    others = [s for s in passing if s != BASELINE]
    ivs = {s: cmp.gain_interval(s) for s in others}
    missing = [s for s in others if ivs[s] is None]
    if missing or not others:
        why = cmp.interval_why(missing[0]) if missing else None
        return {"pays": [s for s in others if gain[s] >= PAYS], "on": "medians", "why": why,
                "inconclusive": False, "more": None, "intervals": ivs}
    pays = [s for s in others if ivs[s].low >= 100 * PAYS]
    open_ = [s for s in others if s not in pays and ivs[s].high >= 100 * PAYS]
    more = None
    if not pays and open_:
        top = max(open_, key=lambda s: ivs[s].estimate)
        more = steps_hint(ivs[top], cmp.steps(top), 100 * PAYS)
    return {"pays": pays, "on": "interval", "why": None, "inconclusive": bool(not pays and open_), "more": more,
            "intervals": ivs}


def measured_choice(df: pd.DataFrame, cmp: Comparison) -> dict:
    """Among the strategies the run measured, what to run at cmp's (kernels, max_loras, workload):
    the fastest that passed its check, covers every concurrency max covers, and is at least PAYS
    faster than max; else max. Strategies measured at part of max's concurrencies are shown with
    their gain there and never proposed; those sharing none are not comparable. ``lorabench report``
    writes this; ``lorabench recommend`` prints it next to strategy auto and takes its vLLM flags."""
    k, m, w = cmp.kernels, cmp.max_loras, cmp.workload
    cfg = configs(df).set_index(["kernels", "max_loras", "strategy"])
    checked = verdicts(df)
    wrong = checked[checked.correct.map(lambda v: v is False)]
    first = ok_points(df).iloc[0]
    rank = int(first["rank"])
    broken_pow2 = wrong[vllm_specialised(wrong)]
    bad = wrong[(wrong.kernels == k) & (wrong.max_loras == m)]
    rejected = [{"strategy": r.strategy, "reason": r.check_detail} for r in bad.itertuples()]
    comparable = [s for s, cv in cmp.covers.items() if cv.comparable]
    gain = {s: cmp.gain(s) for s in sorted(comparable)}
    cands = cmp.candidates()
    score = {s: cmp.covers[s].mean_ms() for s in cands}
    by_c = {s: {str(c): round(v, 4) for c, v in sorted(cmp.covers[s].by_c.items()) if c in cmp.grid} for s in comparable}
    key = (k, m, BASELINE)
    c_max = cfg.loc[key] if key in cfg.index else None
    rec = {
        "kernels": k, "max_loras": int(m), "workload": w, "gpu_uuid": cmp.gpu_uuid, "strategy": None,
        "fastest_measured": min(score, key=score.get) if score else None,
        "captured_counts": None, "capture_sizes": [int(x) for x in first.capture_sizes],
        "expected_step_ms": None, "expected_step_ms_max": by_c.get(BASELINE), "gain_over_max_pct": None,
        "gain_by_strategy_pct": {s: round(100 * float(v), 2) for s, v in gain.items()},
        "gain_interval_pct": None, "versus_max": {s: cmp.versus_max(s) for s in comparable if s != BASELINE},
        "inconclusive": False, "more_measuring": None, "decided_on": None,
        "graph_mem_bytes": None, "graph_mem_bytes_max": None if c_max is None else _int(c_max.graph_mem_bytes),
        "startup_s": None, "startup_s_max": None if c_max is None else round(float(c_max.startup_s), 3),
        "num_graphs": None, "num_graphs_max": None if c_max is None else _int(c_max.num_graphs),
        "rejected": rejected,
        "comparison": cmp.to_dict(),
    }
    if not cmp.grid:
        why = cmp.why_not_comparable()
        return {**rec, "reason": f"not comparable: {why}",
                "vllm": {"flags": None, "realises": None, "note": f"nothing to realise: {why}"}}
    passing = {s: v for s, v in score.items() if s not in set(bad.strategy)}
    if not passing:
        why = ("no configuration passed its correctness check (see rejected)" if cands
               else "no strategy that passed its correctness check has every point max has")
        return {**rec, "reason": why + _qualify(cmp),
                "vllm": {"flags": None, "realises": None, "note": "nothing to realise: every measured strategy is wrong"}}
    best = rec["fastest_measured"]
    fastest_ok = min(passing, key=passing.get)
    d = _decide(cmp, passing, gain)
    ivs = d["intervals"]
    over = "on average over concurrency" if cmp.grid == cmp.planned else f"on average over {c_list(cmp.grid)}"
    if d["on"] == "medians":
        pays = fastest_ok in d["pays"]
        chosen = fastest_ok if pays or BASELINE not in passing else BASELINE
        reason = (f"{fastest_ok} is {100 * gain[fastest_ok]:.1f} % faster than max {over} "
                  + ("(>= the 2 % that pays for extra graphs)" if pays else "(< 2 %: within noise, extra graphs do not pay)"))
    else:
        cleared = {s: passing[s] for s in d["pays"]}
        pays = bool(cleared)
        chosen = min(cleared, key=cleared.get) if pays else fastest_ok if BASELINE not in passing else BASELINE
        shown = chosen if chosen != BASELINE else fastest_ok
        reason = f"{shown} vs max {over}: {cmp.versus_max(shown)}" if shown != BASELINE else ""
        so_max = ", so max, the fewest graphs" if chosen == BASELINE else ""
        if shown in cleared:
            reason += f"; the interval's low end clears the {100 * PAYS:g} % that pays for extra graphs"
        elif shown != BASELINE and ivs[shown].high >= 100 * PAYS:
            reason += (f"; inconclusive: the interval's low end does not clear the {100 * PAYS:g} % that pays for "
                       f"extra graphs{so_max}")
        elif shown != BASELINE:
            reason += f"; the whole interval is below the {100 * PAYS:g} % that pays for extra graphs{so_max}"
        if pays and fastest_ok != chosen and fastest_ok != BASELINE:
            reason += (f"; {fastest_ok} measured faster ({cmp.versus_max(fastest_ok)}) but its interval's low end "
                       f"does not clear {100 * PAYS:g} %")
    if fastest_ok == BASELINE:
        reason = "max is the fastest" + (" strategy that passed its correctness check" if rejected else "")
        if len(cands) == 1 and len(cmp.covers) > 1:
            reason = "max is kept: no other strategy is measured at every concurrency max covers"
        elif d["on"] == "interval" and d["inconclusive"]:
            top = max((s for s in ivs if ivs[s].high >= 100 * PAYS), key=lambda s: ivs[s].estimate)
            reason += (f"; inconclusive: {top} vs max {over}: {cmp.versus_max(top)}, "
                       f"whose interval reaches past {100 * PAYS:g} %")
    if best != fastest_ok:
        reason = f"{best} measured fastest but failed its correctness check, so it is not proposed; " + reason
    if chosen != BASELINE and not pays:
        reason += "; max failed its correctness check"
    if d["more"]:
        reason += f"; {d['more']}"
    if d["on"] == "medians" and len(passing) > 1:
        reason += "; " + MEDIANS_ONLY.format(why=d["why"])
    reason += _qualify(cmp)
    inconclusive = d["inconclusive"] and chosen == BASELINE
    rec.update(inconclusive=inconclusive, more_measuring=d["more"] if inconclusive else None,
               decided_on=("the 95 % interval of the gain" if d["on"] == "interval" else
                           MEDIANS_ONLY.format(why=d["why"]) if d["why"] else "nothing to decide: no other strategy"))
    c_row = cfg.loc[(k, m, chosen)]
    if backend_of(k) == "vllm" and chosen in VLLM_STRATEGIES:
        realises = chosen
    else:
        vllm_best = max((s for s in VLLM_STRATEGIES if s in passing), key=lambda s: gain[s], default=VLLM_DEFAULT)
        realises = SPECIALISED if vllm_best == SPECIALISED and SPECIALISED in d["pays"] else VLLM_DEFAULT
    note = VLLM_NOTE
    if len(broken_pow2):
        same = broken_pow2[broken_pow2.max_loras == m]
        b = (same if len(same) else broken_pow2).iloc[0]
        note = (f"--specialize-active-lora is not proposed: vLLM's own pow2 at max_loras {int(b.max_loras)} "
                f"failed its correctness check in this run: {b.check_detail}")
        realises = VLLM_DEFAULT if realises == SPECIALISED else realises
    elif realises == SPECIALISED and not verified_pow2(checked):
        note = UNVERIFIED_POW2
    iv = cmp.gain_interval(chosen) if chosen != BASELINE else None
    return {
        **rec, "strategy": chosen, "captured_counts": c_row.captured_counts,
        "expected_step_ms": by_c[chosen], "gain_over_max_pct": round(100 * float(gain[chosen]), 2),
        "gain_interval_pct": None if iv is None else iv.to_dict(),
        "graph_mem_bytes": _int(c_row.graph_mem_bytes), "startup_s": round(float(c_row.startup_s), 3),
        "num_graphs": _int(c_row.num_graphs), "reason": reason,
        "vllm": {"flags": vllm_flags(int(m), rank, realises == SPECIALISED, tp_of(first), fully_sharded_of(first)), "realises": realises, "note": note},
    }


def _qualify(cmp: Comparison) -> str:
    """What the decision leaves out: max's own missing concurrencies, strategies measured at part
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


def _clean(obj):
    """JSON-safe: NaN and missing values become null."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    if obj is None or (isinstance(obj, float) and np.isnan(obj)):
        return None
    return obj


def _int(v):
    return None if v is None or pd.isna(v) else int(v)
