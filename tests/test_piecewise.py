"""vLLM's PIECEWISE capture sizes and the graph a mixed step takes (``config.piecewise``)."""

import pytest
from lorabench.config.chunked import Piece, Step
from lorabench.config.piecewise import capture_sizes, max_capture_size, mixed_route
from lorabench.config.strategies import capture_counts


def test_the_default_sizes_as_vllm_lists_them():
    assert max_capture_size(256, 8192) == 512 and max_capture_size(100, 8192) == 200
    assert max_capture_size(256, 128) == 128  # never more than a step's token budget
    sizes = capture_sizes(512)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[33:36] == [248, 256, 272] and sizes[-1] == 512
    assert len(sizes) == 3 + 31 + 17
    assert capture_sizes(200) == [1, 2, 4] + list(range(8, 201, 8))
    assert capture_sizes(10) == [1, 2, 4, 8] and capture_sizes(3) == [1, 2]
    with pytest.raises(ValueError):
        capture_sizes(0)
    with pytest.raises(ValueError):
        max_capture_size(0, 8192)


def step(*pieces):
    """Pieces of (adapter, tokens, prefill)."""
    return Step(tuple(Piece(i, a, n, 0, pre, True) for i, (a, n, pre) in enumerate(pieces)))


def test_a_mixed_step_takes_the_smallest_size_and_count_that_hold_it():
    sizes, pow2 = capture_sizes(512), capture_counts("pow2", 8)
    route = mixed_route(step((3, 1, False), (-1, 1, False), (5, 297, True), (3, 1, False)), sizes, pow2)
    assert (route.bucket, route.launch, route.eager) == (304, 2, False)  # 300 tokens; adapters 3 and 5
    three = mixed_route(step((0, 1, False), (1, 1, False), (2, 6, True)), sizes, pow2)
    assert (three.bucket, three.launch) == (8, 4)  # 3 adapters round up to the 4 graph
    assert mixed_route(step((0, 1, False), (1, 1, False), (2, 6, True)), sizes, capture_counts("max", 8)).launch == 8
    base = mixed_route(step((-1, 40, True), (-1, 1, False)), sizes, pow2)
    assert (base.bucket, base.launch) == (48, 0)  # base-model requests only: the no-LoRA graph
    eager = mixed_route(step((0, 1, False), (1, 1, False), (2, 2046, True)), sizes, pow2)
    assert eager.eager and eager.launch == 3  # past 512 tokens: no graph, the adapters' own count
