"""Which graph a mixed step (prefill chunks and decode tokens) runs under vLLM's rules.

vLLM captures PIECEWISE graphs (the model split at attention, which runs between the pieces) for
non-uniform batches at every capture size up to ``max_cudagraph_capture_size``, by default
``min(2 · max_num_seqs, 512)`` tokens and never more than ``max_num_batched_tokens``; its sizes are
1, 2, 4, then multiples of 8 below 256, then multiples of 16 up to that maximum. Like decode
graphs they are keyed by (token bucket, has LoRA, active count), the count rounded up in the
captured counts; a step of more tokens than the largest size runs eagerly.
"""

from dataclasses import dataclass

from lorabench.config.chunked import Step
from lorabench.config.strategies import choose_bucket, choose_launch

MAX_CAPTURE_SIZE = 512  # vLLM's cap on its default max_cudagraph_capture_size


def max_capture_size(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """vLLM's default ``max_cudagraph_capture_size``."""
    if min(max_num_seqs, max_num_batched_tokens) < 1:
        raise ValueError(f"max_num_seqs {max_num_seqs} and max_num_batched_tokens {max_num_batched_tokens} must be positive")
    return min(2 * max_num_seqs, MAX_CAPTURE_SIZE, max_num_batched_tokens)


def capture_sizes(largest: int) -> list[int]:
    """vLLM's default ``cudagraph_capture_sizes`` up to ``largest`` tokens: 1, 2, 4, multiples of 8
    below 256, multiples of 16 from 256 (a ``largest`` that is none of those is not captured: the
    largest size is the list's last)."""
    if largest < 1:
        raise ValueError(f"a largest capture size of {largest}: it must be at least 1")
    return [s for s in (1, 2, 4) if s <= largest] + list(range(8, min(largest + 1, 256), 8)) \
        + list(range(256, largest + 1, 16))


@dataclass(frozen=True)
class MixedRoute:
    """A mixed step's graph: its token bucket (None: eager) and its launch count (0: no LoRA)."""

    bucket: int | None
    launch: int

    @property
    def eager(self) -> bool:
        return self.bucket is None


def mixed_route(step: Step, sizes: list[int], counts: list[int]) -> MixedRoute:
    """The PIECEWISE graph (or the eager path) of ``step`` under capture ``sizes`` and captured
    launch ``counts``: the smallest size holding its tokens, the smallest count holding its
    distinct adapters (base-model requests do not count). Eager, nothing is baked in: the launch
    count is the adapters' own, as lorabench's dispatcher launches eager steps."""
    bucket, n = choose_bucket(step.tokens, sizes), len(step.adapters)
    return MixedRoute(bucket, n if bucket is None else choose_launch(n, counts))
