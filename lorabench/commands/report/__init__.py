"""``lorabench report RUN``: plots (PNG), ``report.md`` and ``recommendation.json`` in a run's folder."""

from pathlib import Path

from rich.console import Console

from lorabench.analysis.points import lora_overhead
from lorabench.analysis.prefill import prefill_overhead
from lorabench.analysis.recommend import measured_decisions
from lorabench.analysis.recommendation_json import report_json
from lorabench.analysis.roofline import floors
from lorabench.analysis.serving_price import predictions
from lorabench.analysis.view import RunView
from lorabench.commands import recommendation_file
from lorabench.commands.report import plots as p
from lorabench.commands.report import residency
from lorabench.commands.report.drawing import Drawing
from lorabench.commands.report.labels import unit
from lorabench.commands.report.serving import serving_md
from lorabench.commands.report.markdown import render_markdown
from lorabench.storage.runs import Coverage, read_info, run_status


def incomplete_line(run_info: dict, cov: Coverage | None) -> str | None:
    """One line saying how a run is incomplete (its status, planned vs finished points, which
    configurations lack how many), or None for a finished run with every planned point."""
    if cov is not None:
        return cov.incomplete()
    status = run_status(run_info) if run_info else None
    if status in (None, "finished"):
        return None
    return f"{status} (run.json lists no plan: which points are missing is not known)"


def write_reports(run_dirs: list[Path], console: Console | None = None) -> dict[Path, list[Path]]:
    """``write_report`` for each run, every run read first: a folder that is no run is refused
    before any report is written."""
    views = {Path(d): RunView.read(Path(d)) for d in run_dirs}
    return {d: write_report(d, console, view) for d, view in views.items()}


def write_report(run_dir: Path, console: Console | None = None, view: RunView | None = None) -> list[Path]:
    """Every figure the run's rows allow, report.md and recommendation.json; returns their paths.
    With a console, an incomplete run is said there too, in one line. Comparisons are made only
    between points measured on one GPU (max's, per kernels and max_loras: ``same_gpu``), with
    intervals from the run's samples when it kept them. ``view``: the run as read already."""
    run_dir = Path(run_dir)
    view = view or RunView.read(run_dir)
    run_info = read_info(run_dir)
    incomplete = incomplete_line(run_info, view.coverage)
    if console is not None and incomplete:
        console.print(f"{run_dir}: incomplete run, {incomplete}")
    df, same, cfg, exp = view.rows, view.kept, view.configs, view.expected()
    over = lora_overhead(same)
    drawing = Drawing()  # the figures are drawn while the report goes on
    plots = {
        "latency_vs_active": drawing.draw(p.latency_vs_active, df, run_dir / "latency_vs_active.png"),
        "memory_startup": drawing.draw(p.memory_startup, df, cfg, run_dir / "memory_startup.png"),
    }
    if not exp.empty:
        plots["latency_vs_concurrency"] = drawing.draw(p.latency_vs_concurrency, same, exp, run_dir / "latency_vs_concurrency.png")
        plots["speedup"] = drawing.draw(p.speedup, same, exp, run_dir / "speedup_vs_max.png")
        first = min(exp.workload.unique())
        plots["latency_vs_memory"] = drawing.draw(p.latency_vs_memory, same, [c for c in view.comparisons() if c.workload == first],
                                                  cfg, run_dir / "latency_vs_memory.png")
    if view.ok.kernels.nunique() > 1:
        plots["backends"] = drawing.draw(p.backends, same, over, run_dir / "backends.png")
    pre = prefill_overhead(same)
    if not pre.empty and (pre.n_active > 0).any() and pre.base_ms.notna().any():
        plots["overhead_vs_tokens"] = drawing.draw(p.overhead_vs_tokens, df, pre, over, run_dir / "overhead_vs_tokens.png")
    fl = floors(same)
    if not fl.empty:
        plots["roofline"] = drawing.draw(p.roofline, df, fl, run_dir / "roofline.png")
    res = residency.build(view)
    if res is not None and res.decisions:
        plots["residency"] = drawing.draw(p.residency, df, res.decisions, res.runs, run_dir / "residency.png")
    decisions = measured_decisions(view)
    rec = report_json(view, decisions)
    extra = residency.markdown(res, plots.get("residency"), unit(df)) if res is not None else []
    serving = view.compared[(view.compared["mode"] == "serving") & (view.compared.status == "ok")]
    extra += serving_md(serving, unit(df), predictions(view.compared) if len(serving) else None)
    md = render_markdown(view, run_info, over, fl, decisions, plots, incomplete, extra=extra, prefill=pre)
    if (run_dir / "NOTE.md").is_file():  # a caveat kept next to a run's data
        head, _, rest = md.partition("\n")
        md = f"{head}\n\n> **Read [NOTE.md](NOTE.md) first:** a caveat on this run's data.\n{rest}"
    drawing.wait()
    rec_path = recommendation_file.write_report(run_dir, rec)
    md_path = run_dir / "report.md"
    md_path.write_text(md)
    return list(plots.values()) + [md_path, rec_path]
