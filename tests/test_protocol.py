"""The worker's protocol: one encode/decode pair for every message, each a dataclass, and lines
that are not messages (or are cut short) told apart."""

import pytest

from lorabench.runtime.protocol import SWEEP, Measured
from lorabench.storage.checks import Checked
from lorabench.storage.row import COLUMNS, ENV_COLUMNS, Env, Row
from lorabench.storage.samples import PER_STEP, Loads, Steps

STEPS = Steps(turn=[0, 0], step_ms=[1.5, 1.25], host_us=[3.0, 3.5], copy_us=[1.0, 1.0], launch_us=[2.0, 2.5],
              n_active=[1, 1], launches=[2, 2], tokens=[4, 4], loads=[0, 0], reads=[0, 0], read_bytes=[0, 0])
MESSAGES = [
    Measured(Row(run_id="r", kernels="triton", max_loras=4, strategy="[1,4]", point=3, status="ok",
                 captured_counts=[1, 4], step_ms_median=1.375, noisy=False), STEPS),
    Measured(Row(point=4, status="failed", error="RuntimeError: boom")),
    Checked("triton", 4, "max", True, batches=12, detail="ok: 12 batches", captured_counts=[4]),
    Checked("triton", 4, "pow2", None, detail="check did not run: RuntimeError: x"),
    Loads("triton", 4, [0.5, 0.6], [0.2, 0.25], [10.0, 11.0]),
    Env(device="cuda", gpu_name="NVIDIA H200", gpu_uuid="GPU-1234", torch="2.13.0", git_sha="abc"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    line = SWEEP.encode(message)
    assert line.startswith("@@") and "\n" not in line
    assert SWEEP.decode(line) == message


def test_lines_that_are_not_messages():
    assert SWEEP.decode("a worker's stray print") is None
    assert SWEEP.decode("@@nosuchkind {}") is None
    cut = SWEEP.encode(MESSAGES[0])[:50]
    with pytest.raises(ValueError, match="@@row line that does not decode"):
        SWEEP.decode(cut)


def test_a_row_names_only_columns():
    with pytest.raises(TypeError):
        Row(no_such_column=1)
    assert Row.from_dict({"point": 1, "not_a_column": 2}).point == 1
    assert set(ENV_COLUMNS) <= set(COLUMNS) and "python" not in ENV_COLUMNS
    assert Env(device="cpu", host="h", python="3.11").columns() == {c: (None if c not in ("device", "host") else
                                                                       {"device": "cpu", "host": "h"}[c]) for c in ENV_COLUMNS}
    assert PER_STEP == list(Steps.__dataclass_fields__)
