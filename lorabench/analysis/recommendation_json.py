"""recommendation.json's entries, from the decisions (``lorabench.analysis.decision``) and their
reasons (``lorabench.analysis.reasons``). ``SCHEMA`` numbers the file's layout: 2 is the first
to say it (files without ``schema`` are 1, the same fields).

The file (``lorabench report`` writes the top level and ``recommendations``; ``lorabench
recommend`` adds ``auto``, ``recommend --adapters`` ``residency``; each keeps the others):

- ``schema``; ``run_id``, ``device``, ``gpu_name``, ``model``, ``layers``, ``rank``, ``dtype``,
  ``tp``, ``allreduce``; ``gpu_uuids`` (the GPUs compared on); ``pays_threshold_pct`` (2),
  ``pays_rule`` and ``basis`` (the rules in words); ``coverage`` (an incomplete run's, else null);
- ``recommendations``: per (kernels, max_loras, workload), the report's choice
  (``measured_json``): ``strategy`` (null: nothing proposed), ``fastest_measured``,
  ``captured_counts``, ``capture_sizes``, ``expected_step_ms`` and ``expected_step_ms_max`` (by
  concurrency), ``gain_over_max_pct``, ``gain_by_strategy_pct``, ``gain_interval_pct``
  (estimate, low, high, level), ``versus_max`` (words), ``inconclusive``, ``more_measuring``,
  ``decided_on``, ``graph_mem_bytes``, ``startup_s``, ``num_graphs`` and, with mixed steps, the
  PIECEWISE graphs' ``num_mixed_graphs``, ``mixed_graph_mem_bytes``, ``mixed_capture_s`` (null
  without; each with ``_max``),
  ``rejected`` (strategy, reason), ``comparison`` (``Comparison.to_dict``), ``reason``, ``vllm``
  (flags, realises, note);
- ``auto``: workload -> per (kernels, max_loras), strategy auto (``auto_json``): ``kernels``,
  ``max_loras``, ``workload``, ``capture_sizes``, ``concurrency``, ``budgets``, ``measured``
  (the report's strategy, captured_counts, gain_over_max_pct, reason, vllm_flags, comparison),
  ``auto`` (counts, expected_ms, expected_ms_by_c, lora_graphs, graph_mem_bytes, startup_s,
  model_values; null: no set), ``reason``, ``gain_interval_pct``, ``inconclusive``,
  ``more_measuring``, ``decided_on``, ``baselines`` (max, pow2, dense priced: the same fields,
  fits_budgets, auto_gain_pct, measured), ``vllm`` (flags, note), ``validate``;
- ``residency``: "WORKLOAD over N adapters" -> per kernels (``residency_json``): ``kernels``,
  ``workload``, ``adapters``, ``max_cpu_loras``, ``output_tokens`` (text: N or LO-HI), ``clients``,
  ``gpu_memory_budget_bytes``, ``at`` (max_loras -> chosen, reason, gain_interval_pct),
  ``configs`` (every configuration priced: ``priced_json``), ``chosen``, ``versus_best``,
  ``versus_card``, ``reason``, ``notes``, ``vllm``, ``validate``.
"""

import numpy as np
import pandas as pd

from lorabench.analysis.costmodel import Plan
from lorabench.analysis.decision import (PAYS_PCT, AutoDecision, CacheChoice, MeasuredDecision, ResidencyDecision,
                                         SetChoice)
from lorabench.analysis.intervals import Gain, versus
from lorabench.analysis.reasons import BASIS, MEDIANS_ONLY, decided_on, pays_rule, reason, versus_card
from lorabench.analysis.residency_price import Priced
from lorabench.analysis.search import fits
from lorabench.analysis.view import RunView
from lorabench.analysis.vllm import tp_of
from lorabench.config.strategies import BASELINE

SCHEMA = 2


def report_json(view: RunView, decisions: list[MeasuredDecision]) -> dict:
    """The file's top level and ``recommendations``: what ``lorabench report`` writes."""
    first = view.first
    recs = [measured_json(d) for d in decisions]
    return _clean({
        "schema": SCHEMA, "run_id": first.run_id, "device": first.device, "gpu_name": first.gpu_name,
        "model": first.model, "layers": _int(first.layers), "rank": int(first["rank"]), "dtype": first["dtype"],
        "tp": tp_of(first), "allreduce": "left out" if tp_of(first) > 1 else None,
        "gpu_uuids": sorted({r["gpu_uuid"] for r in recs if r["gpu_uuid"]}),
        "pays_threshold_pct": PAYS_PCT, "pays_rule": pays_rule(PAYS_PCT), "basis": BASIS,
        "coverage": view.coverage.to_dict() if view.coverage else None,
        "recommendations": recs,
    })


