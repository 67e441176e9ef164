"""Files written whole: into a hidden temporary beside the target, then renamed over it, so a
reader (or a run resumed after an interrupt) never sees half a file, and a dataset of part files
never lists the temporary."""

import json
import os
from collections.abc import Callable
from pathlib import Path


def write_whole(target: Path, write: Callable[[Path], None]) -> None:
    """``write(temporary)``, then the temporary renamed over ``target``."""
    target = Path(target)
    tmp = target.with_name(f".{target.name}.tmp")
    write(tmp)
    os.replace(tmp, target)


def write_text(target: Path, text: str) -> None:
    write_whole(target, lambda tmp: tmp.write_text(text))


def write_json(target: Path, data, indent: int = 2, default=None) -> None:
    """``data`` as JSON with a final newline."""
    write_text(target, json.dumps(data, indent=indent, default=default) + "\n")
