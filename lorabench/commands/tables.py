"""Tables as text: the markdown tables ``report.md`` and ``tune.md`` are made of."""

import numpy as np
import pandas as pd


def mib(v) -> str | None:
    """Bytes as whole MiB; None for a missing value (a table shows it as "-")."""
    return None if v is None or pd.isna(v) else f"{float(v) / 2**20:.0f}"


def cell(v, spec: str) -> str | None:
    """``spec.format(v)``, or None (a table's "-") for a missing value."""
    return None if pd.isna(v) else spec.format(v)


def index(v) -> int | None:
    """A point's index, or None for a missing one."""
    return None if pd.isna(v) else int(v)


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        if v is None or (isinstance(v, float) and np.isnan(v)):
            return "-"
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)
