"""One running job (local or on Slurm) shared by the checks that do not end it.

Ray start plus teardown is ~11.6 s of every local job, more than half of it; the checks that leave a job
running and recoverable (an engine killed or wedged and restarted, the router actor killed, the refit
window, reset-cache, the dashboard, the record) can all use one job. ``running_job`` is a module-scoped
factory: ``running_job(spec)`` submits a spec once per module and returns a ``RunningJob`` (job dir, URLs, a
``FleetClient``, ``inject(fault)``); at the module's end every job it started is ended through
``rl-launch cancel`` and checked to have left nothing running. What ends or breaks a job keeps a job of its
own.

A shared job's training command must outlive the checks: the spec's training command is an agent that
serves ``inject`` requests (files under ``requests/``) until a deadline or the cancel, so faults that need
the job's own environment (its engine key, ``RAY_ADDRESS``, ``RL_POLICY_*``) run inside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from launcher.fleet.client import FleetClient
from launcher.jobdir import JobDir
from router.record.format import RequestRecord
from tests.support.cli import RL_LAUNCH


def job_processes(job: Path) -> list[str]:
    """Processes still carrying this job's RL_LAUNCH_JOB_DIR (every process the driver started does)."""
    marker = f"RL_LAUNCH_JOB_DIR={job}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()[:120]!r}")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


def job_leftovers(job: Path) -> list[str]:
    """Every process of this job, and only of this job: its environment names the job dir (RL_LAUNCH_JOB_DIR,
    RL_JOB_DIR) or its command line does (a Ray head's session and log paths). Never machine-wide: other
    lanes run jobs of their own on the same machine at the same time."""
    markers = {f"RL_LAUNCH_JOB_DIR={job}".encode(), f"RL_JOB_DIR={job}".encode()}
    path = str(job).encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            environ = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if environ & markers or path in cmdline:
            found.append(f"{pid}: {cmdline[:160]!r}")
    return found


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll ``predicate`` until it is truthy; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.2)


