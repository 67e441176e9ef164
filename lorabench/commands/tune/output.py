"""What a tune reports: each shape's outcome from its cache rows (``summarise``), the entries of
``lorabench_tuned.json`` and vLLM's files, ``tune.md`` and the console's table."""

import shlex

from rich.table import Table

from lorabench.commands.tables import markdown_table
from lorabench.config.flags import Machine
from lorabench.config.spec import build_spec
from lorabench.config.tune_spec import TuneSpec
from lorabench.errors import UserError

LORABENCH_KERNELS = ("triton", "fused", "gemm")  # their configs go to lorabench_tuned.json; vLLM's to vllm/


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
            for r in results if r["shape"].kernel in LORABENCH_KERNELS and r["best"]]


def vllm_best(results: list[dict]) -> dict[tuple[str, tuple], dict]:
    """vLLM's best config per (op, key). Each holds every key vLLM's default has (num_ctas,
    group_size_m, max_nreg, ...)."""
    return {(r["shape"].op, r["shape"].key): r["best"]["config"] for r in results if r["shape"].kernel == "vllm" and r["best"]}


COLUMNS = ["kernel", "linear", "shape", "default µs", "tuned µs", "speed-up", "tried/viable", "config"]


def _cells(r: dict) -> list[str]:
    s, best = r["shape"], r["best"]
    head = [s.kernel if s.op in ("fused", "gemm") else f"{s.kernel} {s.op}", s.linear, ",".join(map(str, s.key))]
    failed = ", ".join(f"{r[k]} {k}" for k in ("pruned", "wrong") if r[k])
    tried = f"{r['tried']}/{'?' if r['viable'] is None else r['viable']}" + (f" ({failed})" if failed else "")
    if best is None:
        return head + ["-", "-", "-", tried, "default failed" if r["tried"] or r["pruned"] else "not run"]
    changed = {k: v for k, v in best["config"].items() if r["default_config"].get(k) != v}
    config = " ".join(f"{k}={v}" for k, v in changed.items()) or "default"
    mark = "" if r["same_process"] else " *"
    return head + [f"{r['default_us']:.2f}", f"{r['tuned_us']:.2f}{mark}", f"{r['speedup']:.2f}x", tried, config]


def markdown(meta: dict, results: list[dict], earlier: int = 0, earlier_commands: list[str] = ()) -> str:
    """``tune.md``: the last tune's machine and command, then every shape of the folder's tables;
    ``earlier`` of them were measured by earlier tunes into the folder only (``earlier_commands``
    as far as their rows say)."""
    e = meta["env"]
    others = [c for c in earlier_commands if c != meta["command"]]
    lines = ["# lorabench tune", "",
             f"- machine: {meta['device']}" + (f", {meta['gpu']}" if meta["gpu"] else "") +
             f"; torch {e['torch']}, triton {e['triton']}, git {e['git_sha']}",
             f"- command: `{meta['command']}`",
             *([f"- also {earlier} shapes measured by earlier tunes into this folder (its cache.jsonl, same machine and dtype)"
                + (": " + ", ".join(f"`{c}`" for c in others) if others else "")] if earlier else []),
             f"- {meta['model']}, rank {meta['rank']}, {meta['dtype']}, budget {meta['budget_s']:g} s; timing "
             + ("per launch, median of CUDA-graph replays of "
                f"{meta['launches_per_graph']} launches" if meta["device"] == "cuda" else "CPU wall time in Triton's interpreter")
             + ("; lorabench's kernels without PDL (back-to-back PDL launches overlap, which times throughput, not latency)"
                if meta["device"] == "cuda" else ""),
             "- shapes: triton (op, tokens, K or rank, slices·rank or widest slice, slices, launch count); fused (tokens, k, widest slice, rank, slices, launch count); gemm (tokens, K, N); vLLM (max_loras + 1, "
             "slices, m, k, n), as vLLM looks them up",
             "- tried/viable: candidates timed besides the default, of those left after static pruning",
             "- `*`: tuned and default were timed in different processes (a resumed tune)", ""]
    if meta["device"] != "cuda":
        lines += ["**CPU figures (Triton interpreter), not GPU results.**", ""]
    for kernel in dict.fromkeys(_cells(r)[0] for r in results):
        lines += [f"## {kernel}", "", markdown_table(COLUMNS[1:], [c[1:] for c in map(_cells, results) if c[0] == kernel]), ""]
    return "\n".join(lines)


def tune_table(results: list[dict], meta: dict) -> Table:
    where = meta["gpu"] or "CPU (interpreter; not GPU results)"
    table = Table(title=f"lorabench tune on {where}: {meta['model']}, rank {meta['rank']}, {meta['dtype']}")
    for col in COLUMNS:
        table.add_column(col, justify="right" if "µs" in col or col == "speed-up" else "left", overflow="fold")
    for r in results:
        table.add_row(*_cells(r))
    return table


def skipped_line(cache) -> str | None:
    """One line on the cache rows a tune's tables leave out (another device, GPU or dtype; other
    sources of lorabench's kernels), or None."""
    parts = [f"{n} timed on {what}" for what, n in cache.skipped["identity"].items()]
    if cache.skipped["revision"]:
        parts.append(f"{cache.skipped['revision']} timed with other sources of lorabench's kernels")
    ours = " ".join(str(cache.identity[k]) for k in ("device", "gpu", "dtype") if cache.identity.get(k))
    return f"{cache.path}: the tables leave out {', '.join(parts)} (they hold {ours} rows)" if parts else None


def sweep_hint(spec: TuneSpec, machine: Machine, results: list[dict]) -> str:
    """The sweep that runs the folder's configs next to the defaults, at this tune's shapes;
    checked by the sweep's own spec builder, so that the line printed is one the sweep accepts."""
    kernels = [k for k in (*LORABENCH_KERNELS, "vllm") if any(r["best"] and r["shape"].kernel == k for r in results)]
    if not kernels:
        return "no tuned configs: every shape's default config failed (tune.md)"
    flags = {"kernels": ",".join(kernels), "tuned": spec.out, "max_loras": ",".join(map(str, spec.max_loras)),
             "concurrency": ",".join(map(str, spec.tokens))}
    cuda = spec.device == "cuda"
    if spec.model != ("llama-2-7b" if cuda else "tiny"):
        flags["model"] = spec.model
    if spec.tp != 1:
        flags["tp"] = str(spec.tp)
    if spec.rank != 16:
        flags["rank"] = str(spec.rank)
    if spec.dtype != ("float16" if cuda else "float32"):
        flags["dtype"] = spec.dtype
    if not cuda and machine.cuda:
        flags["device"] = "cpu"
    try:
        build_spec(dict(flags), None, machine)
    except UserError as e:
        return f"no sweep takes this folder as it is: {e}"
    return "sweep with them: " + shlex.join(["lorabench", "sweep"] + [a for k, v in flags.items() for a in (f"--{k.replace('_', '-')}", v)])
