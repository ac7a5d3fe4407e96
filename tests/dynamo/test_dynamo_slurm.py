"""A Dynamo fleet on the real local Slurm cluster (1 training node running the driver, the runtime and the
frontend; 2 generation nodes with one mocker worker each): bring-up across nodes with etcd + NATS, a
replay through the frontend, a worker SIGKILLed on its generation node (by this test, which sees every
node's processes from the login node) restarted in place and back in the frontend's instance list,
0 sessions lost, and nothing of the job left on any node. Run on the login node (slurm/cluster.sh exec).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launcher.jobdir import JobDir
from tests.support.cli import RL_LAUNCH
from tests.support.dynamo import TRAINER, mocker
from tests.support.running_job import job_processes
from tests.support.slurm import slurm_cluster, write_spec
from tests.support.specs import trainer_command

pytestmark = [pytest.mark.slurm, pytest.mark.dynamo]
__all__ = ["slurm_cluster"]  # the module fixture that skips without a cluster


def worker_pid(job: Path, status_url: str) -> int:
    """The process-group leader of the worker serving ``status_url`` (its DYN_SYSTEM_PORT), any node."""
    port = status_url.rsplit(":", 1)[1].encode()
    marks = {f"RL_LAUNCH_JOB_DIR={job}".encode(), b"DYN_SYSTEM_PORT=" + port}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
            if marks <= environ and os.getpgid(int(pid)) == int(pid):
                return int(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    raise AssertionError(f"no worker process with DYN_SYSTEM_PORT={port.decode()} for {job}")


def test_dynamo_fleet_on_slurm_recovers_a_killed_worker(
    dynamo_runtime: None, tmp_path: Path, tiny_model_dir: Path
) -> None:
    spec = write_spec(
        tmp_path,
        "dynamo-slurm",
        trainer_command(tmp_path, TRAINER, "external"),
        generation={"nodes": 2, **mocker(tiny_model_dir, 1, startup_timeout_s=120)},
        router={
            "kind": "dynamo",
            "dynamo": {
                "router_mode": "kv",
                "discovery": "etcd",
                "worker_args": ["--speedup-ratio", "10"],
                # The workers' request plane and status servers are unauthenticated on the cluster network.
                "allow_insecure_network": True,
            },
        },
    )
    proc = subprocess.Popen(
        [RL_LAUNCH, "submit", str(spec), "--follow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        request = None
        while request is None:
            assert time.monotonic() < deadline and proc.poll() is None, "no kill request from the trainer"
            request = next((p for p in (tmp_path / "jobs").glob("*/kill_me.json")), None)
            time.sleep(0.2)
        time.sleep(0.2)  # the trainer writes it whole before we read it
        job = request.parent
        victim = json.loads(request.read_text())
        os.killpg(worker_pid(job, victim["url"]), signal.SIGKILL)
        (job / "killed.json").write_text(json.dumps({"t": time.time()}))
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    seen = json.loads((job / "dynamo_trainer.json").read_text())
    assert seen["recovery_s"] is not None and seen["new_url"] != seen["victim"]
    replay = json.loads((job / "replay.json").read_text())["rows"][0]
    timings = json.loads((job / "result.json").read_text())["timings"]
    bring_up = timings["ray_start_s"] + timings["engine_start_s"] + timings["router_start_s"]
    lost = replay["sessions"] - replay["sessions_ok"]
    print(
        f"\ndynamo on slurm: bring-up {bring_up:.1f} s (workers {timings['engine_start_s']} s, frontend "
        f"{timings['router_start_s']} s); worker-kill recovery {seen['recovery_s']:.1f} s; sessions lost "
        f"{lost}/{replay['sessions']}"
    )
    assert lost == 0, replay
    # This job's own leftovers, on any node (the shared development cluster may run others' jobs; CI's
    # exclusive run checks the whole cluster in tests/slurm/test_launcher_slurm.py the same way).
    slurm_id = JobDir(job).slurm_job_id()
    assert slurm_id
    queue = subprocess.run(["squeue", "-h", "-j", str(slurm_id)], capture_output=True, text=True).stdout
    assert str(slurm_id) not in queue, queue
    deadline = time.monotonic() + 20
    while (left := job_processes(job)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == []
    assert not (job / "dynamo").exists()
