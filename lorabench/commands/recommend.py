"""``lorabench recommend RUN``: the capture set (strategy auto) that minimises the expected step
under a workload within the budgets, from what a run measured, next to max, pow2 and dense and
next to what ``lorabench report`` recommends among the measured strategies (the same comparison:
``lorabench.analysis.compare``); added to the run's ``recommendation.json`` under ``"auto"``, with
the run's ``"coverage"``.

Exit status 0 when at least one (kernels, max_loras) gets a set; each that gets none (no set fits
the budgets, not even max; or nothing is comparable with max) is named in a line. Exit status 2,
one line on stderr and nothing written, when none gets a set.
"""

from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from lorabench.analysis.cpu_cache import CachePolicy
from lorabench.analysis.decision import AutoDecision, CacheChoice, ResidencyDecision
from lorabench.analysis.optimise import auto_decisions
from lorabench.analysis.reasons import PLAIN, reason, versus_card
from lorabench.analysis.recommendation_json import auto_json, plan_json, priced_json, residency_json
from lorabench.analysis.residency import residency_decisions
from lorabench.analysis.view import RunView
from lorabench.commands import recommendation_file
from lorabench.commands.tables import mib
from lorabench.config.flags import to_int, to_positive
from lorabench.config.limits import DTYPE_BYTES
from lorabench.config.peft import WEIGHTS_FILE, adapter_elements, adapter_folders, is_count
from lorabench.config.lengths import parse_lengths
from lorabench.config.residency import OUTPUT_TOKENS, Adapters, check_residency
from lorabench.config.spec import MAX_STEPS, coerce
from lorabench.config.strategies import STRATEGIES
from lorabench.config.workload import parse_workload
from lorabench.errors import UserError


def auto_table(decisions: list[AutoDecision]) -> Table:
    """One row per (kernels, max_loras): the auto set, its predicted step and costs, and its gain
    over the baselines as the model prices them (how each value was priced is on the lines below;
    the figures are the ones recommendation.json holds)."""
    baselines = [name for name, s in STRATEGIES.items() if s.fixed]
    table = Table(title=f"strategy auto under {decisions[0].workload}: expected step (model), mean over c",
                  box=box.SIMPLE_HEAD, padding=(0, 0), pad_edge=False)
    for col in ["kernels", "L", "set", "ms", "graphs", "MiB", "start s", *(f"vs {b}" for b in baselines)]:
        table.add_column(col, justify="left" if col in ("kernels", "set") else "right", overflow="fold", no_wrap=col != "kernels")
    for d in decisions:
        if d.chosen is None:
            table.add_row(d.kernels, str(d.max_loras), "none", *["-"] * (4 + len(baselines)))
            continue
        r = auto_json(d)
        a = r["auto"]
        gains = []
        for name in baselines:
            b = r["baselines"].get(name)
            gains.append("-" if b is None else f"{b['auto_gain_pct']:+.2f}%" + ("" if b["fits_budgets"] else " (over budget)"))
        mem = "-" if a["graph_mem_bytes"] is None else f"{a['graph_mem_bytes'] / 2**20:.0f}"
        table.add_row(d.kernels, str(d.max_loras), "[" + ",".join(map(str, a["counts"])) + "]", f"{a['expected_ms']:.3f}",
                      str(a["lora_graphs"]), mem, "-" if a["startup_s"] is None else f"{a['startup_s']:.2f}", *gains)
    return table


def recommend(run_dir: Path, workload: str, graph_memory_budget: str | None, startup_budget: str | None,
              kernels: str | None, max_loras: str | None, console: Console) -> int:
    view = RunView.read(run_dir)
    cov = view.coverage
    incomplete = cov.incomplete() if cov is not None else None
    memory = coerce("graph_memory_budget", graph_memory_budget) * 2**20 if graph_memory_budget is not None else None
    startup = coerce("startup_budget", startup_budget) if startup_budget is not None else None
    try:
        decisions = auto_decisions(view, workload, memory, startup,
                                   kernels=coerce("kernels", kernels) if kernels else None,
                                   max_loras=coerce("max_loras", max_loras) if max_loras else None)
    except ValueError as e:
        raise UserError(str(e)) from None
    if not decisions:
        raise UserError(f"{run_dir}: nothing to optimise (no lorabench-kernel points matching --kernels/--max-loras)")
    none = [d for d in decisions if d.chosen is None]
    if len(none) == len(decisions):
        raise UserError(f"{run_dir}: nothing to recommend" + (f" (incomplete run, {incomplete})" if incomplete else "") + ": "
                        + "; ".join(f"{d.kernels} max_loras {d.max_loras}: {reason(d)}" for d in none))
    if incomplete:
        console.print(f"incomplete run, {incomplete}; every comparison is over the concurrencies where max has every point")
    console.print(auto_table(decisions))
    for d in decisions:
        where = f"{d.kernels} max_loras={d.max_loras}"
        if d.chosen is None:
            console.print(f"{where}: no set: {reason(d)}")
            continue
        if reason(d) != PLAIN:
            console.print(f"{where}: auto is {d.chosen.counts}: {reason(d)}")
        if d.inconclusive:
            console.print(f"{where}: inconclusive: {d.more_measuring or 'more steps per point would settle it'}")
        m = d.measured
        chosen = "nothing proposed" if m.chosen is None else f"{m.chosen} {m.costs.counts}"
        console.print(f"{where}: measured, as lorabench report says: {chosen}: {reason(m)}")
        if m.max_costs is not None and m.max_costs.mixed_graphs:
            mixed = m.costs if m.costs is not None else m.max_costs
            console.print(f"  not in the model's graphs, memory and startup above, nor in the budgets: the mixed steps' "
                          f"PIECEWISE graphs, measured: {mixed.describe()} ({m.max_costs.describe()} for max)")
        console.print(f"  model values: {', '.join(f'{v} {k}' for k, v in plan_json(d.chosen)['model_values'].items())}")
        console.print(f"  validate with  {d.validate}")
        console.print(f"  vLLM: {d.vllm.flags}  ({d.vllm.note})")
    path = recommendation_file.write_section(run_dir, "auto", decisions[0].workload, [auto_json(d) for d in decisions],
                                             coverage=cov.to_dict() if cov else None)
    console.print(f"-> {path}")
    return 0


