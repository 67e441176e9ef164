"""``lorabench compare RUN_A RUN_B``: an A/B of two runs, fit to gate a CI pipeline.

Prints, per point both runs measured on the same GPU, B's median step against A's (percent,
positive = B slower) with its 95 % bootstrap interval, the rank test's p-value and a verdict with
the margin, then the geometric mean over the points; writes ``<RUN_B>/compare-<A>.json`` and a
plot (``<RUN_B>/compare-<A>.png`` or ``--plot PATH``). The matching and the statistics are
``lorabench.analysis.ab``'s.

Two runs set to different ranks (or models, dtypes) as a whole are compared point by point on
everything else: that difference is the A/B (rank-8 adapters at rank 8 against padded to 64).

Exit status 0; 1 with ``--fail-if-slower PCT`` when B is slower than A by more than PCT percent
with confidence (the overall interval's low end above PCT); 2, one line on stderr, for bad input.
"""

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot loads)
import numpy as np  # noqa: E402
from rich import box  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402
from rich.table import Table  # noqa: E402

from lorabench.analysis.ab import DEFAULT_MARGIN, Comparison, compare_runs, label  # noqa: E402
from lorabench.errors import UserError  # noqa: E402
from lorabench.stats import Verdict, describe  # noqa: E402
from lorabench.storage.figures import save_png  # noqa: E402

MAX_ROWS = 40  # more compared points than this: the table shows the changed ones, the JSON all
LISTED = 4  # points named on the "only in A/B" lines
STYLE = {Verdict.SLOWER: "red", Verdict.FASTER: "green"}
WORD = {Verdict.SLOWER: "slower", Verdict.FASTER: "faster", Verdict.SAME: "same", None: "n/a"}
COLOUR = {Verdict.SLOWER: "tab:red", Verdict.FASTER: "tab:green", Verdict.SAME: "tab:gray"}


def percent(flag: str, value: str | None, default: float | None) -> float | None:
    """A flag's percentage: a finite number >= 0, else one UserError line."""
    if value is None:
        return default
    try:
        pct = float(str(value).strip().rstrip("%"))
    except ValueError:
        pct = math.nan
    if not math.isfinite(pct) or pct < 0:
        raise UserError(f"{flag} takes a percentage >= 0, not {value!r}")
    return pct


def _signed(x: float) -> str:
    """Two decimals, fewer past 10 and 100 % (a CPU run's intervals are wide): ``+0.12``, ``-12.3``."""
    d = 2 if abs(x) < 9.995 else 1 if abs(x) < 99.95 else 0
    text = f"{x:+.{d}f}"
    return text.replace("-", "+", 1) if float(text) == 0 else text


def _p(p: float | None) -> str:
    return "-" if p is None else "<0.001" if p < 0.001 else f"{p:.3f}"


def diff_table(c: Comparison) -> Table:
    """One row per compared point (the changed ones first when there are more than MAX_ROWS):
    A's and B's median, B vs A in percent with its interval, p and the verdict; 80 columns wide."""
    rows = c.points
    if len(rows) > MAX_ROWS:
        rows = sorted(rows, key=lambda p: (p.verdict in (None, Verdict.SAME), -abs(p.diff.estimate) if p.diff else 0))
        rows = rows[:MAX_ROWS]
    vary = c.vary()
    unit = "ms CPU wall" if any(d.startswith("cpu@") for d in c.b.devices) else "ms GPU"
    table = Table(title=f"B vs A: median step ({unit}), +% = B slower, margin ±{c.margin_pct:g} %",
                  title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 0), pad_edge=False)
    table.add_column("point", justify="left", overflow="fold", ratio=1)
    for name in ("A", "B", "diff %", "95 % CI", "p", "verdict"):
        table.add_column(name, justify="right", no_wrap=True)
    for p in rows:
        ci = "-" if p.diff is None else f"{_signed(p.diff.low)}…{_signed(p.diff.high)}"
        est = "-" if p.diff is None else _signed(p.diff.estimate)
        style = STYLE.get(p.verdict, "")
        word = f"[{style}]{WORD[p.verdict]}[/]" if style else WORD[p.verdict]
        table.add_row(escape(label(p.key, vary)), _ms(p.median_a), _ms(p.median_b), est, ci, _p(p.p_value), word)
    return table


def _ms(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.3f}" if x < 100 else f"{x:.1f}"


def _listed(keys: list[tuple], vary) -> str:
    names = [label(k, vary) for k in keys[:LISTED]]
    more = len(keys) - len(names)
    return escape(", ".join(names)) + (f" (+{more} more)" if more else "")


