"""The sweep driver: plans the points, starts one worker process per (kernels, max_loras,
strategy), writes each row the moment it arrives, and ends with a summary table.

Output: ``<out>/<run_id>/points.parquet`` (+ ``points.jsonl``), ``run.json`` (the spec, argv and
environment), ``checks.json`` (each configuration's correctness verdict) and one
``worker-<i>.log`` per worker.
"""

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from lorabench import env
from lorabench.analysis import CONFIG, configs, ok_points
from lorabench.kernels import TRITON_BACKENDS, TUNED, backend_of
from lorabench.results import PointsWriter
from lorabench.spec import SweepSpec
from lorabench.strategies import BUCKET_GRID


def plan(spec: SweepSpec) -> list[dict]:
    """The workers' jobs, each with its points: for every concurrency c, every n in
    0..min(c, max_loras) in fixed mode, then one workload run per workload."""
    jobs, point = [], 0
    for kernels in spec.kernels:
        for max_loras in spec.max_loras:
            for strategy in spec.strategy:
                if backend_of(kernels) == "vllm" and strategy in BUCKET_GRID:
                    continue  # vLLM's grid follows its count: it has no count-agnostic mode to measure
                points = []
                for c in spec.concurrency:
                    for n in range(min(c, max_loras) + 1):
                        points.append({"point": point, "mode": "fixed", "concurrency": c, "n_active": n})
                        point += 1
                    for w in spec.workload:
                        points.append({"point": point, "mode": "workload", "concurrency": c, "workload": w})
                        point += 1
                job = {"kernels": kernels, "max_loras": max_loras, "strategy": strategy, "points": points}
                if strategy == "auto":
                    job["counts"] = spec.auto_sets[f"{kernels}/{max_loras}"]["counts"]
                jobs.append(job)
    return jobs


def new_run_dir(out: Path, device: str) -> tuple[str, Path]:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_id, i = f"{stamp}-{device}", 1
    while (out / run_id).exists():
        i += 1
        run_id = f"{stamp}-{device}-{i}"
    (out / run_id).mkdir(parents=True)
    return run_id, out / run_id


class Sweep:
    """A run: ``check_only`` builds and checks every configuration and times nothing."""

    def __init__(self, spec: SweepSpec, argv: str, console: Console, check_only: bool = False):
        self.spec, self.argv, self.console, self.check_only = spec, argv, console, check_only
        self.run_id, self.run_dir = new_run_dir(Path(spec.out), spec.device)
        self.writer = PointsWriter(self.run_dir)
        self.started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.jobs = plan(spec)
        if check_only:
            for job in self.jobs:
                job["points"] = []
        self.checks: list[dict] = []  # one verdict per configuration, also in checks.json
        self.info = {
            "run_id": self.run_id, "started_at": self.started_at, "argv": argv, "status": "running",
            "spec": spec.to_dict(), "env": env.collect("cpu"), "jobs": [
                {k: j[k] for k in CONFIG} | {"points": len(j["points"])} for j in self.jobs
            ],
        }
        self.write_info()

    def write_info(self) -> None:
        tmp = self.run_dir / "run.json.tmp"
        tmp.write_text(json.dumps(self.info, indent=2) + "\n")
        os.replace(tmp, self.run_dir / "run.json")

    def run(self) -> Path:
        t0 = time.perf_counter()
        total = len(self.jobs) if self.check_only else sum(len(j["points"]) for j in self.jobs)
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        try:
            with Progress(*columns, console=self.console, transient=False) as progress:
                task = progress.add_task("starting", total=total)
                for i, job in enumerate(self.jobs):
                    desc = f"{job['kernels']} max_loras={job['max_loras']} {job['strategy']}"
                    progress.update(task, description=desc)
                    self.run_worker(i, job, lambda: progress.advance(task))
        except KeyboardInterrupt:
            self.info.update(status="interrupted", wall_s=time.perf_counter() - t0)
            self.write_info()
            raise
        self.info.update(status="finished", wall_s=time.perf_counter() - t0,
                         finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
        self.write_info()
        return self.run_dir

    def add_check(self, verdict: dict, advance) -> None:
        self.checks.append(verdict)
        (self.run_dir / "checks.json").write_text(json.dumps(self.checks, indent=2) + "\n")
        if self.check_only:
            advance()

    def run_worker(self, index: int, job: dict, advance) -> None:
        payload = {**job, "spec": self.spec.to_dict(), "run_id": self.run_id, "started_at": self.started_at,
                   "argv": self.argv, "spawned_at": time.time()}
        child_env = dict(os.environ)
        if self.spec.device == "cpu" and backend_of(job["kernels"]) in TRITON_BACKENDS:
            child_env["TRITON_INTERPRET"] = "1"  # Triton kernels on the CPU run in its interpreter
        if job["kernels"] == "vllm" + TUNED:  # vLLM reads its tuned configs from here, and only then
            from lorabench.tune_files import vllm_folder

            child_env["VLLM_TUNED_CONFIG_FOLDER"] = str(vllm_folder(self.spec.tuned))
        elif job["kernels"] == "vllm":
            child_env.pop("VLLM_TUNED_CONFIG_FOLDER", None)  # the defaults, whatever the shell says
        log_path = self.run_dir / f"worker-{index}.log"
        done: set[int] = set()
        checks_before = len(self.checks)
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "lorabench.worker"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log, text=True, env=child_env)
            try:
                proc.stdin.write(json.dumps(payload))
                proc.stdin.close()
                for line in proc.stdout:
                    kind, _, body = line.partition(" ")
                    if kind == "@@row":
                        row = json.loads(body)
                        self.writer.append(row)
                        done.add(row["point"])
                        advance()
                    elif kind == "@@check":
                        self.add_check(json.loads(body), advance)
                    elif kind == "@@env":
                        self.info["env"] = json.loads(body)
                        self.write_info()
                rc = proc.wait()
            except BaseException:
                proc.kill()
                proc.wait()
                raise
        missing = [p for p in job["points"] if p["point"] not in done]
        tail = [ln for ln in log_path.read_text().splitlines() if ln.strip()][-1:] or ["(empty log)"]
        if self.spec.check and len(self.checks) == checks_before:
            self.add_check({**{k: job[k] for k in CONFIG}, "correct": None,
                            "detail": f"no verdict: worker exited with status {rc}; its log ends: {tail[0][:500]}"}, advance)
        if missing:
            error = f"worker exited with status {rc} before this point; its log ends: {tail[0][:500]}"
            base = {"run_id": self.run_id, "started_at": self.started_at, "argv": self.argv,
                    "kernels": job["kernels"], "max_loras": job["max_loras"], "strategy": job["strategy"],
                    "device": self.spec.device, "model": self.spec.model, "rank": self.spec.rank, "dtype": self.spec.dtype}
            for p in missing:
                self.writer.append({**base, "point": p["point"], "mode": p["mode"], "concurrency": p["concurrency"],
                                    "n_active": p.get("n_active"), "workload": p.get("workload"),
                                    "status": "failed", "error": error})
                advance()


