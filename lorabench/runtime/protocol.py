"""What a worker tells the process that started it: one line per message on its stdout,
``@@<kind> <json>``, each kind a dataclass. ``Protocol.encode`` and ``Protocol.decode`` are the one
pair every message goes through; a sweep's workers speak ``SWEEP`` (a tune's workers their own,
``lorabench.commands.tune.worker``). Imports no torch: the sweep, and the tests' stand-in worker,
use it too."""

import json
import sys
import typing
from dataclasses import asdict, dataclass, fields, is_dataclass

from lorabench.storage.checks import Checked
from lorabench.storage.row import Env, Row
from lorabench.storage.steps import Loads, Steps

PREFIX = "@@"
_STDOUT = sys.stdout  # a worker's protocol stream, kept before it points sys.stdout at its log


@dataclass(frozen=True)
class Measured:
    """A point's row, and its timed steps (None for a failed point)."""

    row: Row
    steps: Steps | None = None


def _build(cls, raw: dict):
    """``cls`` from its JSON object: dataclass fields (``Row``, ``Steps | None``) built in turn."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in fields(cls):
        if f.name not in raw:
            continue
        value = raw[f.name]
        inner = next((t for t in (typing.get_args(hints[f.name]) or (hints[f.name],)) if is_dataclass(t)), None)
        values[f.name] = _build(inner, value) if inner is not None and value is not None else value
    return cls(**values)


@dataclass(frozen=True)
class Protocol:
    """The messages of one kind of worker: kind -> its dataclass."""

    kinds: dict[str, type]

    def encode(self, message) -> str:
        kind = next(k for k, cls in self.kinds.items() if type(message) is cls)
        return f"{PREFIX}{kind} {json.dumps(asdict(message))}"

    def decode(self, line: str):
        """The message a line carries; None for a line that is not one (a worker's stray output).
        A protocol line that does not decode raises ValueError."""
        head, _, body = line.partition(" ")
        cls = self.kinds.get(head[len(PREFIX):]) if head.startswith(PREFIX) else None
        if cls is None:
            return None
        try:
            return _build(cls, json.loads(body))
        except (TypeError, ValueError) as e:
            raise ValueError(f"a {head} line that does not decode ({type(e).__name__}: {e})") from None

    def emit(self, message) -> None:
        """Send a message: a worker's line on its protocol stream."""
        _STDOUT.write(self.encode(message) + "\n")
        _STDOUT.flush()


SWEEP = Protocol({"row": Measured, "check": Checked, "loads": Loads, "env": Env})
