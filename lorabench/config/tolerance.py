"""How close a result must be to its reference, per dtype: one table for every check."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    logits: float  # a decode step: its worst token's |out - ref| / |ref| over its logits (lorabench check)
    kernel: float  # one kernel launch against the default config's output: max |diff| / max(1, max |ref|) (lorabench tune)


TOLERANCE = {
    "float32": Tolerance(logits=1e-4, kernel=1e-4),
    "float16": Tolerance(logits=3e-2, kernel=1e-2),
    "bfloat16": Tolerance(logits=1e-1, kernel=4e-2),
}
