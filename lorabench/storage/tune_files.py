"""A ``lorabench tune`` folder's files, as sweeps and vLLM read them:

- ``lorabench_tuned.json``: the tune's machine and dtype, and lorabench's kernels' tuned entries
  (``{"kernel": "triton"|"fused", "shape": [...], "config": {...}, ...}``), what ``--tuned`` loads;
- ``vllm/{GPU}_SHRINK.json``, ``{GPU}_EXPAND_TRUE.json``, ``{GPU}_EXPAND_FALSE.json``: vLLM's
  ``VLLM_TUNED_CONFIG_FOLDER`` layout, ``[max_loras][num_slices][m][k][n] -> config``;
- ``cache.jsonl`` (every timed config, for resuming) and ``tune.md`` are the tune's own.
"""

import json
from pathlib import Path

from lorabench.errors import UserError

TUNED_FILE = "lorabench_tuned.json"


def write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)  # an interrupt never leaves half a file


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
