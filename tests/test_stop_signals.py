"""A signal reaching a sweep while it waits on its workers is noted and raised between waits, as
``Stopped``: raised inside the handler, it could land in ``queue.get``'s lock release and come out
as a RuntimeError, the run left marked running. A second signal stops at once."""

import os
import queue
import signal

import pytest

from lorabench.commands.sweep_run import Stopped, StopSignals


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_is_noted_then_raised_between_waits(sig):
    before = {s: signal.getsignal(s) for s in StopSignals.SIGNALS}
    with StopSignals() as stops:
        os.kill(os.getpid(), sig)
        with pytest.raises(queue.Empty):  # the wait ends as a wait ends: nothing raised inside it
            queue.Queue().get(timeout=0.05)
        assert stops.signum == sig
        with pytest.raises(Stopped) as stopped:
            stops.raise_if_stopped()
        assert stopped.value.signum == sig and isinstance(stopped.value, KeyboardInterrupt)
        with pytest.raises(Stopped):  # a second signal: at once
            os.kill(os.getpid(), signal.SIGTERM)
            queue.Queue().get(timeout=0.5)
    assert {s: signal.getsignal(s) for s in StopSignals.SIGNALS} == before


def test_no_signal_raises_nothing():
    with StopSignals() as stops:
        stops.raise_if_stopped()
    assert stops.signum is None
