"""A ``lorabench tune`` folder's files: what the tune writes (``lorabench_tuned.json`` for sweeps'
``--tuned``, vLLM's ``VLLM_TUNED_CONFIG_FOLDER`` files, ``tune.md``) and how sweeps read them back.
``results`` here are ``summarise``'s per-shape summaries of the cache rows."""

import json
from pathlib import Path

from rich.table import Table

from lorabench.spec import UserError


def summarise(shape, rows: list[dict], viable: int | None) -> dict:
    """A shape's outcome. The tuned config is the fastest correct one, if its median beats the
    default's p10; the winner of many noisy timings is otherwise as likely luck as progress."""
    default = next((r for r in rows if r["default"]), None)
    ok = [r for r in rows if r["status"] == "ok"]
    s = {"shape": shape, "tried": len(rows) - (default is not None), "viable": viable,
         **{k: sum(r["status"] == k for r in rows) for k in ("pruned", "wrong")}, "best": None}
    if default is None or default["status"] != "ok":
        return s
    best = min(ok, key=lambda r: r["us"])
    if best["us"] >= default["p10_us"]:  # within the default's own spread: not worth a change
        best = default
    return {**s, "best": best, "default_config": default["config"], "default_us": default["us"], "tuned_us": best["us"],
            "speedup": default["us"] / best["us"],
            "same_process": best["session"] == default["session"]}


def lorabench_entries(results: list[dict]) -> list[dict]:
    """lorabench's kernels' tuned entries (``fused_lora.load_tuned``, ``triton_lora.load_tuned``),
    with what was measured."""
    return [{"kernel": r["shape"].kernel, "shape": list(r["shape"].key), "op": r["shape"].linear, "config": r["best"]["config"],
             "default_us": r["default_us"], "tuned_us": r["tuned_us"], "speedup": r["speedup"],
             "tuned_p10_us": r["best"]["p10_us"], "tuned_p90_us": r["best"]["p90_us"], "same_process": r["same_process"]}
            for r in results if r["shape"].kernel in ("triton", "fused") and r["best"]]


def write_vllm(folder: Path, gpu: str | None, results: list[dict]) -> None:
    """The best leaf per key, nested [max_loras][num_slices][m][k][n] as vLLM's loader reads it.
    Each leaf holds every key vLLM's default has (num_ctas, group_size_m, max_nreg, ...).
    EXPAND_FALSE gets EXPAND_TRUE's content: lorabench calls expand with add_inputs=True only."""
    tables: dict[str, dict] = {"shrink": {}, "expand": {}}
    for r in results:
        if r["shape"].kernel == "vllm" and r["best"]:
            *path, n = (str(v) for v in r["shape"].key)
            node = tables[r["shape"].op]
            for part in path:
                node = node.setdefault(part, {})
            node[n] = r["best"]["config"]
    folder.mkdir(parents=True, exist_ok=True)
    prefix = (gpu or "CPU").replace(" ", "_").replace("-", "_")  # CPU runs: a name no GPU has
    for name, table in ((f"{prefix}_SHRINK.json", tables["shrink"]), (f"{prefix}_EXPAND_TRUE.json", tables["expand"]),
                        (f"{prefix}_EXPAND_FALSE.json", tables["expand"])):
        write_json(folder / name, table)


def write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)  # an interrupt never leaves half a file


def tuned_file(out_dir) -> dict:
    """A ``lorabench tune`` folder's lorabench_tuned.json ({} if it has none); UserError if unreadable."""
    path = Path(out_dir) / "lorabench_tuned.json"
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
    """The fused kernel's tuned entries in a ``lorabench tune`` folder ([] if it has none)."""
    return tuned_file(out_dir).get("entries", [])


def vllm_folder(out_dir) -> Path:
    """The folder to give vLLM as ``VLLM_TUNED_CONFIG_FOLDER``."""
    return Path(out_dir) / "vllm"


COLUMNS = ["kernel", "linear", "shape", "default µs", "tuned µs", "speed-up", "tried/viable", "config"]


def _cells(r: dict) -> list[str]:
    s, best = r["shape"], r["best"]
    head = [s.kernel if s.op == "fused" else f"{s.kernel} {s.op}", s.linear, ",".join(map(str, s.key))]
    failed = ", ".join(f"{r[k]} {k}" for k in ("pruned", "wrong") if r[k])
    tried = f"{r['tried']}/{'?' if r['viable'] is None else r['viable']}" + (f" ({failed})" if failed else "")
    if best is None:
        return head + ["-", "-", "-", tried, "default failed" if r["tried"] or r["pruned"] else "not run"]
    changed = {k: v for k, v in best["config"].items() if r["default_config"].get(k) != v}
    config = " ".join(f"{k}={v}" for k, v in changed.items()) or "default"
    mark = "" if r["same_process"] else " *"
    return head + [f"{r['default_us']:.2f}", f"{r['tuned_us']:.2f}{mark}", f"{r['speedup']:.2f}x", tried, config]


def markdown(meta: dict, results: list[dict]) -> str:
    e = meta["env"]
    lines = ["# lorabench tune", "",
             f"- machine: {meta['device']}" + (f", {meta['gpu']}" if meta["gpu"] else "") +
             f"; torch {e['torch']}, triton {e['triton']}, git {e['git_sha']}",
             f"- command: `{meta['command']}`",
             f"- {meta['model']}, rank {meta['rank']}, {meta['dtype']}, budget {meta['budget_s']:g} s; timing "
             + ("per launch, median of CUDA-graph replays of "
                f"{meta['launches_per_graph']} launches" if meta["device"] == "cuda" else "CPU wall time in Triton's interpreter")
             + ("; lorabench's kernels without PDL (back-to-back PDL launches overlap, which times throughput, not latency)"
                if meta["device"] == "cuda" else ""),
             "- shapes: triton (op, tokens, K or rank, slices·rank or widest slice, slices, launch count); fused (tokens, k, widest slice, rank, slices, launch count); vLLM (max_loras + 1, "
             "slices, m, k, n), as vLLM looks them up",
             "- tried/viable: candidates timed besides the default, of those left after static pruning",
             "- `*`: tuned and default were timed in different processes (a resumed tune)", ""]
    if meta["device"] != "cuda":
        lines += ["**CPU figures (Triton interpreter), not GPU results.**", ""]
    for kernel in dict.fromkeys(_cells(r)[0] for r in results):
        lines += [f"## {kernel}", "", "| " + " | ".join(COLUMNS[1:]) + " |", "|" + "---|" * (len(COLUMNS) - 1)]
        lines += ["| " + " | ".join(c[1:]) + " |" for c in map(_cells, results) if c[0] == kernel]
        lines.append("")
    return "\n".join(lines)


def summary_table(results: list[dict], meta: dict) -> Table:
    where = meta["gpu"] or "CPU (interpreter; not GPU results)"
    table = Table(title=f"lorabench tune on {where}: {meta['model']}, rank {meta['rank']}, {meta['dtype']}")
    for col in COLUMNS:
        table.add_column(col, justify="right" if "µs" in col or col == "speed-up" else "left", overflow="fold")
    for r in results:
        table.add_row(*_cells(r))
    return table