def _mib(b) -> str:
    return mib(b) or "-"


def residency_table(d: ResidencyDecision) -> Table:
    """One row per (max_loras, capture set) priced under the residency workload: expected step
    (ms), tokens/s, tokens per step, requests waiting, loads per 1000 steps, graph and slot memory,
    and the KV-cache tokens they take (the figures recommendation.json holds)."""
    table = Table(title=(f"{d.kernels}: {d.adapters.count} adapters under {d.workload}, {d.clients} clients, "
                         f"{d.adapters.output_tokens} tokens per request (expected, from the run's points)"),
                  box=box.SIMPLE_HEAD, padding=(0, 0), pad_edge=False)
    for col in ["L", "set", "ms", "tok/s", "tok/step", "wait", "loads/1k", "graph MiB", "slot MiB", "KV tok"]:
        table.add_column(col, justify="left" if col == "set" else "right", no_wrap=col != "set",
                         overflow="fold" if col == "set" else "ellipsis", min_width=len(col) if col != "set" else 4)
    for p in d.configs:
        c = priced_json(p)
        mark = " *" if d.chosen is not None and (p.max_loras, p.counts) == (d.chosen.max_loras, d.chosen.counts) else ""
        kv = "-" if c["kv_tokens_given_up"] is None else f"{c['kv_tokens_given_up']:,}"
        table.add_row(str(c["max_loras"]), p.set_name + mark, f"{c['expected_step_ms']:.3f}", f"{c['tokens_per_s']:,.0f}",
                      f"{c['tokens_per_step']:.1f}", f"{c['waiting_per_step']:.1f}", f"{1000 * c['loads_per_step']:.1f}",
                      _mib(c["graph_mem_bytes"]), _mib(c["slot_bytes"]), kv)
    return table


def cache_table(choice: CacheChoice) -> Table:
    """One row per CPU cache size priced: host memory, misses, expected step and tokens/s."""
    table = Table(title="CPU cache (--max-cpu-loras): each size priced for the choice", box=box.SIMPLE_HEAD,
                  padding=(0, 0), pad_edge=False)
    for col in ["adapters", "host GiB", "misses/1k", "ms", "tok/s"]:
        table.add_column(col, justify="right", no_wrap=True)
    for c in choice.sizes:
        mark = " *" if choice.chosen is not None and c.size == choice.chosen.size else ""
        table.add_row(f"{c.size}{mark}", f"{c.host_gib:.2f}", f"{1000 * c.misses_per_step:.1f}", f"{c.step_ms:.3f}",
                      f"{c.tokens_per_s:,.0f}")
    return table


def adapter_host_bytes(folders: list[Path], view: RunView) -> float:
    """One adapter's bytes in vLLM's CPU cache: the user's adapters' mean at their own ranks in
    the run's dtype."""
    return sum(adapter_elements(f) for f in folders) / len(folders) * DTYPE_BYTES[view.first["dtype"]]


