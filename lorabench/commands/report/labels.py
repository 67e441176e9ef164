"""How a report names and orders what a run measured: backends and strategies in their usual
order (not alphabetical), labels that drop what every row shares, and the unit of its times."""

import pandas as pd

from lorabench.config.backends import label_order
from lorabench.config.strategies import report_order


def strategies(df: pd.DataFrame) -> list[str]:
    return sorted(df.strategy.unique(), key=report_order)


def backends(df: pd.DataFrame) -> list[str]:
    return sorted(df.kernels.unique(), key=lambda k: (label_order(k), k))


def in_order(cfg: pd.DataFrame, by=("kernels", "max_loras", "strategy")) -> pd.DataFrame:
    """Configurations in report order: backends and strategies in their usual order, not alphabetical."""
    rank = {"kernels": lambda k: (label_order(k), k), "strategy": report_order}
    return cfg.sort_values(list(by), key=lambda col: col.map(rank[col.name]) if col.name in rank else col)


def unit(df: pd.DataFrame) -> str:
    return "GPU ms" if (df.device == "cuda").all() else "CPU wall ms"


def label(df: pd.DataFrame, kernels: str, strategy: str) -> str:
    return strategy if df.kernels.nunique() == 1 else f"{kernels}/{strategy}"


