"""``lorabench report RUN``: plots (PNG), ``report.md`` and ``recommendation.json`` in a run's folder."""

import json
from pathlib import Path

from rich.console import Console

from lorabench.analysis.compare import compare, resampler
from lorabench.analysis.points import (
    configs,
    expected_steps,
    lora_overhead,
    ok_points,
    same_gpu,
)
from lorabench.analysis.recommend import recommend
from lorabench.analysis.roofline import floors
from lorabench.commands.report import plots as p
from lorabench.commands.report import residency
from lorabench.commands.report.labels import unit
from lorabench.commands.report.markdown import render_markdown
from lorabench.storage.results import load_run
from lorabench.storage.runs import Coverage, coverage, read_info, run_status
from lorabench.storage.samples import read_samples, step_times


def incomplete_line(run_info: dict, cov: Coverage | None) -> str | None:
    """One line saying how a run is incomplete (its status, planned vs finished points, which
    configurations lack how many), or None for a finished run with every planned point."""
    if cov is not None:
        return cov.incomplete()
    status = run_status(run_info) if run_info else None
    if status in (None, "finished"):
        return None
    return f"{status} (run.json lists no plan: which points are missing is not known)"


def write_report(run_dir: Path, console: Console | None = None) -> list[Path]:
    """Every figure the run's rows allow, report.md and recommendation.json; returns their paths.
    With a console, an incomplete run is said there too, in one line. Comparisons are made only
    between points measured on one GPU (max's, per kernels and max_loras: ``same_gpu``), with
    intervals from the run's samples when it kept them."""
    run_dir = Path(run_dir)
    df = load_run(run_dir)
    steps = read_samples(run_dir)  # every timed step, read once: the intervals' and the residency section's
    times = step_times(steps)
    rs = resampler(times)
    same, gpus = same_gpu(df)
    run_info = read_info(run_dir)
    cov = coverage(run_dir, df)
    planned = cov.planned_concurrency if cov else None
    incomplete = incomplete_line(run_info, cov)
    if console is not None and incomplete:
        console.print(f"{run_dir}: incomplete run, {incomplete}")
    cfg, exp, over = configs(df), expected_steps(same), lora_overhead(same)
    plots = {
        "latency_vs_active": p.latency_vs_active(df, run_dir / "latency_vs_active.png"),
        "memory_startup": p.memory_startup(df, cfg, run_dir / "memory_startup.png"),
    }
    if not exp.empty:
        plots["latency_vs_concurrency"] = p.latency_vs_concurrency(same, exp, run_dir / "latency_vs_concurrency.png")
        plots["speedup"] = p.speedup(same, exp, run_dir / "speedup_vs_max.png")
        first = min(exp.workload.unique())
        plots["latency_vs_memory"] = p.latency_vs_memory(same, compare(df, [first], planned, exp[exp.workload == first]),
                                                         cfg, run_dir / "latency_vs_memory.png")
    if ok_points(df).kernels.nunique() > 1:
        plots["backends"] = p.backends(same, over, run_dir / "backends.png")
    fl = floors(same)
    if not fl.empty:
        plots["roofline"] = p.roofline(df, fl, run_dir / "roofline.png")
    res = residency.build(same, run_dir, times, steps)
    if res is not None and res.recommendations:
        runs = ok_points(same)[lambda d: d["mode"] == "residency"]
        plots["residency"] = p.residency(df, res.recommendations, runs, run_dir / "residency.png")
    rec = recommend(df, planned=planned, samples=rs)
    rec = {**{k: v for k, v in rec.items() if k != "recommendations"}, "coverage": cov.to_dict() if cov else None,
           "recommendations": rec["recommendations"]}
    rec_path = run_dir / "recommendation.json"
    if rec_path.is_file():  # keep what `lorabench recommend` added (strategy auto, residency: per workload)
        try:
            added = json.loads(rec_path.read_text())
        except ValueError:
            added = {}
        for section in ("auto", "residency"):
            if isinstance(added, dict) and added.get(section):
                rec[section] = added[section]
    rec_path.write_text(json.dumps(rec, indent=2) + "\n")
    md_path = run_dir / "report.md"
    extra = residency.markdown(res, plots.get("residency"), unit(df)) if res is not None else []
    md = render_markdown(df, run_info, cfg, exp, over, fl, rec, plots, incomplete, samples=rs, gpus=gpus, extra=extra)
    if (run_dir / "NOTE.md").is_file():  # a caveat kept next to a run's data
        head, _, rest = md.partition("\n")
        md = f"{head}\n\n> **Read [NOTE.md](NOTE.md) first:** a caveat on this run's data.\n{rest}"
    md_path.write_text(md)
    return list(plots.values()) + [md_path, rec_path]