def plot(c: Comparison, path: Path) -> Path:
    """Per point B vs A (percent) with its interval as an error bar, the ±margin band shaded, the
    overall geometric mean as a dashed line."""
    pts = [p for p in c.points if p.diff is not None]
    n = len(pts)
    fig, ax = plt.subplots(figsize=(min(20.0, max(6.0, 0.3 * n + 2)), 4.2))
    ax.axhspan(-c.margin_pct, c.margin_pct, color="tab:blue", alpha=0.12, label=f"±{c.margin_pct:g} % margin")
    ax.axhline(0, color="black", linewidth=0.6)
    x = np.arange(n)
    for v in (Verdict.SAME, Verdict.SLOWER, Verdict.FASTER):
        sel = [i for i, p in enumerate(pts) if p.verdict is v]
        if not sel:
            continue
        est = np.array([pts[i].diff.estimate for i in sel])
        err = np.array([[pts[i].diff.estimate - pts[i].diff.low for i in sel],
                        [pts[i].diff.high - pts[i].diff.estimate for i in sel]])
        ax.errorbar(x[sel], est, yerr=np.clip(err, 0, None), fmt="o", markersize=4, capsize=2,
                    color=COLOUR[v], label=f"{v.value} ({len(sel)})")
    if c.overall is not None:
        o = c.overall
        ax.axhline(o.estimate, color="tab:purple", linestyle="--", linewidth=1,
                   label=f"geometric mean {_signed(o.estimate)} % [{_signed(o.low)}, {_signed(o.high)}]")
    vary = c.vary()
    if n <= 60:
        ax.set_xticks(x, [label(p.key, vary) for p in pts], rotation=90, fontsize=7)
    else:
        ax.set_xlabel(f"{n} points (labels in the JSON)")
    ax.set_ylabel("B vs A, median step (%)")
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_title(f"B = {c.b.name} vs A = {c.a.name}\n+ = B slower; bars: 95 % interval; "
                 f"shaded: ±{c.margin_pct:g} % margin", fontsize=8)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_png(fig, path)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot write the plot {path}: {e}") from None
    finally:
        plt.close(fig)
    return path


def compare(run_a: Path, run_b: Path, fail_if_slower: str | None, margin: str | None, plot_path: Path | None,
            console: Console) -> int:
    margin_pct = percent("--margin", margin, DEFAULT_MARGIN)
    fail_pct = percent("--fail-if-slower", fail_if_slower, None)
    c = compare_runs(run_a, run_b, margin_pct)
    console.print(escape(f"A: {c.a.path} ({c.a.where()})"), highlight=False)
    console.print(escape(f"B: {c.b.path} ({c.b.where()})"), highlight=False)
    if c.across:
        changes = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in c.across.items())
        console.print(escape(f"B differs from A in {changes}: points matched on everything else"), highlight=False)
    console.print(diff_table(c))
    if len(c.points) > MAX_ROWS:
        console.print(f"{MAX_ROWS} of {len(c.points)} points shown, changed ones first (all in the JSON)")
    vary = c.vary()
    if c.other_device:
        console.print(f"[yellow]{len(c.other_device)} matching point{'s' * (len(c.other_device) != 1)} left out "
                      f"as measured on another GPU[/]", highlight=False)
    for side, keys in (("A", c.only_a), ("B", c.only_b)):
        if keys:
            console.print(f"{len(keys)} point{'s' * (len(keys) != 1)} only in {side}, not compared: {_listed(keys, vary)}",
                          highlight=False)
    n = c.counts()
    tail = f", {n['not enough samples']} with too few samples" if n["not enough samples"] else ""
    words = describe(c.overall, margin_pct)
    console.print(f"overall (geometric mean over {len(c.points) - n['not enough samples']} points): "
                  f"{words if words.startswith(('no ', 'not ')) else 'B ' + words}; {n['slower']} slower, {n['faster']} faster, "
                  f"{n['no difference detected']} same{tail}", highlight=False)

    name = c.a.name
    out = Path(run_b) / f"compare-{name}.json"
    failed = fail_pct is not None and c.slower_beyond(fail_pct)
    data = c.to_dict() | {"fail_if_slower_pct": fail_pct, "failed": failed}
    try:
        out.write_text(json.dumps(data, indent=2) + "\n")
    except OSError as e:
        raise UserError(f"cannot write {out}: {e}") from None
    png = plot(c, Path(plot_path) if plot_path is not None else Path(run_b) / f"compare-{name}.png")
    console.print(escape(f"wrote {out}, {png}"), highlight=False)
    if failed:
        o = c.overall
        console.print(f"[red]FAIL: B is slower than A by {o.estimate:.2f} % (95 % CI {o.low:.2f}…{o.high:.2f}), "
                      f"beyond --fail-if-slower {fail_pct:g} %[/]", highlight=False)
        return 1
    return 0
