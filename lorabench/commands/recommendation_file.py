"""A run's recommendation.json: ``lorabench report`` writes its top level and recommendations and
keeps the sections ``lorabench recommend`` added (``auto``, ``residency``, ``serving``); recommend replaces its
own section's entry and keeps the rest. The entries are ``lorabench.analysis.recommendation_json``'s."""

import json
from pathlib import Path

from lorabench.analysis.recommendation_json import SCHEMA
from lorabench.storage.files import write_json

NAME = "recommendation.json"
ADDED = ("auto", "residency", "serving")  # the sections lorabench recommend adds


def read(run_dir: Path) -> dict:
    """The run's file as it is ({} when there is none or it is not a JSON object)."""
    path = Path(run_dir) / NAME
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        data = {}
    return data if isinstance(data, dict) else {}


def write_report(run_dir: Path, report: dict) -> Path:
    """The report's part, with the sections recommend added before kept."""
    added = read(run_dir)
    data = {**report, **{s: added[s] for s in ADDED if added.get(s)}}
    path = Path(run_dir) / NAME
    write_json(path, data)
    return path


def write_section(run_dir: Path, section: str, key: str, entries: list[dict], **top) -> Path:
    """``entries`` under ``section`` -> ``key``, and ``top`` (e.g. the run's coverage) at the top
    level; everything else kept."""
    data = read(run_dir) or {"schema": SCHEMA}
    data.update(top)
    data.setdefault(section, {})[key] = entries
    path = Path(run_dir) / NAME
    write_json(path, data, default=float)
    return path
