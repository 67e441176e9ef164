"""Decisions as values: built here by hand (no run), their reasons (``lorabench.analysis.reasons``)
and recommendation.json entries (``lorabench.analysis.recommendation_json``) follow from their
fields alone; and a run is read once into one view that every question is asked of."""

import shutil

import numpy as np
import pandas as pd
import pytest
from conftest import H200_CARD

from lorabench.analysis.compare import Comparison, Cover
from lorabench.analysis.costmodel import Plan
from lorabench.analysis.decision import (
    AutoDecision,
    Basis,
    Costs,
    MeasuredDecision,
    Rejection,
    ResidencyDecision,
    SetChoice,
)
from lorabench.analysis.intervals import Gain
from lorabench.analysis.occupancy import Occupancy
from lorabench.analysis.reasons import reason
from lorabench.analysis.recommend import measured_decisions
from lorabench.analysis.recommendation_json import (
    SCHEMA,
    auto_json,
    measured_json,
    report_json,
    residency_json,
)
from lorabench.analysis.residency_price import Priced
from lorabench.analysis.view import RunView
from lorabench.analysis.vllm import VLLM_NOTE, VllmAdvice
from lorabench.config.residency import Adapters
from lorabench.stats import Interval

GRID = (1, 2)
BY_C = {"max": {1: 10.0, 2: 10.0}, "pow2": {1: 9.6, 2: 9.6}, "dense": {1: 9.9, 2: 9.9}}


def comparison(*strategies: str) -> Comparison:
    """max and ``strategies``, each measured at c = 1 and 2."""
    return Comparison("triton", 4, "uniform", GRID, {s: Cover(s, BY_C[s], GRID, GRID) for s in ("max", *strategies)})


ADVICE = VllmAdvice("--enable-lora --max-loras 4 --max-lora-rank 16", VLLM_NOTE, "max")
COSTS = {"max": Costs([4], 6, 100 * 2**20, 1.5), "pow2": Costs([1, 2, 4], 10, 120 * 2**20, 1.9),
         "dense": Costs([1, 2, 3, 4], 12, 130 * 2**20, 2.0)}
SETTLE = "about 400 steps per point would settle it: --iters 400"  # a half-width of 2 to narrow to 1, from 100 steps


def decided(chosen: str, gains: dict[str, Gain], **fields) -> MeasuredDecision:
    """The report's decision over max and the strategies in ``gains`` (their gains over max)."""
    gains = {"max": Gain(0.0), **gains}
    ranked = tuple(sorted(gains, key=lambda s: -gains[s].pct))
    fields = {"fastest": ranked[0], "ranked": ranked, **fields}
    return MeasuredDecision(comparison(*(s for s in BY_C if s in gains and s != "max")), (1, 2, 4), ADVICE, chosen=chosen,
                            gains=gains, costs=COSTS[chosen], max_costs=COSTS["max"], **fields)


def test_a_gain_whose_interval_clears_pays_is_proposed():
    d = decided("pow2", {"pow2": Gain(4.0, Interval(4.0, 3.0, 5.0)), "dense": Gain(1.0, Interval(1.0, -0.5, 2.5))},
                basis=Basis.INTERVAL, cleared=("pow2",), open=("dense",))
    assert reason(d) == ("pow2 vs max on average over concurrency: faster by 4.0 % (95 % CI 3.0…5.0); "
                         "the interval's low end clears the 2 % that pays for extra graphs")
    j = measured_json(d)
    assert (j["strategy"], j["captured_counts"], j["gain_over_max_pct"], j["num_graphs"], j["num_graphs_max"]) == \
        ("pow2", [1, 2, 4], 4.0, 10, 6)
    assert j["gain_interval_pct"] == {"estimate": 4.0, "low": 3.0, "high": 5.0, "level": 0.95}
    assert j["decided_on"] == "the 95 % interval of the gain" and not j["inconclusive"] and j["more_measuring"] is None
    assert j["expected_step_ms"] == {"1": 9.6, "2": 9.6} and j["gain_by_strategy_pct"] == {"max": 0.0, "pow2": 4.0, "dense": 1.0}
    assert j["versus_max"]["dense"].startswith("no difference detected") and j["reason"] == reason(d)


