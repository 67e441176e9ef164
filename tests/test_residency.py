"""Adapter residency: the closed loop's admission, LRU slots and CPU cache on cases worked by
hand, the pricing of its steps from fixed points and timed loads, the choice of max_loras, and
the memory and KV cache it costs."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from lorabench.analysis.occupancy import kv_bytes_per_token, occupancy
from lorabench.analysis.reasons import reason
from lorabench.analysis.residency import CARD, residency_decisions
from lorabench.analysis.residency_price import Pricer
from lorabench.analysis.view import RunView
from lorabench.config.models import resolve
from lorabench.config.residency import Adapters, check_residency, simulate
from lorabench.config.strategies import capture_counts
from lorabench.config.trace import TraceWorkload
from lorabench.config.workload import parse_workload


def trace(tmp_path: Path, adapters: list, name="t.csv", **columns) -> TraceWorkload:
    df = pd.DataFrame({"adapter": adapters, **columns})
    path = tmp_path / name
    df.to_csv(path, index=False)
    return TraceWorkload(str(path))


def test_a_cycle_longer_than_the_slots_loads_every_step(tmp_path):
    """One client, one token per request, adapters 0 1 2 0 1 2 ... on 2 slots: LRU always evicts
    the adapter needed next, so every step loads; on 3 slots nothing loads once they are full."""
    t = trace(tmp_path, [0, 1, 2] * 20)
    s = simulate(t, Adapters(3, output_tokens=1), 1, 2, 30, burn_in=6)
    assert (s.n_loads == 1).all() and (s.tokens == 1).all()
    assert simulate(t, Adapters(3, output_tokens=1), 1, 3, 30, burn_in=6).n_loads.sum() == 0


def test_lru_keeps_the_recently_used_adapter(tmp_path):
    """0 1 0 2 0 3 ... on 2 slots: adapter 0 is used every other step, so it stays; every other
    adapter takes the other slot, one load each."""
    ids = [a for k in range(1, 30) for a in (0, k)]
    s = simulate(trace(tmp_path, ids), Adapters(30, output_tokens=1), 1, 2, 40, burn_in=4)
    zero_steps = [i for i, b in enumerate(s.batches) if s.loads[i] == [] or s.loads[i][0][1] != 0]
    assert len(zero_steps) == 40  # adapter 0 is never loaded again
    assert s.n_loads.sum() == 20  # one load per new adapter, every other step
    slot_of_zero = {b[0] for b, loads in zip(s.batches, s.loads) if not loads}
    assert len(slot_of_zero) == 1


def test_a_request_waits_while_the_batch_holds_max_loras_other_adapters(tmp_path):
    """Two clients on one slot, requests alternating between two adapters: only one request can
    run at a time (vLLM's scheduler skips the other), so one token per step, one waiting."""
    s = simulate(trace(tmp_path, [0, 1] * 50), Adapters(2, output_tokens=1), 2, 1, 20, burn_in=4)
    assert (s.tokens == 1).all() and (s.waiting == 1).all() and (s.n_active == 1).all()
    two = simulate(trace(tmp_path, [0, 1] * 50), Adapters(2, output_tokens=1), 2, 2, 20, burn_in=4)
    assert (two.tokens == 2).all() and (two.waiting == 0).all() and two.n_loads.sum() == 0


def test_base_requests_need_no_slot():
    s = simulate(parse_workload("base:1"), Adapters(50), 8, 1, 200)
    assert (s.tokens == 8).all() and (s.n_active == 0).all() and s.n_loads.sum() == 0
    assert all(b == [-1] * 8 for b in s.batches)


@pytest.mark.parametrize("workload", ["uniform", "zipf:1.2", "zipf:1+base:0.3", "single"])
@pytest.mark.parametrize("max_loras", [1, 4, 16])
@pytest.mark.parametrize("output", ["16", "4-28"])
def test_every_step_is_a_batch_the_slots_can_serve(workload, max_loras, output):
    """Whatever the workload and request lengths: at most max_loras adapters per batch, every
    adapter request on the slot its adapter was loaded into, loads only into slots the step does
    not already use, and the tokens never more than the clients."""
    s = simulate(parse_workload(workload), Adapters(40, output_tokens=output), 12, max_loras, 500, seed=3, burn_in=0)
    held: dict[int, int] = {}  # slot -> adapter, as the loads say
    for batch, requests, loads, n, tokens in zip(s.batches, s.requests, s.loads, s.n_active, s.tokens):
        assert len(batch) == len(requests) == tokens <= 12
        slots = {x for x in batch if x >= 0}
        assert len(slots) == n == len({a for a in requests if a >= 0}) <= max_loras
        for slot, adapter in loads:
            assert 0 <= slot < max_loras and adapter in requests
            held[slot] = adapter
        assert all(held[x] == a for x, a in zip(batch, requests) if a >= 0)  # each on its adapter's slot
        assert all((x < 0) == (a < 0) for x, a in zip(batch, requests))
    if workload == "single":
        assert s.n_loads.sum() == 1 and (s.n_active <= 1).all()  # the first step loads it, once


def test_the_cpu_cache_misses_only_when_it_is_smaller_than_the_adapters():
    wl = parse_workload("uniform")
    full = simulate(wl, Adapters(100), 16, 8, 3000)
    small = simulate(wl, Adapters(100, max_cpu_loras=20), 16, 8, 3000)
    assert full.cpu_misses.sum() == 0 and full.n_loads.sum() > 50
    assert 0 < small.cpu_misses.sum() <= small.n_loads.sum()
    assert small.n_loads.sum() == full.n_loads.sum()  # the CPU cache changes where a load reads from, not how many
    assert [len(r) for r in small.reads] == small.cpu_misses.tolist() and not any(full.reads)
    for reads, loads in zip(small.reads, small.loads):  # a read adapter is one the step loads
        assert set(reads) <= {a for _, a in loads}


def test_a_missed_adapter_is_not_in_the_cpu_cache_it_is_read_into():
    """Replaying the schedule's loads through an LRU of the cache's size: every read is of an
    adapter the cache lacks, and every load of one it lacks is read."""
    from collections import OrderedDict

    from lorabench.config.residency import _warm_cache

    wl, adapters = parse_workload("zipf:1"), Adapters(40, max_cpu_loras=6)
    s = simulate(wl, adapters, 12, 4, 2000)
    cache = OrderedDict((a, None) for a in _warm_cache(wl, adapters))
    for reads, loads, requests in zip(s.reads, s.loads, s.requests):
        for a in dict.fromkeys(a for a in requests if a >= 0):  # each running adapter is used, in the batch's order
            if a in cache:
                assert a not in reads  # a cached adapter is never read
                cache.move_to_end(a)
            elif any(a == b for _, b in loads):
                assert a in reads
                cache[a] = None
                if len(cache) > 6:
                    cache.popitem(last=False)
        assert all(a not in reads or a in cache for a in requests)


def test_the_schedule_is_deterministic_and_more_slots_load_less():
    wl = parse_workload("zipf:1.2")
    a = simulate(wl, Adapters(200), 32, 16, 2000, seed=7)
    b = simulate(wl, Adapters(200), 32, 16, 2000, seed=7)
    assert a.batches == b.batches and a.loads == b.loads
    loads = [simulate(wl, Adapters(200), 32, m, 4000).n_loads.mean() for m in (32, 64, 128)]
    assert loads[0] > loads[1] > loads[2]
    tokens = [simulate(wl, Adapters(200), 32, m, 2000).tokens.mean() for m in (4, 16, 32)]
    assert tokens[0] < tokens[1] < tokens[2] == 32


def test_a_trace_gives_the_adapters_and_the_lengths(tmp_path):
    t = trace(tmp_path, ["a", "b", "", "a"] * 10, output_tokens=[3, 1, 2, 5] * 10)
    s = simulate(t, Adapters(2), 2, 2, 50)
    assert set(s.n_active.tolist()) <= {0, 1, 2}
    check_residency(t, 2, None, [2])
    with pytest.raises(ValueError, match="more than --adapters 1"):
        check_residency(t, 1, None, [1])
    bad = trace(tmp_path, ["a", "b"], name="bad.csv", output_tokens=[1, 0])
    with pytest.raises(ValueError, match="row 1 needs a whole output_tokens"):
        check_residency(bad, 2, None, [1])
    steps = tmp_path / "steps.csv"
    pd.DataFrame({"concurrency": [2], "n_active": [1]}).to_csv(steps, index=False)
    with pytest.raises(ValueError, match="not requests with adapters"):
        check_residency(TraceWorkload(str(steps)), 2, None, [1])
    with pytest.raises(ValueError, match="below --max-loras 8"):
        check_residency(parse_workload("uniform"), 10, 4, [4, 8])


def test_kv_bytes_per_token_of_real_models():
    row = {"layers": 32, "kv_heads": 32, "head_dim": 128, "dtype": "float16", "tp": 1}
    assert kv_bytes_per_token(row) == 512 * 1024  # llama-2-7b: 0.5 MiB per token
    cfg = resolve("llama-3.1-70b")
    row = {"layers": cfg.layers, "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "dtype": "bfloat16", "tp": 4}
    assert kv_bytes_per_token(row) == 2 * 80 * 2 * 128 * 2  # 8 KV heads over 4 ranks: 2 per rank


# -- pricing, from made-up fixed points -------------------------------------------------------------

SIZES = [1, 2, 4]
BYTES_PER_SLOT = 64 * 2**20


def t(c, n, g):
    """A made-up step (ms): the base step grows with the batch, LoRA with the active and launched slots."""
    return 4.0 + 0.1 * c + (0 if n == 0 else 0.2 + 0.1 * n + 0.05 * g)


def fixed_rows(max_loras: int, strategies=("max", "pow2"), load_ms=2.0) -> list[dict]:
    rows = []
    for s in strategies:
        counts = capture_counts(s, max_loras)
        for c in SIZES:
            for n in range(min(c, max_loras) + 1):
                g = 0 if n == 0 else next(k for k in counts if k >= n)
                rows.append({"status": "ok", "kernels": "triton", "max_loras": max_loras, "strategy": s, "mode": "fixed",
                             "concurrency": c, "n_active": n, "graph_loras": g, "step_ms_median": t(c, n, g),
                             "captured_counts": counts, "capture_sizes": SIZES, "rank": 16, "run_id": "synthetic",
                             "graph_mem_bytes": 10 * 2**20 * len(counts), "capture_s": 0.1, "startup_s": 2.0,
                             "device": "cuda", "model": "llama-2-7b", "layers": 32, "kv_heads": 32, "head_dim": 128,
                             "dtype": "float16", "tp": 1, "lora_bytes_per_slot": BYTES_PER_SLOT,
                             "load_ms_median": load_ms, "correct": True, "point": None})
    return rows


def run(*max_loras, load_ms=2.0) -> pd.DataFrame:
    rows = [r for m in max_loras for r in fixed_rows(m, load_ms=load_ms)]
    df = pd.DataFrame(rows)
    df["point"] = range(len(df))
    return df


def test_a_step_is_priced_at_its_bucket_with_its_loads():
    """Steps of 1, 3 and 4 tokens: 3 runs in the bucket of 4; each load adds the load's median."""
    df = run(4)
    occ = occupancy([1, 3, 4, 4], [1, 2, 3, 4], [0, 1, 0, 1], SIZES, 4)
    assert occ.weights == {1: 0.25, 4: 0.75} and occ.tokens == 3.0 and occ.loads == 0.5
    p = Pricer(RunView.of(df), "triton", 4, occ)
    priced = p.price("max", [4])
    by_hand = (t(1, 1, 4) + t(4, 2, 4) + t(4, 3, 4) + t(4, 4, 4)) / 4
    assert priced.decode_ms == pytest.approx(by_hand)
    assert priced.step_ms == pytest.approx(by_hand + 0.5 * 2.0)
    assert priced.tokens_per_s == pytest.approx(1e3 * 3 / (by_hand + 1.0))
    pow2 = p.price("pow2", [1, 2, 4])
    assert pow2.decode_ms == pytest.approx((t(1, 1, 1) + t(4, 2, 2) + t(4, 3, 4) + t(4, 4, 4)) / 4)
    assert priced.slot_bytes == 4 * BYTES_PER_SLOT and priced.graph_mem_bytes == pytest.approx(10 * 2**20)
    assert priced.kv_tokens == (10 * 2**20 + 4 * BYTES_PER_SLOT) // (512 * 1024)
    assert p.step([4])(p.medians()) == pytest.approx(priced.step_ms)  # the resampled form agrees


def test_a_run_without_timed_loads_cannot_price_loads():
    df = run(4)
    df["load_ms_median"] = np.nan
    occ = occupancy([4], [2], [1], SIZES, 4)
    p = Pricer(RunView.of(df), "triton", 4, occ)
    assert p.price("max", [4]) is None and "timed no adapter loads" in p.unpriced([4])
    assert Pricer(RunView.of(df), "triton", 4, occupancy([4], [2], [0], SIZES, 4)).price("max", [4]) is not None


def test_more_slots_win_when_requests_wait_and_the_card_is_the_baseline():
    """Uniform over 200 adapters, 4 clients: one slot makes requests wait, four serve them all."""
    df = run(1, 2, 4)
    (r,) = residency_decisions(RunView.of(df), "uniform", Adapters(200, output_tokens=32), steps=3000)
    assert r.clients == 4 and r.chosen.max_loras == CARD
    tps = {(c.max_loras, c.strategy): c.tokens_per_s for c in r.configs}
    assert tps[(1, "max")] < tps[(2, "max")] < tps[(4, "max")]
    assert r.card is None  # the choice is the card's own max_loras and set
    assert "--max-loras 4" in r.vllm.flags and "--max-cpu-loras 200" in r.vllm.flags
    assert "--adapters 200" in r.validate and "--max-loras 4" in r.validate


def test_fewer_slots_are_kept_when_more_do_not_pay():
    """Every request the same adapter: one slot serves every token, and more slots only launch
    larger grids, so 1 is chosen; the card's 4 is slower by the grid's cost."""
    df = run(1, 2, 4)
    (r,) = residency_decisions(RunView.of(df), "single", Adapters(200), steps=2000)
    assert r.chosen.max_loras == 1
    assert r.card.max_loras == CARD and r.card_gain.pct > 0


def test_a_gpu_memory_budget_leaves_out_what_does_not_fit():
    df = run(1, 2, 4)
    budget = 2 * BYTES_PER_SLOT + 40 * 2**20  # two slots and their graphs fit, four slots do not
    (r,) = residency_decisions(RunView.of(df), "uniform", Adapters(200, output_tokens=32), gpu_memory_bytes=budget,
                               steps=2000)
    assert r.chosen.max_loras == 2
    assert r.at[4].chosen is None and "slots alone" in reason(r.at[4])


def test_more_clients_than_the_run_has_points_for_are_refused():
    with pytest.raises(ValueError, match="8 clients need fixed points up to concurrency 8"):
        residency_decisions(RunView.of(run(4)), "uniform", Adapters(10), clients=8, steps=100)


def test_a_max_loras_above_the_cpu_cache_is_left_out():
    (r,) = residency_decisions(RunView.of(run(1, 2, 4)), "uniform", Adapters(200, max_cpu_loras=2, output_tokens=32),
                               steps=2000)
    assert r.chosen.max_loras == 2 and "above --max-cpu-loras 2" in reason(r.at[4])
    assert r.chosen.occ.cpu_misses > 0 and any("lower bound" in n for n in r.notes)


def test_misses_are_priced_by_the_bytes_they_read_where_the_files_are_known():
    from lorabench.analysis.occupancy import simulated
    from lorabench.analysis.residency_price import MissPrice

    sizes = tuple(10_000 * (1 + i % 4) for i in range(20))  # four sizes, as ranks 8..64 make them
    known = simulated("zipf:1", Adapters(20, 4, 8, sizes), 6, 2, [6], steps=3000)
    unknown = simulated("zipf:1", Adapters(20, 4, 8), 6, 2, [6], steps=3000)
    assert unknown.miss_bytes is None and known.cpu_misses == unknown.cpu_misses > 0
    assert min(sizes) * known.cpu_misses <= known.miss_bytes <= max(sizes) * known.cpu_misses
    price = MissPrice(read_ms=9.0, bytes_per_ms=1e4, fixed_ms=0.5)
    assert price.per_step(known) == pytest.approx(0.5 * known.cpu_misses + known.miss_bytes / 1e4)
    assert price.per_step(unknown) == pytest.approx(9.0 * unknown.cpu_misses)  # no sizes: the median read per miss


def test_an_overlapped_load_costs_the_waiting_requests_tokens():
    from lorabench.analysis.residency_price import overlapped_tokens

    # 0.1 loads per step, each usable after 20 ms of 10 ms steps: 0.2 of a token per step lost
    assert overlapped_tokens(16.0, 0.1, 20.0, 10.0) == pytest.approx(15.8)
    assert overlapped_tokens(16.0, 0.0, 20.0, 10.0) == 16.0 and overlapped_tokens(1.0, 1.0, 50.0, 10.0) == 0.0
