"""Capture-set strategies: which launch counts get their own graph set.

A strategy is one function ``max_loras -> sorted launch counts`` plus a registry entry; every
set contains ``max_loras`` so any batch can be served. ``agnostic`` also sizes each bucket's grid
by the bucket instead of its count (``BUCKET_GRID``). The n = 0 (no-LoRA) set is always
captured on top of it by the dispatcher. An explicit list is written ``[1,2,4]``.
"""

from collections.abc import Callable

STRATEGIES: dict[str, Callable[[int], list[int]]] = {}


def strategy(name: str):
    def register(fn):
        STRATEGIES[name] = fn
        return fn

    return register


@strategy("max")
def no_specialisation(max_loras: int) -> list[int]:
    """One LoRA graph set whose grid covers every slot."""
    return [max_loras]


@strategy("pow2")
def powers_of_two(max_loras: int) -> list[int]:
    """vLLM's --specialize-active-lora set (without the base slot vLLM also counts)."""
    return sorted({1 << i for i in range(max_loras.bit_length()) if 1 << i < max_loras} | {max_loras})


@strategy("dense")
def every_count(max_loras: int) -> list[int]:
    return list(range(1, max_loras + 1))


@strategy("agnostic")
def count_agnostic(max_loras: int) -> list[int]:
    """One LoRA graph set, like max, but each bucket's grid is sized by the bucket (see
    ``BUCKET_GRID``): min(bucket, max_loras), never the active count."""
    return [max_loras]


# Strategies whose graphs launch min(bucket, max_loras) programs on the adapter axis, whatever n.
BUCKET_GRID = {"agnostic"}
FIXED_SETS = ("max", "pow2", "dense")  # the sets vLLM-style dispatch compares (and auto prices against)


def parse_explicit(text: str) -> list[int] | None:
    """``[1,2,4]`` -> [1, 2, 4]; None when ``text`` is not a bracketed list."""
    text = text.strip()
    if not (text.startswith("[") and text.endswith("]")):
        return None
    try:
        counts = [int(p) for p in text[1:-1].split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"explicit capture set {text!r} must list integers, e.g. [1,2,4]") from None
    if not counts:
        raise ValueError(f"explicit capture set {text!r} is empty")
    return counts


def capture_counts(name: str, max_loras: int) -> list[int]:
    """The sorted launch counts of strategy ``name`` (a registered name or ``[a,b,...]``)."""
    explicit = parse_explicit(name)
    if explicit is None:
        if name not in STRATEGIES:
            raise ValueError(f"unknown strategy {name!r} (choose from {', '.join(STRATEGIES)} or a list like [1,2,4])")
        return STRATEGIES[name](max_loras)
    counts = sorted(set(explicit))
    if counts[0] < 1 or counts[-1] > max_loras:
        raise ValueError(f"capture set {name} must hold counts in 1..max_loras={max_loras}")
    if max_loras not in counts:
        raise ValueError(f"capture set {name} must contain max_loras={max_loras}, or batches with every slot active have no graph")
    return counts


def canonical(name: str) -> str:
    """The strategy's name as written into rows: registered names as is, lists as ``[1,2,4]``."""
    explicit = parse_explicit(name)
    return name.strip() if explicit is None else "[" + ",".join(str(c) for c in sorted(set(explicit))) + "]"