def test_an_open_interval_keeps_max_says_inconclusive_and_what_would_settle_it():
    """The threshold is the decision's own (here 5 %): the words follow it."""
    pow2 = Gain(4.0, Interval(4.0, 2.0, 6.0), steps=100)
    d = decided("max", {"pow2": pow2}, basis=Basis.INTERVAL, open=("pow2",), settle=pow2.settle(5.0), pays_pct=5.0)
    assert d.inconclusive and d.more_measuring == SETTLE
    assert reason(d) == ("pow2 vs max on average over concurrency: faster by 4.0 % (95 % CI 2.0…6.0); inconclusive: the "
                         "interval's low end does not clear the 5 % that pays for extra graphs, so max, the fewest graphs; "
                         + SETTLE)
    j = measured_json(d)
    assert j["strategy"] == "max" and j["inconclusive"] and j["more_measuring"] == SETTLE and j["gain_interval_pct"] is None


def test_without_samples_the_medians_decide_and_say_so():
    d = decided("pow2", {"pow2": Gain(2.5, why="the run kept no samples")}, basis=Basis.MEDIANS,
                why_medians="the run kept no samples", cleared=("pow2",))
    assert reason(d) == ("pow2 is 2.5 % faster than max on average over concurrency (>= the 2 % that pays for extra "
                         "graphs); decided on medians alone (the run kept no samples)")
    j = measured_json(d)
    assert j["decided_on"] == "decided on medians alone (the run kept no samples)" and j["gain_interval_pct"] is None
    assert j["versus_max"]["pow2"] == "+2.5 % by the medians (no interval: the run kept no samples)"


def test_a_rejected_strategy_is_named_and_never_chosen():
    d = decided("max", {"pow2": Gain(-1.0, Interval(-1.0, -2.0, 0.0))}, fastest="dense", ranked=("max", "pow2"),
                basis=Basis.INTERVAL, rejected=(Rejection("dense", "WRONG: n=2, 1 base"),))
    assert reason(d) == ("dense measured fastest but failed its correctness check, so it is not proposed; "
                         "max is the fastest strategy that passed its correctness check")
    assert measured_json(d)["rejected"] == [{"strategy": "dense", "reason": "WRONG: n=2, 1 base"}]


MAX_PLAN = Plan([4], 10.0, {1: 10.0, 2: 10.0}, 2, 100e6, 1.5, {"measured": 4})
POW2_PLAN = Plan([1, 2, 4], 9.4, {1: 9.4, 2: 9.4}, 3, 110e6, 1.7, {"measured": 6})


def auto(proposed: Plan, gain: Gain, chosen: Plan, **fields) -> AutoDecision:
    measured = decided("max", {"pow2": Gain(-1.0, Interval(-1.0, -2.0, 0.0))}, basis=Basis.INTERVAL)
    return AutoDecision(measured, (1, 2), GRID, chosen=chosen, proposed=proposed, gain=gain,
                        baselines={"max": MAX_PLAN, "pow2": POW2_PLAN}, vllm=VllmAdvice("--enable-lora", "a note"),
                        validate="lorabench sweep ...", **fields)


def test_auto_holds_the_models_set_to_the_interval_of_its_predicted_gain():
    d = auto(Plan([1, 4], 9.7, {1: 9.7, 2: 9.7}, 3, 105e6, 1.6), Gain(3.0, Interval(3.0, 1.0, 5.0), steps=100), MAX_PLAN)
    assert d.kept is MAX_PLAN and d.inconclusive and d.more_measuring == SETTLE
    assert reason(d) == ("the cost model's best set [1, 4] vs max: faster by 3.0 % (95 % CI 1.0…5.0); inconclusive: the "
                         "interval's low end does not clear 2 %, so max, the fewest graphs; " + SETTLE)
    j = auto_json(d)
    assert j["auto"]["counts"] == [4] and j["decided_on"] == "the 95 % interval of the predicted gain"
    assert j["inconclusive"] and j["gain_interval_pct"]["low"] == 1.0
    assert j["baselines"]["pow2"]["auto_gain_pct"] == round(100 * (1 - 10.0 / 9.4), 2)
    assert j["measured"]["strategy"] == "max" and j["reason"] == reason(d)


def test_measured_beats_modelled():
    d = auto(POW2_PLAN, Gain(6.0, Interval(6.0, 4.0, 8.0)), MAX_PLAN, measured_as=("pow2",))
    assert d.kept is POW2_PLAN and not d.inconclusive
    assert reason(d) == ("the cost model's best set [1, 2, 4] is pow2's, which this run measured (pow2: 2 of 2 "
                         "concurrencies; compared over c = 1, 2) and the report does not propose; measured beats "
                         "modelled, so max")
    assert auto_json(d)["auto"]["counts"] == [4]


