"""Request lengths (``--input-tokens``, ``--output-tokens``): a fixed count, or whole numbers drawn uniformly
from a range."""

import random
from dataclasses import dataclass

from lorabench.errors import UserError


@dataclass(frozen=True)
class Lengths:
    """Token counts ``low`` to ``high`` (both included), uniform; fixed when they are equal."""

    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


def parse_lengths(text: str, where: str, most: int | None = None) -> Lengths:
    """``N`` (every request N tokens) or ``LO-HI`` (uniform from LO to HI), HI at most ``most``;
    one line on bad input."""
    lo, sep, hi = str(text).strip().partition("-")
    try:
        low, high = int(lo), int(hi if sep else lo)
    except ValueError:
        raise UserError(f"{where}: {text!r} is neither a token count N nor a range LO-HI") from None
    if not 1 <= low <= high:
        raise UserError(f"{where}: {text!r} needs 1 <= LO <= HI tokens")
    if most is not None and high > most:
        raise UserError(f"{where}: {text!r} is above {most} tokens")
    return Lengths(low, high)


def as_lengths(value: "Lengths | int | str") -> Lengths:
    """Lengths as given, a count (fixed) or its text (N or LO-HI), e.g. a row's ``output_tokens``;
    a ValueError where it is none of them (a row is not the user's input)."""
    if isinstance(value, Lengths):
        return value
    if isinstance(value, float) and value.is_integer():  # a whole count in a float column (pandas, beside nulls)
        value = int(value)
    try:
        return parse_lengths(value, "a request length")
    except UserError as e:
        raise ValueError(str(e)) from None
