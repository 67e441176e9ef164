"""A ``lorabench tune`` folder's files, as sweeps and vLLM read them:

- ``lorabench_tuned.json``: the tune's machine and dtype, and lorabench's kernels' tuned entries
  (``{"kernel": "triton"|"fused", "shape": [...], "config": {...}, ...}``), what ``--tuned`` loads;
- ``vllm/{GPU}_SHRINK.json``, ``{GPU}_EXPAND_TRUE.json``, ``{GPU}_EXPAND_FALSE.json``: vLLM's
  ``VLLM_TUNED_CONFIG_FOLDER`` layout, ``[max_loras][num_slices][m][k][n] -> config``;
- ``cache.jsonl`` (every timed config, for resuming; ``read_cache``) and ``tune.md`` are the
  tune's own. The tables and ``tune.md`` are rebuilt from the whole cache after every shape, so a
  folder accumulates what every tune into it measured.
"""

import json
from numbers import Real
from pathlib import Path

from lorabench.errors import UserError
from lorabench.storage.files import write_text

TUNED_FILE = "lorabench_tuned.json"
CACHE_FILE = "cache.jsonl"

# What every cache row holds, and its type (``read_cache`` checks them); ok rows also hold timings.
ROW_FIELDS = {"kernel": str, "op": str, "shape": list, "config": dict, "default": bool, "status": str, "spent_s": Real}
OK_FIELDS = {"us": Real, "p10_us": Real, "p90_us": Real}


def _row_problem(row) -> str | None:
    """Why ``row`` is not a cache row (None if it is one)."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    fields = ROW_FIELDS | (OK_FIELDS if row.get("status") == "ok" else {})
    for name, kind in fields.items():
        if name not in row:
            return f"no {name!r}"
        if not isinstance(row[name], kind) or (kind is Real and isinstance(row[name], bool)):
            return f"{name!r} is {json.dumps(row[name])[:40]}, not a {'number' if kind is Real else kind.__name__}"
    if not all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in row["shape"]):
        return "'shape' holds something other than strings and integers"
    if not isinstance(row.get("linear", ""), str):
        return "'linear' is not a string"
    return None


def read_cache(path: Path) -> tuple[list[dict], str | None]:
    """A tune's ``cache.jsonl``: its rows, and a one-line notice or None.

    A last line cut short with no newline is what an interrupted tune leaves behind: it is dropped
    from the file (so that the next row starts on a line of its own) and the notice says so. Any
    other line that is not a cache row is a UserError naming the file and line."""
    if not path.is_file():
        return [], None
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e}); move it away or rerun with --fresh") from None
    lines = text.split("\n")
    tail = lines.pop()  # "" when the file ends with a newline: a line still being written otherwise
    rows, notice = [], None
    last = len(lines) + 1 if tail else None  # the number of a line cut short
    for number, line in enumerate(lines + ([tail] if tail else []), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            why = _row_problem(row)
        except ValueError as e:
            row, why = None, f"not JSON: {e}"
        if why is None:
            rows.append(row)
            continue
        if number == last:  # cut short by an interrupt: drop it and carry on
            write_text(path, "".join(f"{x}\n" for x in lines))
            notice = f"{path}: dropped its last line, cut short (an interrupted tune); {len(rows)} measurements kept"
            return rows, notice
        raise UserError(f"{path}: line {number} is not a tune measurement ({why}); "
                        f"move the file away or rerun with --fresh (which keeps it as {path.name}.prev)")
    if tail:  # a complete last row without its newline: the next row must start a line of its own
        with path.open("a") as f:
            f.write("\n")
    return rows, notice


def write_json(path: Path, data) -> None:
    write_text(path, json.dumps(data, indent=1))  # an interrupt never leaves half a file


def vllm_folder(out_dir) -> Path:
    """The folder to give vLLM as ``VLLM_TUNED_CONFIG_FOLDER``."""
    return Path(out_dir) / "vllm"


def write_vllm(folder: Path, gpu: str | None, best: dict[tuple[str, tuple], dict]) -> None:
    """vLLM's files from ``(op, (max_loras, slices, m, k, n)) -> config``, nested as vLLM's loader
    reads them. EXPAND_FALSE gets EXPAND_TRUE's content: lorabench calls expand with
    add_inputs=True only."""
    tables: dict[str, dict] = {"shrink": {}, "expand": {}}
    for (op, key), config in best.items():
        *path, n = (str(v) for v in key)
        node = tables[op]
        for part in path:
            node = node.setdefault(part, {})
        node[n] = config
    folder.mkdir(parents=True, exist_ok=True)
    prefix = (gpu or "CPU").replace(" ", "_").replace("-", "_")  # CPU runs: a name no GPU has
    for name, table in ((f"{prefix}_SHRINK.json", tables["shrink"]), (f"{prefix}_EXPAND_TRUE.json", tables["expand"]),
                        (f"{prefix}_EXPAND_FALSE.json", tables["expand"])):
        write_json(folder / name, table)


def tuned_file(out_dir) -> dict:
    """A ``lorabench tune`` folder's lorabench_tuned.json ({} if it has none); UserError if unreadable."""
    path = Path(out_dir) / TUNED_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("entries", []), list):
            raise ValueError("no list of entries")
        return data
    except ValueError as e:
        raise UserError(f"--tuned: {path} is not a lorabench tune file ({e})") from None


def tuned_table(out_dir) -> list[dict]:
    """lorabench's kernels' tuned entries in a ``lorabench tune`` folder ([] if it has none)."""
    return tuned_file(out_dir).get("entries", [])