def recommend_residency(run_dir: Path, workload: str, adapters: str, clients: str | None, output_tokens: str | None,
                        max_cpu_loras: str | None, gpu_memory_budget: str | None, kernels: str | None,
                        max_loras: str | None, console: Console, host_memory_budget: str | None = None) -> int:
    """``lorabench recommend RUN --adapters N``: max_loras, capture set and CPU cache for N
    adapters under a workload (``lorabench.analysis.residency``; the CPU cache, when not given,
    ``lorabench.analysis.cpu_cache``)."""
    if host_memory_budget is not None and max_cpu_loras is not None:
        raise UserError("--host-memory-budget chooses --max-cpu-loras: give one of them")
    host_budget = to_positive("host_memory_budget", host_memory_budget) * 2**30 if host_memory_budget is not None else None
    view = RunView.read(run_dir)
    # a folder of PEFT adapters: their count (the run's slots, padded to its rank, price their loads)
    folders = None if is_count(adapters) else adapter_folders(adapters, "--adapters")
    n = coerce("adapters", adapters if folders is None else len(folders))
    out = parse_lengths(output_tokens if output_tokens is not None else OUTPUT_TOKENS, "--output-tokens", MAX_STEPS)
    cpu = coerce("max_cpu_loras", max_cpu_loras) if max_cpu_loras is not None else None
    c = to_int("concurrency", clients, 1) if clients is not None else None
    budget = to_positive("gpu_memory_budget", gpu_memory_budget) * 2**30 if gpu_memory_budget is not None else None
    slots = coerce("max_loras", max_loras) if max_loras else None
    try:
        wl = parse_workload(workload)
        check_residency(wl, n, None, [1])  # a max_loras above the CPU cache is left out, and says so
        policy = None if cpu is not None else CachePolicy(
            None if folders is None else adapter_host_bytes(folders, view), host_budget)
        files = () if folders is None else tuple((f / WEIGHTS_FILE).stat().st_size for f in folders)  # what misses read
        decisions = residency_decisions(view, workload, Adapters(n, cpu, out, files), c, budget,
                                        kernels=coerce("kernels", kernels) if kernels else None, max_loras=slots,
                                        source=None if folders is None else str(adapters).strip(), cache=policy)
    except ValueError as e:
        raise UserError(str(e)) from None
    if not decisions:
        raise UserError(f"{run_dir}: nothing to price (no fixed points of lorabench's kernels matching --kernels/--max-loras)")
    if all(d.chosen is None for d in decisions):
        raise UserError(f"{run_dir}: nothing to recommend: " + "; ".join(f"{d.kernels}: {reason(d)}" for d in decisions))
    for d in decisions:
        console.print(residency_table(d))
        if d.chosen is None:
            console.print(f"{d.kernels}: nothing to recommend: {reason(d)}")
            continue
        c = priced_json(d.chosen)
        choice = d.cpu_cache  # chosen for the configuration chosen with every adapter in it
        console.print(f"{d.kernels}: max_loras {c['max_loras']}, {d.chosen.set_name} {c['counts']}: "
                      f"{c['expected_step_ms']:.3f} ms per step, {c['tokens_per_s']:,.0f} tokens/s, "
                      f"{1000 * c['loads_per_step']:.1f} loads per 1000 steps"
                      + (" (every adapter in the CPU cache: the cache chosen is priced below)" if choice else "")
                      + f"; {reason(d)}")
        if d.card is not None:
            console.print(f"  against the card's max_loras {d.card.max_loras} (max): {round(d.card.tokens_per_s, 1):,.0f} "
                          f"tokens/s; the choice: {versus_card(d)}")
        cpu_slots = d.adapters.cpu_slots
        console.print(f"  memory: graphs {_mib(c['graph_mem_bytes'])} MiB + {c['max_loras']} adapter slots {_mib(c['slot_bytes'])} MiB"
                      + (f" = {c['kv_tokens_given_up']:,} KV-cache tokens given up" if c["kv_tokens_given_up"] is not None else "")
                      + (f"; CPU cache {cpu_slots} adapters = {cpu_slots * c['slot_bytes'] / c['max_loras'] / 2**30:.1f} GiB "
                         "of host memory" if choice is None else ""))
        if choice is not None:
            if choice.sizes:
                console.print(cache_table(choice))
            if choice.chosen is None:
                console.print(f"  CPU cache: not chosen: {choice.why}")
            else:
                x = choice.chosen
                console.print(f"  CPU cache: --max-cpu-loras {x.size} ({x.host_gib:.2f} GiB of host memory per worker, "
                              f"{1000 * x.misses_per_step:.1f} misses per 1000 steps, {x.tokens_per_s:,.0f} tokens/s): "
                              f"{choice.why}")
        for note in d.notes:
            console.print(f"  note: {note}")
        for x in d.load_paths:
            console.print(f"  loads {x.path}: {x.load_ms:.3f} ms each -> {x.step_ms:.3f} ms per step, "
                          f"{x.tokens_per_s:,.0f} tokens/s ({x.engine})")
        console.print(f"  vLLM: {d.vllm.flags}  ({d.vllm.note})")
        console.print(f"  validate with  {d.validate}")
    key = f"{decisions[0].workload} over {decisions[0].adapters.count} adapters"
    console.print(f"-> {recommendation_file.write_section(run_dir, 'residency', key, [residency_json(d) for d in decisions])}")
    return 0
