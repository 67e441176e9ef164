"""Recommended configurations: per (kernels, max_loras, workload), the strategy with the lowest
expected step time averaged over the swept concurrencies, what it gains over ``max``, what it
costs in graph memory and startup, and the vLLM flags that realise it.

A strategy is only recommended over ``max`` when it is at least ``PAYS`` faster: below that the
difference is within run-to-run noise, and specialisation would spend memory and startup for
nothing. vLLM can realise ``max`` (its default) and ``pow2`` (``--specialize-active-lora``);
``dense`` and explicit lists are lorabench's own, so the vLLM flags follow the better of those two.
"""

import numpy as np
import pandas as pd

from lorabench.analysis import configs, expected_steps, ok_points

PAYS = 0.02  # a strategy must be >= 2 % faster than max to be worth its graphs
VLLM_STRATEGIES = ("max", "pow2")


def vllm_flags(max_loras: int, rank: int, specialise: bool) -> str:
    flags = f"--enable-lora --max-loras {max_loras} --max-lora-rank {rank}"
    return flags + (" --specialize-active-lora" if specialise else "")


def recommend(df: pd.DataFrame) -> dict:
    exp = expected_steps(df)
    cfg = configs(df).set_index(["kernels", "max_loras", "strategy"])
    first = ok_points(df).iloc[0]  # failed rows may lack the model's columns
    recs = []
    if not exp.empty:
        for (k, m, w), g in exp.groupby(["kernels", "max_loras", "workload"]):
            score = g.groupby("strategy").expected_ms.mean().dropna()
            if "max" not in score or score.empty:
                continue
            by_c = {s: {str(c): round(float(v), 4) for c, v in zip(gs.concurrency, gs.expected_ms)}
                    for s, gs in g.groupby("strategy")}
            gain = 1 - score / score["max"]
            best = score.idxmin()
            pays = bool(gain[best] >= PAYS)
            chosen = best if pays else "max"
            vllm_best = max((s for s in VLLM_STRATEGIES if s in score), key=lambda s: gain[s])
            specialise = vllm_best == "pow2" and gain["pow2"] >= PAYS
            c_row, c_max = cfg.loc[(k, m, chosen)], cfg.loc[(k, m, "max")]
            reason = (f"{best} is {100 * gain[best]:.1f} % faster than max on average over concurrency "
                      + ("(>= the 2 % that pays for extra graphs)" if pays else "(< 2 %: within noise, extra graphs do not pay)"))
            recs.append({
                "kernels": k, "max_loras": int(m), "workload": w,
                "strategy": chosen, "fastest_measured": best, "captured_counts": c_row.captured_counts,
                "capture_sizes": [int(x) for x in first.capture_sizes],
                "expected_step_ms": by_c[chosen], "expected_step_ms_max": by_c["max"],
                "gain_over_max_pct": round(100 * float(gain[chosen]), 2),
                "gain_by_strategy_pct": {s: round(100 * float(v), 2) for s, v in gain.items()},
                "graph_mem_bytes": _int(c_row.graph_mem_bytes), "graph_mem_bytes_max": _int(c_max.graph_mem_bytes),
                "startup_s": round(float(c_row.startup_s), 3), "startup_s_max": round(float(c_max.startup_s), 3),
                "num_graphs": int(c_row.num_graphs), "num_graphs_max": int(c_max.num_graphs),
                "reason": reason,
                "vllm": {
                    "flags": vllm_flags(int(m), int(first["rank"]), specialise),
                    "realises": "pow2" if specialise else "max",
                    "note": "vLLM captures max_loras+1 (and powers of two with --specialize-active-lora): it counts the base slot too",
                },
            })
    return _clean({
        "run_id": first.run_id, "device": first.device, "gpu_name": first.gpu_name, "model": first.model,
        "layers": _int(first.layers), "rank": _int(first["rank"]), "dtype": first["dtype"],
        "pays_threshold_pct": 100 * PAYS,
        "basis": "expected step time = sum_n P(n|c) * median step(c, n), averaged over the swept concurrencies",
        "recommendations": recs,
    })


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
