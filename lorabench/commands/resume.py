"""Whether ``lorabench sweep --resume RUN`` may continue a run here: its run.json holds a plan,
its sweep is not still running, and this lorabench would plan it the same, runs the same code and
libraries, on the same GPU. Each refusal is one line (``UserError``); ``--force`` resumes anyway and
records the differences."""

import json
from dataclasses import asdict
from pathlib import Path

from lorabench.config.plan import Job, plan
from lorabench.errors import UserError
from lorabench.runtime import env
from lorabench.storage.runs import RUNNING, read_info, run_status

COMPARED = (("git_sha", "code"), ("torch", "torch"), ("triton", "triton"), ("gpu_name", "GPU"))  # Env's, and the rows'


def recorded(run_dir: Path, force: bool) -> tuple[dict, list[Job]]:
    """The run's run.json (its ``previous_status`` added) and its plan, or one line saying why it
    cannot be resumed."""
    info = read_info(run_dir)
    if not info:
        raise UserError(f"--resume {run_dir}: no readable run.json there (is it a sweep's output folder?)")
    if info.get("command") == "check":
        raise UserError(f"--resume {run_dir}: a check run times nothing; run lorabench check again")
    jobs_raw = info.get("jobs") or []
    if not jobs_raw or any(not isinstance(j.get("points"), list) for j in jobs_raw):
        raise UserError(f"--resume {run_dir}: its run.json has no plan to resume (written by an older lorabench)")
    status = run_status(info)
    if status == RUNNING and not force:
        where = f"process {info.get('pid')} on {info.get('host')}"
        raise UserError(f"--resume {run_dir}: its sweep is still running ({where}); "
                        "if that process is gone, add --force")
    try:
        jobs = [Job.from_json(json.dumps(j)) for j in jobs_raw]
    except (TypeError, KeyError) as e:
        raise UserError(f"--resume {run_dir}: its run.json is not one this lorabench can read ({e})") from None
    return {**info, "previous_status": status}, jobs


def differences(run) -> list[str]:
    """What makes resuming ``run`` (a ``Sweep``) here differ from how it was measured: the plan, the
    code, the libraries, the GPU (empty: none). A GPU run cannot be resumed without a GPU at all."""
    out = []
    replanned = plan(run.spec, run.run_id, run.started_at, run.jobs[0].argv if run.jobs else "")
    if [asdict(j) for j in replanned] != [asdict(j) for j in run.jobs]:
        out.append(f"this lorabench plans the run's spec differently ({sum(len(j.points) for j in replanned)} "
                   f"points in {len(replanned)} workers; the run has {sum(len(j.points) for j in run.jobs)} "
                   f"in {len(run.jobs)})")
    if run.spec.device == "cuda" and not env.machine().cuda:
        raise UserError(f"--resume {run.run_dir}: the run was measured on a GPU; this machine has none")
    rows = [r for r in run.writer.rows if r.status == "ok"]
    here = env.host(run.spec.device)
    recorded_env = run.info.get("env") or {}
    for key, what in COMPARED:
        if key == "gpu_name" and run.spec.device == "cpu":
            continue
        theirs = {getattr(r, key) for r in rows if getattr(r, key)} or ({recorded_env[key]} if recorded_env.get(key) else set())
        if theirs and theirs != {getattr(here, key)}:
            out.append(f"other {what}: the run has {', '.join(sorted(map(str, theirs)))}, this machine {getattr(here, key)}")
    return out
