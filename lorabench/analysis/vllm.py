"""The vLLM flags that realise a choice, and what to say about them.

vLLM can realise ``max`` (its default: graphs keyed by max_loras + 1) and ``pow2``
(``--specialize-active-lora``); ``dense`` and explicit lists are lorabench's own. vLLM 0.33's
``--specialize-active-lora`` dropped adapter updates on mixed batches on an H200, so the flag is
proposed with a warning unless the run has a passing vllm/pow2 configuration, and never when one
failed.
"""

from dataclasses import dataclass

import pandas as pd

from lorabench.config.backends import backend_of
from lorabench.config.strategies import STRATEGIES, Vllm

VLLM_DEFAULT = next(s.name for s in STRATEGIES.values() if s.vllm is Vllm.DEFAULT)  # max
SPECIALISED = next(s.name for s in STRATEGIES.values() if s.vllm is Vllm.SPECIALISE)  # pow2: --specialize-active-lora
VLLM_STRATEGIES = (VLLM_DEFAULT, SPECIALISED)  # the sets vLLM's flags can realise
VLLM_NOTE = "vLLM captures max_loras+1 (and powers of two with --specialize-active-lora): it counts the base slot too"
UNVERIFIED_POW2 = (
    "check before enabling: vLLM 0.33's --specialize-active-lora drops adapter updates on batches that mix "
    "base and adapter requests (lorabench check on an H200, BENCHMARKS.md); this run has no passing vllm/pow2 "
    "configuration to show your vLLM is free of it (lorabench check --kernels vllm --strategy pow2)"
)


@dataclass(frozen=True)
class VllmAdvice:
    """The flags that come closest to a choice (None: nothing to realise), the strategy they
    realise (the report's choice only), and what to know about them."""

    flags: str | None
    note: str
    realises: str | None = None


def vllm_specialised(rows: pd.DataFrame) -> pd.Series:
    """Which rows are vLLM's own kernels under --specialize-active-lora (vllm/pow2)."""
    return (rows.kernels.map(backend_of) == "vllm") & (rows.strategy == SPECIALISED)


def verified_pow2(checked: pd.DataFrame) -> bool:
    """Did a vllm/pow2 configuration of this run pass its check?"""
    return bool((vllm_specialised(checked) & checked.correct.map(lambda v: v is True)).any())


def vllm_flags(max_loras: int, rank: int, specialise: bool, tp: int = 1, fully_sharded: bool = False) -> str:
    flags = f"--enable-lora --max-loras {max_loras} --max-lora-rank {rank}"
    flags += f" --tensor-parallel-size {tp}" if tp > 1 else ""
    flags += " --fully-sharded-loras" if fully_sharded else ""
    return flags + (" --specialize-active-lora" if specialise else "")


def tp_of(row) -> int:
    """The row's tensor-parallel size (1 for runs from before the column)."""
    tp = row.get("tp")
    return 1 if tp is None or pd.isna(tp) else int(tp)


def fully_sharded_of(row) -> bool:
    return row.get("fully_sharded_loras") is True or row.get("fully_sharded_loras") == 1


def run_flags(first, max_loras: int, specialise: bool) -> str:
    """``vllm_flags`` for a run whose first ok row is ``first`` (its rank, TP size and sharding)."""
    return vllm_flags(max_loras, int(first["rank"]), specialise, tp_of(first), fully_sharded_of(first))
