"""Chunked-prefill scheduling (``config.chunked``) against steps worked out by hand, its invariants
on random loops, and the latencies a client sees (``config.serving_latency``)."""

import random

import numpy as np
import pytest
from lorabench.config.serving_latency import latencies
from lorabench.config.chunked import Piece, serve
from lorabench.stats import MIN_SAMPLES, quantile_interval, quantile_interval_samples


def source(*requests, then=None):
    """next_request from a list of (adapter, input, output), then ``then`` forever."""
    it = iter(requests)
    return lambda: next(it, then)


def shape(step):
    return [(p.request, p.tokens, p.context, p.prefill, p.emits) for p in step.pieces]


def test_a_prompt_longer_than_the_budget_is_chunked_then_decoded():
    served = serve(source((0, 10, 3), then=(0, 10, 3)), clients=1, steps=5, budget=8, max_seqs=4)
    assert [shape(s) for s in served.steps] == [
        [(0, 8, 0, True, False)],  # the first chunk: no token yet
        [(0, 2, 8, True, True)],  # the prompt's last 2 tokens, and the first output token
        [(0, 1, 10, False, True)],  # decodes read the whole prompt and what came out
        [(0, 1, 11, False, True)],  # the third token: the request ends
        [(1, 8, 0, True, False)],  # its client's next request, from the next step
    ]
    assert served.requests[0].emitted_at == [1, 2, 3] and served.requests[1].arrival == 4


def test_decodes_go_first_then_prefills_under_way_then_new_requests():
    served = serve(source((0, 4, 3), (1, 20, 2), then=(0, 4, 1)), clients=2, steps=5, budget=8, max_seqs=4)
    assert [shape(s) for s in served.steps] == [
        [(0, 4, 0, True, True), (1, 4, 0, True, False)],  # both admitted: R1 takes what R0 left
        [(0, 1, 4, False, True), (1, 7, 4, True, False)],  # R0's decode first
        [(0, 1, 5, False, True), (1, 7, 11, True, False)],  # R0 ends
        [(1, 2, 18, True, True), (2, 4, 0, True, True)],  # R1's last chunk; R0's successor R2 joins (1 token: ends)
        [(1, 1, 20, False, True), (3, 4, 0, True, True)],  # R1 ends; R2's successor R3
    ]
    assert all(s.tokens <= 8 for s in served.steps)
    assert served.steps[1].decode_tokens == 1 and served.steps[1].prefill_tokens == 7


def test_a_request_whose_adapter_does_not_fit_is_skipped_and_the_next_tried():
    served = serve(source((0, 2, 2), (1, 2, 2), (-1, 2, 2), (0, 2, 2), (-1, 2, 2), then=(-1, 2, 2)), clients=3, steps=3,
                   budget=16, max_seqs=8, max_loras=1)
    firsts = [[p.request for p in s.pieces] for s in served.steps]
    assert firsts[0] == [0, 2]  # R1's adapter 1 would be a second: skipped; the base request joins
    assert firsts[1] == [0, 2]  # adapter 0 still runs: R1 waits
    assert firsts[2] == [1, 4]  # the batch emptied: R1 first (first come), then R4 (base) — R3's adapter 0 no longer fits
    assert all(len(s.adapters) <= 1 for s in served.steps)


def test_max_num_seqs_bounds_the_requests_of_a_step():
    served = serve(source(then=(-1, 3, 2)), clients=3, steps=4, budget=64, max_seqs=2)
    assert [len(s.pieces) for s in served.steps] == [2, 2, 2, 2]
    assert served.requests[2].emitted_at == [2, 3]  # the third client's request waited for a place


@pytest.mark.parametrize("seed", range(6))
def test_random_loops_keep_every_rule(seed):
    rnd = random.Random(seed)
    budget, max_seqs, max_loras = rnd.choice([16, 64, 512]), rnd.choice([2, 8, 32]), rnd.choice([1, 2, 4, None])
    served = serve(lambda: (rnd.randrange(-1, 6), rnd.randint(1, 300), rnd.randint(1, 40)), clients=rnd.randint(1, 24),
                   steps=300, budget=budget, max_seqs=max_seqs, max_loras=max_loras)
    seen: dict[int, list[Piece]] = {}
    for i, s in enumerate(served.steps):
        assert s.tokens <= budget and len(s.pieces) <= max_seqs
        assert max_loras is None or len(s.adapters) <= max_loras
        assert len({p.request for p in s.pieces}) == len(s.pieces)
        decodes = [k for k, p in enumerate(s.pieces) if not p.prefill]
        assert decodes == list(range(len(decodes)))  # decode tokens first
        for p in s.pieces:
            seen.setdefault(p.request, []).append(p)
            assert served.requests[p.request].arrival <= i
    for rid, pieces in seen.items():
        r = served.requests[rid]
        context = 0
        for p in pieces:  # the KV cache grows by exactly what the steps before processed
            assert p.context == context and p.adapter == r.adapter
            context += p.tokens
        prompt = [p for p in pieces if p.prefill]
        assert sum(p.tokens for p in prompt) == r.prefilled <= r.input_tokens
        assert [p.emits for p in prompt] == [False] * (len(prompt) - 1) + [r.prefilled == r.input_tokens]
        assert len(r.emitted_at) == sum(p.emits for p in pieces) <= r.output_tokens
        assert r.emitted_at == sorted(set(r.emitted_at))