def _interval(g: Gain | None) -> dict | None:
    return None if g is None or g.interval is None else g.interval.to_dict()


def measured_json(d: MeasuredDecision) -> dict:
    cmp, chosen = d.comparison, d.chosen
    comparable = [s for s, cv in cmp.covers.items() if cv.comparable]
    by_c = {s: {str(c): round(v, 4) for c, v in sorted(cmp.covers[s].by_c.items()) if c in cmp.grid} for s in comparable}
    costs, mc = (d.costs if chosen else None), d.max_costs
    return {
        "kernels": d.kernels, "max_loras": int(d.max_loras), "workload": d.workload, "gpu_uuid": cmp.gpu_uuid,
        "strategy": chosen, "fastest_measured": d.fastest, "captured_counts": costs.counts if costs else None,
        "capture_sizes": list(d.capture_sizes), "expected_step_ms": by_c[chosen] if chosen else None,
        "expected_step_ms_max": by_c.get(BASELINE),
        "gain_over_max_pct": round(d.gains[chosen].pct, 2) if chosen else None,
        "gain_by_strategy_pct": {s: round(g.pct, 2) for s, g in d.gains.items()},
        "gain_interval_pct": _interval(d.gains[chosen]) if chosen not in (None, BASELINE) else None,
        "versus_max": {s: versus(d.gains[s], cmp.margin_pct) for s in comparable if s != BASELINE},
        "inconclusive": d.inconclusive, "more_measuring": d.more_measuring, "decided_on": decided_on(d),
        "graph_mem_bytes": costs.graph_mem_bytes if costs else None,
        "graph_mem_bytes_max": mc.graph_mem_bytes if mc else None,
        "startup_s": round(costs.startup_s, 3) if costs else None,
        "startup_s_max": round(mc.startup_s, 3) if mc else None,
        "num_graphs": costs.graphs if costs else None, "num_graphs_max": mc.graphs if mc else None,
        "num_mixed_graphs": costs.mixed_graphs if costs else None, "num_mixed_graphs_max": mc.mixed_graphs if mc else None,
        "mixed_graph_mem_bytes": costs.mixed_graph_mem_bytes if costs else None,
        "mixed_graph_mem_bytes_max": mc.mixed_graph_mem_bytes if mc else None,
        "mixed_capture_s": _round3(costs.mixed_capture_s) if costs else None,
        "mixed_capture_s_max": _round3(mc.mixed_capture_s) if mc else None,
        "rejected": [{"strategy": r.strategy, "reason": r.why} for r in d.rejected],
        "comparison": cmp.to_dict(),
        "reason": reason(d),
        "vllm": {"flags": d.vllm.flags, "realises": d.vllm.realises, "note": d.vllm.note},
    }


def plan_json(plan: Plan) -> dict:
    return {"counts": plan.counts, "expected_ms": round(plan.expected_ms, 4),
            "expected_ms_by_c": {str(c): round(v, 4) for c, v in plan.expected_ms_by_c.items()},
            "lora_graphs": plan.graphs, "graph_mem_bytes": None if plan.graph_mem_bytes is None else int(plan.graph_mem_bytes),
            "startup_s": None if plan.startup_s is None else round(plan.startup_s, 3),
            "model_values": plan.sources}


def auto_decided_on(d: AutoDecision) -> str | None:
    if d.specialised:
        return ("the 95 % interval of the predicted gain" if d.gain.interval is not None
                else MEDIANS_ONLY.format(why=d.gain.why or "no samples given"))
    return "the report's (a measured set)" if d.chosen is not None and d.chosen.counts != [d.max_loras] else None


def auto_json(d: AutoDecision) -> dict:
    meas = measured_json(d.measured)
    entry = {"kernels": d.kernels, "max_loras": int(d.max_loras), "workload": d.workload,
             "capture_sizes": list(d.capture_sizes), "concurrency": list(d.concurrency),
             "budgets": {"graph_memory_bytes": d.memory_bytes, "startup_s": d.startup_s},
             "measured": {x: meas[x] for x in ("strategy", "captured_counts", "gain_over_max_pct", "reason")}
             | {"vllm_flags": meas["vllm"]["flags"], "comparison": meas["comparison"]}}
    if d.chosen is None:
        return {**entry, "auto": None, "reason": reason(d)}
    measured = meas["comparison"]["strategies"]
    baselines = {}
    for name, plan in d.baselines.items():
        baselines[name] = {**plan_json(plan), "fits_budgets": fits(plan, d.memory_bytes, d.startup_s),
                           "auto_gain_pct": round(100 * (1 - d.chosen.expected_ms / plan.expected_ms), 2)}
        if name in measured:
            baselines[name]["measured"] = {x: measured[name][x] for x in ("status", "compared_over", "gain_over_max_pct")}
    return {**entry, "auto": plan_json(d.chosen), "reason": reason(d), "gain_interval_pct": _interval(d.gain),
            "inconclusive": d.inconclusive, "more_measuring": d.more_measuring, "decided_on": auto_decided_on(d),
            "baselines": baselines, "vllm": {"flags": d.vllm.flags, "note": d.vllm.note}, "validate": d.validate}


