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
nothing. vLLM can realise ``max`` (its default) and ``pow2`` (``--specialize-active-lora``);
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


def vllm_flags(max_loras: int, rank: int, specialise: bool) -> str:
    flags = f"--enable-lora --max-loras {max_loras} --max-lora-rank {rank}"
    return flags + (" --specialize-active-lora" if specialise else "")


def recommend(df: pd.DataFrame, workloads: list[str] | None = None,
              planned: dict[tuple[str, int, str], tuple[int, ...]] | None = None) -> dict:
    """The report's recommendation: one entry per (kernels, max_loras, workload), each from that
    triple's ``Comparison`` (``lorabench.analysis.compare``: which strategies are compared with max
    over which concurrencies). ``planned``: the run's plan, as ``lorabench.analysis.compare.compare`` takes it."""
    df = with_columns(df)
    first = ok_points(df).iloc[0]  # failed rows may lack the model's columns
    rank = int(first["rank"])
    recs = [measured_choice(df, cmp) for cmp in compare(df, workloads, planned)]
    return _clean({
        "run_id": first.run_id, "device": first.device, "gpu_name": first.gpu_name, "model": first.model,
        "layers": _int(first.layers), "rank": rank, "dtype": first["dtype"],
        "pays_threshold_pct": 100 * PAYS,
        "basis": BASIS,
        "recommendations": recs,
    })


BASIS = ("expected step time = sum_n P(n|c) * median step(c, n), averaged over the swept concurrencies; "
         "a strategy is compared with max only over the concurrencies both have every needed point of")


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
        "kernels": k, "max_loras": int(m), "workload": w, "strategy": None,
        "fastest_measured": min(score, key=score.get) if score else None,
        "captured_counts": None, "capture_sizes": [int(x) for x in first.capture_sizes],
        "expected_step_ms": None, "expected_step_ms_max": by_c.get(BASELINE), "gain_over_max_pct": None,
        "gain_by_strategy_pct": {s: round(100 * float(v), 2) for s, v in gain.items()},
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
    pays = bool(gain[fastest_ok] >= PAYS)
    chosen = fastest_ok if pays or BASELINE not in passing else BASELINE
    over = "on average over concurrency" if cmp.grid == cmp.planned else f"on average over {c_list(cmp.grid)}"
    reason = (f"{fastest_ok} is {100 * gain[fastest_ok]:.1f} % faster than max {over} "
              + ("(>= the 2 % that pays for extra graphs)" if pays else "(< 2 %: within noise, extra graphs do not pay)"))
    if fastest_ok == BASELINE:
        reason = "max is the fastest" + (" strategy that passed its correctness check" if rejected else "")
        if len(cands) == 1 and len(cmp.covers) > 1:
            reason = "max is kept: no other strategy is measured at every concurrency max covers"
    if best != fastest_ok:
        reason = f"{best} measured fastest but failed its correctness check, so it is not proposed; " + reason
    if chosen != BASELINE and not pays:
        reason += "; max failed its correctness check"
    reason += _qualify(cmp)
    c_row = cfg.loc[(k, m, chosen)]
    if backend_of(k) == "vllm" and chosen in VLLM_STRATEGIES:
        realises = chosen
    else:
        vllm_best = max((s for s in VLLM_STRATEGIES if s in passing), key=lambda s: gain[s], default=VLLM_DEFAULT)
        realises = SPECIALISED if vllm_best == SPECIALISED and gain[SPECIALISED] >= PAYS else VLLM_DEFAULT
    note = VLLM_NOTE
    if len(broken_pow2):
        same = broken_pow2[broken_pow2.max_loras == m]
        b = (same if len(same) else broken_pow2).iloc[0]
        note = (f"--specialize-active-lora is not proposed: vLLM's own pow2 at max_loras {int(b.max_loras)} "
                f"failed its correctness check in this run: {b.check_detail}")
        realises = VLLM_DEFAULT if realises == SPECIALISED else realises
    elif realises == SPECIALISED and not verified_pow2(checked):
        note = UNVERIFIED_POW2
    return {
        **rec, "strategy": chosen, "captured_counts": c_row.captured_counts,
        "expected_step_ms": by_c[chosen], "gain_over_max_pct": round(100 * float(gain[chosen]), 2),
        "graph_mem_bytes": _int(c_row.graph_mem_bytes), "startup_s": round(float(c_row.startup_s), 3),
        "num_graphs": _int(c_row.num_graphs), "reason": reason,
        "vllm": {"flags": vllm_flags(int(m), rank, realises == SPECIALISED), "realises": realises, "note": note},
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
                       f"than max, and it is not comparable at {c_list(cv.lacks)}")
        elif cv.status == NOT_COMPARABLE and s != BASELINE:
            out.append(f"{s} is not comparable: it is measured at no concurrency max covers")
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
