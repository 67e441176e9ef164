"""The sweep's own process starts its workers without importing what only they need: torch and
Triton (seconds of a sweep's start, paid by each worker anyway), scipy and matplotlib."""

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent
HEAVY = ("torch", "triton", "scipy", "matplotlib", "transformers")


def test_a_sweeps_own_process_imports_no_torch(tmp_path):
    code = ("import json, sys\n"
            "from lorabench.commands import sweep\n"
            "sweep.WORKER = 'stub_worker'\n"
            "from lorabench.cli import main\n"
            f"rc = main(['sweep', '--out', {str(tmp_path)!r}, '--device', 'cpu', '--max-loras', '1,2', '--concurrency', '1',"
            " '--strategy', 'max,pow2', '--iters', '2'])\n"
            f"print(json.dumps([rc, sorted({{m.split('.')[0] for m in sys.modules}} & set({list(HEAVY)!r}))]))\n")
    env = {**os.environ, "STUB_SLOW": "0", "LORABENCH_GIT_SHA": "tests-of-the-start",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    rc, heavy = json.loads(out.stdout.splitlines()[-1])
    assert rc == 0 and heavy == [], out.stderr
