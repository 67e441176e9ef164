"""Workloads measured from a server: ``trace:PATH``, a CSV or JSONL file, either of

- requests, in arrival order, with an ``adapter`` column (any adapter name or id; empty, ``base``,
  ``none``, ``null`` or ``-1`` for a base-model request). A decode step of concurrency c is taken
  to be c consecutive requests (every window of the trace), its active count n the number of
  distinct adapters among them, at most ``max_loras`` (a server cannot run more at once);
- steps, with ``concurrency`` and ``n_active`` columns (and optionally ``base_tokens``), whole
  numbers: the active counts a server logged, used as they are for the concurrencies they cover.

Either way the trace gives ``P(n | c)`` and batches for workload runs, like the built-in
distributions in ``lorabench.config.workload``. pandas, which reads the files, is imported when a
trace is read: a sweep's command line and its workers only need it with a trace.
"""

import os
import random
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lorabench.config.batches import distinct_adapters

if TYPE_CHECKING:
    import pandas as pd

BASE_NAMES = {"", "base", "none", "null", "nan", "-1"}


@cache
def _load(path: str) -> "pd.DataFrame":
    import pandas as pd

    p = Path(path)
    if os.path.isdir(p):
        raise ValueError(f"trace file {path} is a folder, not a CSV or JSONL file")
    if not os.path.isfile(p):
        raise ValueError(f"trace file {path} does not exist")
    jsonl = p.suffix in (".jsonl", ".json")
    try:
        # A blank line in a one-column requests CSV is a base request, so blank lines are kept there.
        df = pd.read_json(p, lines=True) if jsonl else pd.read_csv(p, keep_default_na=False, skip_blank_lines=False)
        if not jsonl and "adapter" not in df.columns:
            df = pd.read_csv(p)
    except ValueError as e:
        raise ValueError(f"trace file {path} cannot be read as {'JSONL' if jsonl else 'CSV'}: {e}") from None
    except OSError as e:
        raise ValueError(f"trace file {path} cannot be read: {e.strerror or e}") from None
    if "adapter" in df.columns:
        return df
    if {"concurrency", "n_active"} <= set(df.columns):
        num = df.apply(pd.to_numeric, errors="coerce")
        counts = num[["concurrency", "n_active"]]
        bad = num[counts.isna().any(axis=1) | (counts % 1 != 0).any(axis=1)  # 0.5 would become 0
                  | (num.n_active < 0) | (num.n_active > num.concurrency) | (num.concurrency < 1)]
        if len(bad):
            raise ValueError(f"trace file {path}: row {bad.index[0]} needs whole numbers with 0 <= n_active <= concurrency")
        if "base_tokens" in num.columns:  # optional per step; when given, a whole number of the step's requests
            base = num.base_tokens
            bad = num[base.notna() & ((base % 1 != 0) | (base < 0) | (base > num.concurrency))]
            if len(bad):
                raise ValueError(f"trace file {path}: row {bad.index[0]} needs a whole base_tokens with 0 <= base_tokens <= concurrency")
        return num.astype({"concurrency": int, "n_active": int})
    raise ValueError(f"trace file {path} needs an `adapter` column (requests) or `concurrency` and `n_active` columns (steps)")


def _adapter_name(a) -> str:
    """An adapter cell as text: missing -> "" (base); whole floats as ints (JSONL mixing null and
    ids makes the column float, so -1 arrives as -1.0)."""
    if a is None or (isinstance(a, float) and np.isnan(a)):
        return ""
    if isinstance(a, float) and a.is_integer():
        return str(int(a))
    return str(a).strip()


def _given(value) -> bool:
    """A step's optional value is there (not absent, not NaN)."""
    import pandas as pd

    return bool(pd.notna(value))


class TraceWorkload:
    def __init__(self, path: str):
        import pandas as pd

        self.path = path
        self.df = _load(path)
        self.requests = "adapter" in self.df.columns
        if self.requests:
            names = self.df.adapter.map(_adapter_name)
            ids = pd.Series(pd.factorize(names)[0])
            self.adapter_ids = np.where(names.str.lower().isin(BASE_NAMES), -1, ids).astype(np.int64)
            if len(self.adapter_ids) == 0:
                raise ValueError(f"trace file {path} holds no requests")

    @property
    def name(self) -> str:
        return f"trace:{self.path}"

    def _windows(self, concurrency: int) -> np.ndarray:
        """Every run of ``concurrency`` consecutive requests, as adapter ids [windows, c]."""
        ids = self.adapter_ids
        if len(ids) < concurrency:
            raise ValueError(f"trace {self.path} has {len(ids)} requests, fewer than concurrency {concurrency}")
        return np.lib.stride_tricks.sliding_window_view(ids, concurrency)

    def _steps(self, concurrency: int) -> "pd.DataFrame":
        steps = self.df[self.df.concurrency == concurrency]
        if steps.empty:
            have = ", ".join(map(str, sorted(self.df.concurrency.unique())))
            raise ValueError(f"trace {self.path} has no steps at concurrency {concurrency} (it has {have})")
        return steps

    def active_count_pmf(self, concurrency: int, max_loras: int, **_) -> np.ndarray:
        """P(n | c) for n = 0..min(c, max_loras), counted over the trace's steps or windows."""
        return _pmf(self, concurrency, max_loras)

    def _count(self, concurrency: int, max_loras: int) -> np.ndarray:
        top = min(concurrency, max_loras)
        if self.requests:
            n = distinct_adapters(self._windows(concurrency))
        else:
            n = self._steps(concurrency).n_active.to_numpy()
        n = np.minimum(n, top)
        return np.bincount(n, minlength=top + 1)[: top + 1] / len(n)

    def sample(self, concurrency: int, max_loras: int, rng: random.Random) -> list[int]:
        """One step's slots (-1 = base request): a window (or a logged step) of the trace, its
        distinct adapters put on distinct random slots (folded onto them past max_loras)."""
        if self.requests:
            windows = self._windows(concurrency)
            ids = windows[rng.randrange(len(windows))].tolist()
            distinct = list(dict.fromkeys(i for i in ids if i >= 0))
            slots = rng.sample(range(max_loras), min(len(distinct), max_loras))
            where = {a: slots[k % len(slots)] for k, a in enumerate(distinct)}
            return [where[i] if i >= 0 else -1 for i in ids]
        steps = self._steps(concurrency)
        row = steps.iloc[rng.randrange(len(steps))]
        n = min(int(row.n_active), max_loras)
        base = int(row.base_tokens) if _given(row.get("base_tokens")) else 0
        base = concurrency if n == 0 else min(base, concurrency - n)
        chosen = rng.sample(range(max_loras), n)
        slots = chosen + [rng.choice(chosen) for _ in range(concurrency - base - n)] + [-1] * base
        rng.shuffle(slots)
        return slots


_PMFS: dict[tuple[str, int, int], np.ndarray] = {}


def _pmf(trace: TraceWorkload, concurrency: int, max_loras: int) -> np.ndarray:
    """Counted once per (trace, c, max_loras): the spec, the report and the optimiser all ask."""
    key = (trace.path, concurrency, max_loras)
    if key not in _PMFS:
        _PMFS[key] = trace._count(concurrency, max_loras)
    return _PMFS[key]
