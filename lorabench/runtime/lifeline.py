"""A worker process's tie to its sweep: it ends when the sweep that started it is gone.
Imports no torch, so that the tests' stand-in workers use the same code."""

import ctypes
import os
import signal
import threading
import time


def exit_with_parent(parent: int) -> None:
    """End this process when the sweep that started it is gone (SIGKILL, a crash), so no worker
    is left timing for nobody. Linux tells us at once (PR_SET_PDEATHSIG); elsewhere, and for
    a parent that died before that was set, a daemon thread checks twice a second."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
