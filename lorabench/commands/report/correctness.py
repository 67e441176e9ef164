"""The report's correctness section: each configuration's verdict, and what the vllm/pow2 verdicts
say of the hypothesis that vLLM's ``--specialize-active-lora`` drops updates on mixed batches."""

import re

import pandas as pd

from lorabench.analysis.points import verdicts
from lorabench.analysis.vllm import vllm_specialised
from lorabench.commands.report.labels import in_order
from lorabench.commands.tables import markdown_table

VERDICT_WORD = {True: "ok", False: "WRONG", None: "not checked"}


HYPOTHESIS = ("Hypothesis: with `--specialize-active-lora` (kernels vllm, strategy pow2), a batch mixing base-model "
              "requests with adapters replays a graph whose grid is one slot short, so some adapter tokens get no LoRA update.")


def hypothesis_verdict(pow2: pd.DataFrame) -> str:
    """What the vllm/pow2 verdicts say about HYPOTHESIS: a failure whose smallest batch mixes base
    requests with adapters confirms it; every configuration correct refutes it."""
    wrong = pow2[pow2.correct.map(lambda v: v is False)]
    if len(wrong):
        r = wrong.iloc[0]
        smallest = (r.check_detail or "").partition("smallest: ")[2] or r.check_detail or "no detail recorded"
        where = f"max_loras {', '.join(str(int(m)) for m in wrong.max_loras)}"
        if re.search(r"n=[1-9]\d*, [1-9]\d* base", smallest):
            return f"This run **confirms** it: vllm/pow2 is WRONG at {where}; smallest failing batch: {smallest}."
        return (f"vllm/pow2 is WRONG at {where}, but its smallest failing batch does not mix base requests with "
                f"adapters, so this run does not single out the hypothesised failure: {smallest}.")
    if pow2.correct.map(lambda v: v is True).all():
        return ("This run **refutes** it: every vllm/pow2 configuration (max_loras "
                f"{', '.join(str(int(m)) for m in pow2.max_loras)}) matched the reference, mixed batches included.")
    return "This run cannot tell: a vllm/pow2 configuration has no verdict (not checked, or the check was inconclusive)."


def correctness_md(df: pd.DataFrame) -> list[str]:
    v = in_order(verdicts(df))
    out = ["## Correctness", "",
           "Each configuration's graphs replayed on all-adapter, all-base and mixed batches against the plain-torch "
           "reference before timing (`correct`, `check_detail`); a WRONG configuration is never recommended.", "",
           markdown_table(["kernels", "max_loras", "strategy", "verdict", "detail"],
                    [[r.kernels, int(r.max_loras), r.strategy, VERDICT_WORD[r.correct], r.check_detail] for r in v.itertuples()]),
           ""]
    if v.correct.isna().all():
        out += ["No configuration of this run has a verdict: it ran with `--no-check`, or before the check existed.", ""]
    pow2 = v[vllm_specialised(v)]
    if len(pow2):
        out += [f"{HYPOTHESIS} {hypothesis_verdict(pow2)}", ""]
    return out

