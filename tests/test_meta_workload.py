"""Batch metadata packing and workload distributions."""

import random

import numpy as np
import pytest

from lorabench.config.batches import BenchPoint, parse_bench_points, fixed_batch, mixed_batch
from lorabench.config.workload import parse_workload
from lorabench.runtime.lora_meta import pack_slots


def unpack(packed, t, m):
    return packed[:t], packed[t : 2 * t], packed[2 * t : 2 * t + m], packed[2 * t + m :]


def test_pack_groups_adapter_tokens_and_skips_base():
    slots = [2, -1, 0, 2, -1, 3]
    packed, n = pack_slots(slots, 8, 4)
    token_slot, order, active, start = unpack(packed, 8, 4)
    assert n == 3
    assert token_slot == slots + [-1, -1]
    assert active == [0, 2, 3, -1]
    assert start == [0, 1, 3, 4, 4]
    assert order[:4] == [2, 0, 3, 5]  # slot 0: token 2; slot 2: tokens 0, 3; slot 3: token 5
    for i, s in enumerate(active[:n]):
        assert all(slots[t] == s for t in order[start[i] : start[i + 1]])


def test_pack_rejects_bad_batches():
    with pytest.raises(ValueError):
        pack_slots([0] * 9, 8, 4)
    with pytest.raises(ValueError):
        pack_slots([4], 8, 4)


@pytest.mark.parametrize("tokens,n,base", [(1, 1, 0), (8, 4, 0), (8, 2, 3), (5, 0, 5)])
def test_fixed_batch_has_exactly_n_active(tokens, n, base):
    slots = fixed_batch(tokens, n, 4, random.Random(0), base_tokens=base)
    assert len(slots) == tokens
    assert len({s for s in slots if s >= 0}) == n
    assert slots.count(-1) == base


def test_mixed_batches_mix():
    rng = random.Random(1)
    batches = [mixed_batch(8, 3, 4, rng) for _ in range(50)]
    assert all(len({s for s in b if s >= 0}) == 3 for b in batches)
    assert any(-1 in b for b in batches) and any(-1 not in b for b in batches)


@pytest.mark.parametrize(
    "text,name", [("uniform", "uniform"), ("zipf:1.2", "zipf:1.2"), ("base:0.5", "base:0.5"),
                  ("single+base:0.25", "single+base:0.25"), ("base:0.3+zipf:2", "zipf:2+base:0.3")]
)
def test_workload_grammar(text, name):
    assert parse_workload(text).name == name


@pytest.mark.parametrize("bad", ["", "zipf", "zipf:0", "base:1.5", "gauss", "uniform+single", "base:x"])
def test_workload_rejects(bad):
    with pytest.raises(ValueError):
        parse_workload(bad)


def test_active_count_pmf_uniform_matches_the_exact_formula():
    # c = 2 requests over L = 4 uniform slots: P(n=1) = 1/4, P(n=2) = 3/4
    pmf = parse_workload("uniform").active_count_pmf(2, 4, draws=200000)
    assert np.allclose(pmf, [0, 0.25, 0.75], atol=0.01)
    # half base: n=0 when both are base (1/4); n=1 for one base + one adapter (1/2) or two
    # adapters on one slot (1/4 · 1/4); n=2 for two adapters on distinct slots (1/4 · 3/4)
    pmf = parse_workload("base:0.5").active_count_pmf(2, 4, draws=200000)
    assert np.allclose(pmf, [0.25, 0.5 + 0.25 * 0.25, 0.25 * 0.75], atol=0.01)


def test_single_and_sampling_agree_with_pmf():
    wl = parse_workload("single+base:0.2")
    pmf = wl.active_count_pmf(4, 8)
    assert pmf[2:].sum() == 0 and abs(pmf[0] - 0.2**4) < 0.01
    rng = random.Random(0)
    counts = np.bincount([len({s for s in wl.sample(4, 8, rng) if s >= 0}) for _ in range(4000)], minlength=5)
    assert np.allclose(counts / 4000, pmf, atol=0.02)
    z = parse_workload("zipf:1.2")
    draws = [s for _ in range(2000) for s in z.sample(4, 8, rng)]
    freq = np.bincount(draws, minlength=8) / len(draws)
    assert np.allclose(freq, z.weights(8), atol=0.02)


def test_bench_points_parse_tokens_active_and_an_optional_launch_count():
    assert parse_bench_points("1:1,8:4:16", 16) == [BenchPoint(1, 1, None), BenchPoint(8, 4, 16)]
    assert parse_bench_points("2:1", 4, base_tokens=1) == [BenchPoint(2, 1, None)]


@pytest.mark.parametrize("text,base,why", [("one", 0, "is not tokens:active"), ("1:2:3:4", 0, "is not tokens:active"),
                                           ("1:-1", 0, "is not tokens:active"), ("8:4:2", 0, "launch count"),
                                           ("8:4:5", 0, "launch count"), ("8:5", 0, "do not fit"),
                                           ("2:0", 0, "do not fit"), ("2:2", 1, "do not fit")])
def test_bench_points_refuse_each_bad_point_in_one_line(text, base, why):
    with pytest.raises(ValueError, match=why):
        parse_bench_points(text, 4, base_tokens=base)
