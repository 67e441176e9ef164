"""``lorabench tune``: search Triton configs for the LoRA kernels, shape by shape, within a time
budget, and write them where lorabench (``lorabench_tuned.json``, for ``sweep --tuned``) and vLLM
(``VLLM_TUNED_CONFIG_FOLDER`` = ``vllm/``) read them.

``shapes`` says what is searched, ``backends`` how each kernel backend is launched and what its
configs are, ``search`` times them into a resumable cache, ``output`` writes what was found.
"""

import os
import shlex
import subprocess
import sys

from rich.console import Console

from lorabench.commands.tune.output import skipped_line, sweep_hint, tune_table
from lorabench.commands.tune.search import Tuner
from lorabench.commands.tune.spread import spread
from lorabench.config.tune_spec import build_tune_spec
from lorabench.errors import UserError
from lorabench.kernels import triton_lora, vllm_lora
from lorabench.runtime import env
from lorabench.runtime.executors import ExecutorKind
from lorabench.runtime.executors import make as make_executor


def interpreter_child(flags: dict, resume: bool, cuda: bool) -> int | None:
    """On the CPU, Triton's kernels run in its interpreter, which must be on before triton is first
    imported (too late once the CLI runs): so the tune runs in a child process with
    TRITON_INTERPRET=1, as sweeps run their workers. Returns its exit status; None if not needed."""
    if os.environ.get("TRITON_INTERPRET") == "1" or (cuda and flags.get("device") != "cpu"):
        return None
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items() if v is not None] + ([] if resume else ["--fresh"])
    child_env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-m", "lorabench", "tune", *argv], env=child_env).returncode


def tune(flags: dict, resume: bool, console: Console) -> int:
    """``flags``: the tune's, and ``executor``, ``gpus``, ``scheduler``: where its shapes run (one
    process by default; over several GPUs, ``lorabench.commands.tune.spread``)."""
    machine = env.machine()
    child = interpreter_child(flags, resume, machine.cuda)
    if child is not None:  # on the CPU the whole tune runs in a child with Triton's interpreter on
        return child
    kind = ExecutorKind.parse(flags.get("executor"))
    spec, notice = build_tune_spec(flags, machine, vllm_available=vllm_lora.available)
    if spec.device == "cpu" and not triton_lora.INTERPRET:
        raise UserError("--device cpu runs Triton's interpreter: set TRITON_INTERPRET=1 before lorabench's kernels are imported")
    if "vllm" in spec.kernels:
        env.require_vllm()
    executor = None  # this process tunes every shape: the default, and with one GPU of this host
    if kind is ExecutorKind.DASK or flags.get("gpus") or flags.get("scheduler"):
        executor = make_executor(kind, flags.get("gpus"), flags.get("scheduler"), spec.device)  # bad input: one line, nothing written
        if kind is ExecutorKind.LOCAL and executor.width == 1:
            executor.close()
            executor = None
    try:
        tuner = Tuner(spec, shlex.join(["lorabench"] + sys.argv[1:]), console, fresh=not resume)
        for line in (notice, tuner.cache.notice, skipped_line(tuner.cache)):
            if line:
                console.print(line, highlight=False, markup=False, soft_wrap=True)
        console.print(f"tune: {len(tuner.shapes)} shapes, {spec.budget_s:g} s -> {tuner.out}"
                      + (f", on {executor.describe()}" if executor is not None else ""))
        try:
            results = spread(tuner, executor, console) if executor is not None else tuner.run()
        except KeyboardInterrupt:
            tuner.write()
            print(f"interrupted: measurements kept in {tuner.cache.path}; rerun the same command to resume", file=sys.stderr)
            return 130
    finally:
        if executor is not None:
            executor.close()
    mine = set(tuner.shapes)
    console.print(tune_table([r for r in results if r["shape"] in mine], tuner.meta))
    earlier = sum(r["shape"] not in mine for r in results)
    if earlier:
        console.print(f"the folder's tables also keep {earlier} shapes measured by earlier tunes into it (tune.md lists them)")
    vllm = any(r["best"] for r in results if r["shape"].kernel == "vllm")
    console.print(f"-> {tuner.out / 'lorabench_tuned.json'}, {tuner.out / 'tune.md'}"
                  + (f", {tuner.out / 'vllm'} (VLLM_TUNED_CONFIG_FOLDER)" if vllm else ""))
    console.print(sweep_hint(spec, machine, results), highlight=False, markup=False, soft_wrap=True)
    return 0