def test_no_set_within_the_budgets():
    d = AutoDecision(auto(MAX_PLAN, None, MAX_PLAN).measured, (1, 2), GRID, memory_bytes=1e6, baselines={"max": MAX_PLAN})
    assert reason(d) == "no capture set fits the budgets (not even max: max needs 2 LoRA graphs, 95 MiB, 1.50 s startup)"
    assert auto_json(d)["auto"] is None


def priced(max_loras: int, strategy: str, counts: list[int], decode_ms: float) -> Priced:
    occ = Occupancy({4: 1.0}, {4: np.array([0.0, 1.0])}, tokens=32.0, loads=0.1, cpu_misses=0.0, waiting=0.5, steps=1000)
    return Priced("triton", max_loras, strategy, counts, decode_ms, 10.0, occ, 100 * 2**20, max_loras * 2**20, 2**19)


def test_residency_keeps_fewer_slots_when_more_are_not_shown_to_pay():
    max8, pow2_8, max16 = priced(8, "max", [8], 30.0), priced(8, "pow2", [1, 2, 4, 8], 29.0), priced(16, "max", [16], 29.5)
    at8 = SetChoice(8, max8, {"max": max8, "pow2": pow2_8}, pow2_8, Gain(3.0, Interval(3.0, 1.0, 5.0)))
    at16 = SetChoice(16, max16, {"max": max16})
    assert at8.measured_choice is max8
    assert reason(at8) == ("pow2 [1, 2, 4, 8] vs max: more tokens/s by 3.0 % (95 % CI 1.0…5.0); "
                           "not shown to clear 2 %, so max, the fewest graphs")
    assert reason(at16) == "max is the fastest measured set"
    d = ResidencyDecision("triton", "zipf:1", Adapters(200), 32, None, {8: at8, 16: at16}, max8, max16,
                          Gain(1.7, Interval(1.7, 0.4, 3.0)))
    assert reason(d) == ("max_loras 16 serves the most tokens per second, no difference detected (-1.7 %, 95 % CI "
                         "-3.0…-0.4) than 8 slots, not shown to clear 2 %: so 8, the fewer slots; " + reason(at8))
    j = residency_json(d)
    assert j["chosen"]["max_loras"] == 8 and j["versus_best"] == {"estimate": 1.7, "low": 0.4, "high": 3.0, "level": 0.95}
    assert j["at"][8]["reason"] == reason(at8) and [c["strategy"] for c in j["configs"]] == ["max", "pow2", "max"]
    assert j["adapters"] == 200 and j["clients"] == 32 and j["reason"] == reason(d)


def test_reason_takes_decisions_only():
    with pytest.raises(TypeError):
        reason({"strategy": "max"})


def test_the_json_says_its_schema():
    view = RunView.of(pd.read_parquet(H200_CARD / "points.parquet"))
    decisions = measured_decisions(view)
    j = report_json(view, decisions)
    assert next(iter(j)) == "schema" and j["schema"] == SCHEMA == 2
    assert [r["reason"] for r in j["recommendations"]] == [reason(d) for d in decisions]


def test_a_view_computes_each_thing_once():
    view = RunView.of(pd.read_parquet(H200_CARD / "points.parquet"))
    assert view.comparisons() is view.comparisons() and view.expected() is view.expected()
    assert view.cost_model("triton", 4) is view.cost_model("triton", 4)
    assert set(view.measured_sets("triton", 4)) == {"max", "pow2", "dense"}


def test_the_report_reads_the_run_once(tmp_path, monkeypatch):
    """points.parquet, the samples and the timed loads: each read once, however many sections ask."""
    from lorabench.analysis import view as view_module
    from lorabench.commands.report import plots, write_report

    for name in ("latency_vs_active", "memory_startup", "latency_vs_concurrency", "speedup", "latency_vs_memory",
                 "backends", "roofline", "residency"):
        monkeypatch.setattr(plots, name, lambda *args: args[-1])
    calls = []
    for name in ("load_run", "read_samples", "read_loads"):
        real = getattr(view_module, name)
        monkeypatch.setattr(view_module, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    run = tmp_path / "run"
    shutil.copytree(H200_CARD, run)
    write_report(run)
    assert sorted(calls) == ["load_run", "read_loads", "read_samples"]
