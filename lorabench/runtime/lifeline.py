"""A worker process's tie to its sweep: it ends when the sweep that started it is gone.

The sweep starts every worker as ``python -m lorabench.runtime.lifeline SWEEP_PID MODULE``: the
tie is made before MODULE (the worker) is imported, so a sweep killed while its worker still
imports torch or initialises the GPU takes the worker with it at once. Imports no torch.
"""

import ctypes
import os
import runpy
import signal
import sys
import threading
import time


def exit_with_parent(parent: int) -> None:
    """End this process when the sweep that started it is gone (SIGKILL, a crash), so no worker
    is left timing for nobody. Linux tells us at once (PR_SET_PDEATHSIG; a parent that died
    before that was set is caught by the check after it); elsewhere a daemon thread checks the
    parent twice a second."""
    try:
        tied = ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) == 0  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        tied = False
    if os.getppid() != parent:
        os._exit(1)
    if tied:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def main() -> None:
    """``python -m lorabench.runtime.lifeline SWEEP_PID MODULE``: tie this process to the sweep,
    then run MODULE as ``__main__``."""
    parent, module = int(sys.argv[1]), sys.argv[2]
    exit_with_parent(parent)
    sys.argv = [module]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