def summary_table(df: pd.DataFrame, device: str) -> Table:
    """Per (kernels, max_loras, strategy): capture set, cost, and the first workload's median step."""
    ok = ok_points(df)
    workload = ok[ok["mode"] == "workload"]["workload"].dropna().unique()
    wl = workload[0] if len(workload) else None
    conc = sorted(df.concurrency.dropna().unique())
    unit = "ms GPU" if device == "cuda" else "ms CPU wall"
    table = Table(title=f"median step ({unit}), workload {wl}" if wl else "median step")
    for col in ["kernels", "L", "strategy", "graphs", "MiB", "start s"]:
        table.add_column(col, justify="right" if col not in ("kernels", "strategy") else "left", no_wrap=True)
    for c in conc:
        table.add_column(f"c={c}", justify="right", no_wrap=True)
    table.add_column("failed", justify="right")
    table.add_column("check", justify="left")
    cost = configs(df).set_index(CONFIG)
    for (k, m, s), g in df.groupby(CONFIG, sort=False):
        cells = [k, str(m), s, "-", "-", "-"]
        if (k, m, s) in cost.index:
            c_row = cost.loc[(k, m, s)]
            mem = c_row.graph_mem_bytes
            cells[3:] = [str(int(c_row.num_graphs)), f"{mem / 2**20:.0f}" if pd.notna(mem) else "-", f"{c_row.startup_s:.1f}"]
        good = ok_points(g)
        for c in conc:
            pt = good[(good.concurrency == c) & (good["mode"] == "workload") & (good.workload == wl)]
            cells.append(f"{pt.step_ms_median.iloc[0]:.3f}" if len(pt) else "-")
        cells.append(str(int((g.status == "failed").sum())))
        verdict = g["correct"].dropna().tolist() if "correct" in g else []
        cells.append("[red]WRONG[/]" if False in verdict else "ok" if verdict else "-")
        table.add_row(*cells)
    return table


def check_table(checks: list[dict]) -> Table:
    """One line per configuration: its verdict and, when wrong, the smallest batch that shows it."""
    table = Table(title="correctness: every served graph vs the plain-torch reference")
    for col in ["kernels", "L", "strategy", "graphs", "batches", "verdict", "detail"]:
        table.add_column(col, justify="right" if col in ("L", "graphs", "batches") else "left",
                         no_wrap=col != "detail", overflow="fold")
    for c in checks:
        verdict = {True: "[green]ok[/]", False: "[red]WRONG[/]", None: "[yellow]none[/]"}[c.get("correct")]
        graphs = f"{c['graphs_checked']}/{c['graphs_total']}" if "graphs_checked" in c else "-"
        detail = c.get("detail", "")
        if c.get("correct") is True:
            detail = f"max error {c['max_err']:.2g} (tolerance {c['tolerance']:g})"
        table.add_row(c["kernels"], str(c["max_loras"]), c["strategy"], graphs, str(c.get("batches", "-")), verdict, detail)
    return table