def test_bad_settings_and_requests_get_one_line():
    with pytest.raises(ValueError, match="must be positive"):
        serve(source(then=(0, 1, 1)), clients=1, steps=1, budget=0, max_seqs=1)
    with pytest.raises(ValueError, match="at least 1"):
        serve(source(then=(0, 0, 1)), clients=1, steps=1, budget=8, max_seqs=1)


def test_ttft_itl_and_tokens_per_second_from_the_steps_times():
    served = serve(source((0, 10, 3), then=(0, 10, 3)), clients=1, steps=5, budget=8, max_seqs=4)
    lat = latencies(served, [1, 2, 3, 4, 5])  # steps end at 1, 3, 6, 10, 15 ms
    assert lat.ttft_ms.tolist() == [3.0]  # arrived at 0, first token at the end of step 1
    assert lat.itl_ms.tolist() == [3.0, 4.0]
    assert lat.output_tokens == 3 and lat.tokens_per_s == pytest.approx(200.0)
    later = latencies(served, [1, 2, 3, 4, 5], from_step=2)  # the request arrived before: no TTFT; one gap from step 2
    assert later.ttft_ms.size == 0 and later.itl_ms.tolist() == [4.0] and later.output_tokens == 2
    assert later.tokens_per_s == pytest.approx(1000 * 2 / 12)
    with pytest.raises(ValueError, match="4 step times for 5 steps"):
        latencies(served, [1, 2, 3, 4])


def test_a_closed_loops_ttft_counts_the_wait_for_a_place():
    served = serve(source(then=(-1, 3, 2)), clients=3, steps=4, budget=64, max_seqs=2)
    lat = latencies(served, [10, 10, 10, 10])
    # R0, R1 at once; R2 waited for a place two steps; R3 (R0's successor, at 20 ms) at once, and R4 (at
    # 20 ms) is still waiting: both arrived within the longest TTFT seen (30 ms) of the end (40 ms), so
    # neither counts (R4 might yet be fast; counting R3 alone would favour the fast)
    assert lat.ttft_ms.tolist() == [10.0, 10.0, 30.0] and lat.ttft_censored == 0
    assert lat.ttft_pending == 1  # R4 arrived at step 2 and is still waiting (R5 arrives after the last step)
    waited = latencies(served, [10, 10, 10, 100])  # R4 has now waited 110 ms: longer than any TTFT seen
    assert waited.ttft_ms.tolist() == [10.0, 10.0, 30.0, 10.0] and waited.ttft_censored == 1
    assert waited.ttft_value(50) == pytest.approx(10.0) and waited.ttft_value(90) == float("inf")


def test_censored_percentiles_and_intervals():
    from lorabench.config.serving_latency import censored_percentile, censored_quantile

    x = np.arange(1.0, 101.0)
    assert censored_percentile(x, 0, 50) == pytest.approx(np.percentile(x, 50))
    assert censored_percentile(x, 5, 50) == pytest.approx(np.percentile(np.r_[x, [1e9] * 5], 50))
    assert censored_percentile(x, 5, 99) == float("inf")  # among the 5 above every value
    iv = censored_quantile(x, 5, 0.9)
    assert iv.estimate < 100 and iv.low < iv.estimate and iv.high == float("inf")  # its upper bound reaches them
    assert censored_quantile(x, 0, 0.5) == censored_quantile(x, 0, 0.5)


def test_quantile_intervals_cover_at_their_level():
    rng = np.random.default_rng(0)
    for q, n in ((0.5, 40), (0.9, 200), (0.99, 1000)):
        truth = -np.log(1 - q)  # the exponential's quantile
        hits = 0
        for _ in range(300):
            x = rng.exponential(size=n)
            iv = quantile_interval(x, q)
            assert iv.low <= iv.estimate <= iv.high and iv.estimate == pytest.approx(np.quantile(x, q))
            hits += iv.low <= truth <= iv.high
        assert hits / 300 >= 0.92, (q, n, hits)
    assert quantile_interval(rng.exponential(size=100), 0.99) is None  # too few samples for p99's interval
    assert quantile_interval(np.ones(5), 0.5) is None
    with pytest.raises(ValueError):
        quantile_interval(np.ones(50), 1.0)


@pytest.mark.parametrize("q,fewest", [(0.5, MIN_SAMPLES), (0.9, 36), (0.99, 368)])
def test_the_fewest_samples_a_quantile_interval_needs(q, fewest):
    assert quantile_interval_samples(q) == fewest
    assert quantile_interval(np.arange(fewest, dtype=float), q) is not None
    assert quantile_interval(np.arange(fewest - 1, dtype=float), q) is None