def priced_json(p: Priced) -> dict:
    return {"kernels": p.kernels, "max_loras": p.max_loras, "strategy": p.strategy, "counts": p.counts,
            "expected_step_ms": round(p.step_ms, 4), "decode_ms": round(p.decode_ms, 4),
            "load_ms": round(p.load_ms, 4), "loads_per_step": round(p.occ.loads, 5),
            "tokens_per_step": round(p.occ.tokens, 3), "tokens_per_s": round(p.tokens_per_s, 1),
            "waiting_per_step": round(p.occ.waiting, 3), "cpu_misses_per_step": round(p.occ.cpu_misses, 5),
            "graph_mem_bytes": None if p.graph_mem_bytes is None else int(p.graph_mem_bytes),
            "slot_bytes": p.slot_bytes, "kv_tokens_given_up": p.kv_tokens, "model_values": p.values,
            "miss_read_ms": None if p.miss is None else round(p.miss.read_ms, 4),
            "miss_read_gb_s": (None if p.miss is None or p.miss.bytes_per_ms is None
                               else float(f"{p.miss.bytes_per_ms / 1e6:.6g}")),  # a slow disk's rate is small
            "miss_read_fixed_ms": None if p.miss is None else round(p.miss.fixed_ms, 4),
            "miss_bytes_per_step": None if p.occ.miss_bytes is None else round(p.occ.miss_bytes),
            "miss_ms_per_step": round(p.miss_ms_per_step, 5)}


def set_choice_json(s: SetChoice) -> dict:
    if s.unavailable is not None:
        return {"chosen": None, "reason": reason(s)}
    return {"chosen": priced_json(s.chosen), "reason": reason(s), "gain_interval_pct": _interval(s.gain)}


def residency_json(d: ResidencyDecision) -> dict:
    a = d.adapters
    card = None
    if d.card is not None:
        card = {"max_loras": d.card.max_loras, "strategy": BASELINE, "tokens_per_s": round(d.card.tokens_per_s, 1),
                "expected_step_ms": round(d.card.step_ms, 4), "gain_pct": round(d.card_gain.pct, 2),
                "gain_interval_pct": _interval(d.card_gain), "verdict": versus_card(d)}
    return {"kernels": d.kernels, "workload": d.workload, "adapters": a.count, "max_cpu_loras": a.cpu_slots,
            "output_tokens": str(a.output_tokens), "clients": d.clients, "gpu_memory_budget_bytes": d.gpu_memory_bytes,
            "at": {m: set_choice_json(s) for m, s in d.at.items()}, "configs": [priced_json(p) for p in d.configs],
            "chosen": None if d.chosen is None else priced_json(d.chosen), "versus_best": _interval(d.fewer),
            "versus_card": card, "reason": reason(d), "notes": list(d.notes),
            "vllm": None if d.vllm is None else {"flags": d.vllm.flags, "note": d.vllm.note}, "validate": d.validate,
            "load_paths": [{"path": x.path, "load_ms": round(x.load_ms, 4), "expected_step_ms": round(x.step_ms, 4),
                            "tokens_per_s": round(x.tokens_per_s, 1), "engine": x.engine} for x in d.load_paths],
            **({"cpu_cache": cache_json(d.cpu_cache)} if d.cpu_cache is not None else {})}


def cache_json(c: CacheChoice) -> dict:
    """``--max-cpu-loras`` chosen (``lorabench.analysis.cpu_cache``): every size priced, the choice, why."""
    def size(x):
        return {"max_cpu_loras": x.size, "host_bytes": round(x.host_bytes), "misses_per_step": round(x.misses_per_step, 5),
                "expected_step_ms": round(x.step_ms, 4), "tokens_per_s": round(x.tokens_per_s, 1)}

    return {"chosen": None if c.chosen is None else size(c.chosen), "why": c.why,
            "host_memory_budget_bytes": c.host_budget_bytes, "sizes": [size(x) for x in c.sizes]}


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


def _round3(v: float | None) -> float | None:
    return None if v is None else round(v, 3)
