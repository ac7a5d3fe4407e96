"""A Dynamo fleet end to end in local mode (the same driver as on Slurm, without srun): the real etcd and
NATS from Debian, the real ``dynamo.frontend`` with its KV router and two real ``dynamo.mocker`` workers,
while a Gym-like client replays multi-turn sessions through the frontend:

* bring-up (runtime, workers, frontend ready with every worker instance and the model), a request through
  the frontend;
* a worker killed (SIGKILL to its process group) mid-replay: detected by our probes, restarted in place by
  its engine host, back in the frontend's instance list through discovery, no session lost (the frontend's
  ``--migration-limit`` re-routes requests in flight, the client's retries cover the rest);
* teardown leaves no process of the job and no Dynamo data directory.

The figures (bring-up, recovery, sessions lost) are printed for the report (``pytest -s``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.cli import RL_LAUNCH
from tests.support.dynamo import TRAINER, mocker
from tests.support.running_job import job_processes
from tests.support.specs import local_spec, run_spec, trainer_command, write_spec

pytestmark = [pytest.mark.ray, pytest.mark.dynamo]


@pytest.mark.parametrize("discovery", ["etcd", "file"])
def test_dynamo_fleet_serves_recovers_a_killed_worker_and_leaves_nothing(
    dynamo_runtime: None, tmp_path: Path, tiny_model_dir: Path, discovery: str
) -> None:
    spec = local_spec(
        "dynamo-local",
        root=tmp_path / "jobs",
        command=trainer_command(tmp_path, TRAINER),
        generation=mocker(tiny_model_dir, 2, startup_timeout_s=120),
        router={
            "kind": "dynamo",
            "dynamo": {"router_mode": "kv", "discovery": discovery, "worker_args": ["--speedup-ratio", "10"]},
        },
    )
    proc, job = run_spec(tmp_path / "spec.yaml", spec, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = json.loads((job / "dynamo_trainer.json").read_text())
    assert seen["first"]["usage"]["completion_tokens"] == 4
    # The mocker has no cache-invalidation route (dynamo.vllm workers serve /engine/flush_cache): the reset
    # must say so per worker and fail, never report a flush that did not happen.
    reset = json.loads(seen["reset"])
    assert seen["reset_rc"] == 1 and not reset["ok"] and len(reset["engines"]) == 2, seen["reset"]
    assert all(e["status"] == 404 for e in reset["engines"]), reset
    assert json.loads((job / "cache_reset.json").read_text())["ok"] is False
    assert len(seen["before"]) == 2 and len(seen["after"]) == 2
    assert seen["recovery_s"] is not None, "the killed worker never rejoined the frontend"
    assert seen["new_url"] != seen["victim"]  # restarted in place on a new status port
    replay = json.loads((job / "replay.json").read_text())["rows"][0]
    lost = replay["sessions"] - replay["sessions_ok"]
    events = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines()]
    assert any(e["phase"] == "engine_restarted" for e in events)
    state = json.loads((job / "state.json").read_text())
    assert state["gateway"]["kind"] == "dynamo"
    # The frontend's instances lined up with our engines (the last view before the teardown).
    listing = json.loads((job / "engines" / "node-0.urls.json").read_text())
    engine_urls = {e["url"] for e in listing["engines"]}
    assert {m["url"] for m in state["gateway"]["members"]} == engine_urls, state["gateway"]
    timings = json.loads((job / "result.json").read_text())["timings"]
    bring_up = timings["ray_start_s"] + timings["engine_start_s"] + timings["router_start_s"]
    print(
        f"\ndynamo ({discovery}): bring-up {bring_up:.1f} s (Ray {timings['ray_start_s']} s, runtime "
        f"{timings.get('gateway_runtime_start_s')} s, workers {timings['engine_start_s']} s, frontend "
        f"{timings['router_start_s']} s); worker-kill recovery {seen['recovery_s']:.1f} s; sessions lost "
        f"{lost}/{replay['sessions']}, failed requests {replay['failed_requests']}, "
        f"retries {replay['retries']}"
    )
    assert lost == 0, replay
    assert not (job / "dynamo").exists(), "the runtime's data directory was left behind"
    assert job_processes(job) == []


@pytest.mark.parametrize("how", ["frontend_killed", "etcd_killed", "sigterm"])
def test_dynamo_job_ends_loudly_and_leaves_nothing(
    dynamo_runtime: None, tmp_path: Path, tiny_model_dir: Path, how: str
) -> None:
    """A dead frontend or runtime fails the job with the reason (every request would fail otherwise); a
    SIGTERM (scancel, rl-launch cancel) cancels it; either way nothing of the job is left."""
    spec = local_spec(
        "dynamo-stop",
        root=tmp_path / "jobs",
        command="sleep 300",
        generation=mocker(tiny_model_dir, 1),
        router={"kind": "dynamo"},
    )
    path = write_spec(tmp_path / "spec.yaml", spec)
    out = (tmp_path / "submit.log").open("w")  # a file, not a pipe nobody reads until the end
    proc = subprocess.Popen([RL_LAUNCH, "submit", str(path)], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            jobs = list((tmp_path / "jobs").glob("*/state.json"))
            state = json.loads(jobs[0].read_text()) if jobs else {}
            if state.get("phase") == "training":
                break
            assert proc.poll() is None and time.monotonic() < deadline, state
            time.sleep(0.2)
        job = jobs[0].parent
        t = time.monotonic()
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            name = "frontend" if how == "frontend_killed" else "etcd"
            log = "dynamo-frontend.log" if name == "frontend" else "dynamo-etcd.log"
            os.killpg(_process_of(job, log), signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        out.close()
    result = json.loads((job / "result.json").read_text())
    if how == "sigterm":
        assert result["outcome"] == "cancelled", result
    else:
        assert result["outcome"] == "failed" and result["exit_code"] == 1, result
        what = "frontend" if how == "frontend_killed" else "etcd"
        assert f"Dynamo {what} exited" in result["reason"], result["reason"]
        assert time.monotonic() - t < 60
    assert result["torn_down"] is True
    assert not (job / "dynamo").exists()
    assert job_processes(job) == []


def _process_of(job: Path, log_name: str) -> int:
    """The process group leader the driver started with its output in ``logs/<log_name>``."""
    log = str(job / "logs" / log_name)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/fd/1") == log and os.getpgid(int(pid)) == int(pid):
                return int(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError, OSError):
            continue
    raise AssertionError(f"no process writes {log}")
