"""Capture sets, dispatch rounding and bucket choice."""

import pytest

from lorabench.config.strategies import (
    canonical,
    capture_counts,
    choose_bucket,
    choose_launch,
)


@pytest.mark.parametrize(
    "name,max_loras,expected",
    [
        ("max", 4, [4]),
        ("pow2", 4, [1, 2, 4]),
        ("pow2", 5, [1, 2, 4, 5]),
        ("pow2", 1, [1]),
        ("pow2", 128, [1, 2, 4, 8, 16, 32, 64, 128]),
        ("dense", 3, [1, 2, 3]),
        ("[4,1,2]", 4, [1, 2, 4]),
        ("[3, 4]", 4, [3, 4]),
        ("agnostic", 32, [32]),
    ],
)
def test_capture_counts(name, max_loras, expected):
    assert capture_counts(name, max_loras) == expected


@pytest.mark.parametrize("bad", ["[1,2]", "[0,4]", "[1,5]", "[]", "[a]", "fastest"])
def test_capture_counts_rejects(bad):
    with pytest.raises(ValueError):
        capture_counts(bad, 4)


def test_canonical_names():
    assert canonical(" [4, 1,2] ") == "[1,2,4]"
    assert canonical("pow2") == "pow2"


@pytest.mark.parametrize(
    "tokens,expected", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, None), (100, None)]
)
def test_bucket_rounds_up_and_goes_eager_past_the_largest(tokens, expected):
    assert choose_bucket(tokens, [1, 2, 4, 8]) == expected


@pytest.mark.parametrize(
    "n,counts,expected",
    [
        (0, [1, 2, 4], 0),
        (1, [1, 2, 4], 1),
        (3, [1, 2, 4], 4),
        (4, [1, 2, 4], 4),
        (1, [4], 4),
        (3, [1, 2, 3, 4], 3),
        (2, [3, 4], 3),
    ],
)
def test_launch_count_rounds_up(n, counts, expected):
    assert choose_launch(n, counts) == expected


def test_launch_count_past_the_set_is_an_error():
    with pytest.raises(ValueError):
        choose_launch(5, [1, 2, 4])


def test_the_plan_never_asks_vllm_for_a_count_agnostic_grid():
    from lorabench.config.plan import plan
    from lorabench.config.spec import SweepSpec

    spec = SweepSpec(max_loras=[4], concurrency=[1, 2], strategy=["max", "agnostic"], kernels=["fused", "vllm"],
                     model="tiny", dtype="float16", capture_sizes=[1, 2])
    jobs = {(j.kernels, j.strategy) for j in plan(spec)}
    assert jobs == {("fused", "max"), ("fused", "agnostic"), ("vllm", "max")}