@dataclass
class RunningJob:
    """A job submitted once and left running for the checks of one module."""

    job: Path
    submit: subprocess.Popen[str] | None  # a local job's ``rl-launch submit`` (it runs the driver)
    root: Path
    engines: int
    leftovers: Callable[[Path], list[str]] = job_leftovers
    _requests: int = field(default=0)

    def ended(self) -> bool:
        """The job ended (its local driver exited, or any job recorded its result)."""
        local_done = self.submit is not None and self.submit.poll() is not None
        return local_done or (self.job / "result.json").exists()

    @property
    def state(self) -> dict[str, Any]:
        return JobDir(self.job).read_state()

    @property
    def router_url(self) -> str:
        return str(self.state["router_url"])

    @property
    def base_url(self) -> str:
        return self.router_url + "/v1"

    @property
    def client(self) -> FleetClient:
        return FleetClient.from_job_dir(self.job)

    def events(self, since: float = 0.0) -> list[dict[str, Any]]:
        """The job's events from ``since`` on (the shared job's log holds every earlier check's too)."""
        return [e for e in JobDir(self.job).read_events() if e["t"] >= since]

    def healthy(self) -> bool:
        """Every engine serving (HEALTHY in the controller's view), the router answering, nothing paused."""
        if self.ended():
            raise AssertionError(f"the shared job {self.job.name} ended before its checks did")
        engines = self.state.get("fleet", {}).get("engines", [])
        if len(engines) != self.engines or any(e.get("state") != "HEALTHY" for e in engines):
            return False
        try:
            urllib.request.urlopen(self.router_url + "/health", timeout=2).read()
            # not is_paused(): that is true only when everything is paused; any pause left over counts here
            paused = self.client._op("GET", "/fleet/is_paused").result
        except OSError:
            return False
        return not paused["router_paused"] and not any(paused["engines_paused"].values())

    def wait_healthy(self, timeout_s: float = 120) -> None:
        """Wait for "healthy again": what each check that shares the job starts from, whatever ran before."""
        wait_for(self.healthy, timeout_s, f"{self.job.name} to be healthy again")

    def inject(self, fault: str, timeout_s: float = 240) -> Path:
        """Have the job's agent run ``fault`` inside the job; its outputs land in the returned directory
        (``done.json`` holds its exit code)."""
        self._requests += 1
        out = self.job / "runs" / str(self._requests)
        requests = self.job / "requests"
        requests.mkdir(exist_ok=True)
        tmp = requests / f".{self._requests}.json"
        tmp.write_text(json.dumps({"mode": fault, "out": str(out)}))
        tmp.rename(requests / f"{self._requests}.json")
        wait_for(lambda: (out / "done.json").exists() or self.ended(), timeout_s, fault)
        assert (out / "done.json").exists(), f"the shared job ended during {fault}"
        return out

    def cancel(self) -> None:
        """End the job as a user does, and check nothing of it is left."""
        proc = subprocess.run(
            [RL_LAUNCH, "cancel", self.job.name, "--root", str(self.root), "--timeout", "120"],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        if self.submit is not None:
            self.submit.wait(120)
        assert JobDir(self.job).read_result().outcome == "cancelled"
        wait_for(lambda: self.leftovers(self.job) == [], 60, f"{self.job.name}'s processes to end")


SHARED_SLURM_JOBS: set[str] = set()
"""Slurm job ids of the shared jobs still in use: the root conftest's queue hygiene, which cancels what a
Slurm test leaves queued, spares them between the checks that share them."""


def _write_spec(tmp_path_factory: pytest.TempPathFactory, spec: dict[str, Any]) -> tuple[Path, Path, Path]:
    base = tmp_path_factory.mktemp("running-job")
    root = base / "jobs"
    path = base / "spec.yaml"
    path.write_text(yaml.safe_dump({**spec, "job_root": str(root)}))
    return base, root, path


@pytest.fixture(scope="module")
def running_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[dict[str, Any]], RunningJob]]:
    """``running_job(spec)``: the module's one job of that spec (submitted on first use), healthy.

    A local job runs in its ``rl-launch submit``; a Slurm job's submit returns once sbatch took it, and its
    id stays in ``SHARED_SLURM_JOBS`` until the module's end. A module that shares a Slurm job holds only
    checks that use it: a check of its own job's "queue empty" would see the shared one.
    ``leftovers(job)`` lists what of the job still runs after the cancel (default: this machine's
    processes naming the job dir; a Slurm module passes every node's)."""
    jobs: dict[str, RunningJob] = {}

    def start(
        spec: dict[str, Any], leftovers: Callable[[Path], list[str]] = job_leftovers, timeout_s: float = 240
    ) -> RunningJob:
        key = json.dumps(spec, sort_keys=True)
        engines = spec["generation"]["engines_per_node"] * spec["generation"].get("nodes", 1)
        if key not in jobs and spec.get("cluster") == "slurm":
            _, root, path = _write_spec(tmp_path_factory, spec)
            proc = subprocess.run([RL_LAUNCH, "submit", str(path), "--json"], capture_output=True, text=True)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            submitted = json.loads(proc.stdout)
            SHARED_SLURM_JOBS.add(str(submitted["job_id"]))
            job = Path(submitted["job_dir"])
            jobs[key] = RunningJob(job=job, submit=None, root=root, engines=engines, leftovers=leftovers)
            wait_for(lambda: jobs[key].ended() or jobs[key].state.get("router_url"), timeout_s, "the router")
        elif key not in jobs:
            base, root, path = _write_spec(tmp_path_factory, spec)
            submit = subprocess.Popen(
                [RL_LAUNCH, "submit", str(path)],
                stdout=(base / "submit.log").open("w"),
                stderr=subprocess.STDOUT,
                text=True,
            )

            def listed() -> list[Path]:
                if submit.poll() is not None:
                    raise AssertionError((base / "submit.log").read_text()[-3000:])
                return list(root.iterdir()) if root.exists() else []

            (job,) = wait_for(listed, 120, "the job directory")
            jobs[key] = RunningJob(job=job, submit=submit, root=root, engines=engines, leftovers=leftovers)
            wait_for(lambda: jobs[key].ended() or jobs[key].state.get("router_url"), timeout_s, "the router")
        jobs[key].wait_healthy(timeout_s)
        return jobs[key]

    try:
        yield start
    finally:
        for shared in jobs.values():
            try:
                shared.cancel()
            finally:
                SHARED_SLURM_JOBS.discard(JobDir(shared.job).slurm_job_id() or "")


DRAIN_REACHES_ROUTER_S = 1.5
"""How long after the elastic manager's ``drain`` event a request may still go to a draining engine: the
fleet controller drops the node's engines from the router's serving set at its next push
(``FleetController.drain_node``), one tick (1 s) later at most, and a request dispatched before that push
went there legitimately; 0.5 s more for a push and a record timestamp on a loaded 2-core machine (0.5 s
alone failed once in CI: a request 0.91 s after the event)."""


FLEET_ENDED = ("drained", "removed")
"""Attempt outcomes that are the fleet's doing (an elastic drain, an engine removed), not an engine's
failure."""


def retried_for_failure(records: list[RequestRecord]) -> list[RequestRecord]:
    """The records of requests the router retried because an engine failed. A request the drain caught
    goes on on an engine that stays (``router.continuation``): moved with its tokens (a move in the
    record), or, caught before its first token, sent there again from its start (a move at token 0 in the
    record; before the router counted it so, an attempt with no move, which this still accepts). Both leave an
    attempt that ended "drained" or "removed"; any other ended attempt before the last, or a last one
    that is not "ok", is a retry. A request sent nowhere (no attempt) was not retried."""
    return [
        r
        for r in records
        if r.attempts
        and (
            r.attempts[-1].outcome != "ok"
            or any(a.outcome not in FLEET_ENDED for a in r.attempts[:-1])
            or len(r.moves or []) > len(r.attempts) - 1
        )
    ]
