"""A standing fleet on the local Slurm cluster (``slurm/cluster.sh``), as a user runs it: ``rl-launch fleet
up`` (a generation-only Slurm job), a trainer job that attaches and replays, ``scancel``ed mid-step while it
holds a refit's pause, a resubmitted trainer that finishes, and ``rl-launch fleet down`` leaving nothing on
any node and nothing in the queue. The fleet's engines are never restarted."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from launcher.jobdir import JobDir
from tests.support.slurm import (
    SLURM,
    leftovers,
    run,
    slurm_cluster,  # noqa: F401 (autouse: skips the module without a cluster)
    squeue_empty,
    wait_no_leftovers,
)
from tests.support.standing_fleet import TRAINER, fleet_resumed, key_revoked

pytestmark = pytest.mark.slurm


def _write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def trainer(tmp_path: Path, mode: str, **gen: Any) -> Path:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    return _write(
        tmp_path / f"trainer-{mode}.yaml",
        {
            "name": "trainer",
            "cluster": "slurm",
            "job_root": str(tmp_path / "jobs"),
            "slurm": SLURM,
            "training": {"nodes": 1, "command": f"{sys.executable} {script} {mode}"},
            "generation": {"fleet": "slurm-fleet", **gen},
        },
    )


def job_dir_of(out: str) -> Path:
    line = next(x for x in out.splitlines() if x.startswith("job directory:"))
    return Path(line.split(":", 1)[1].strip())


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.3)


def test_fleet_outlives_a_cancelled_trainer_and_comes_down_clean(tmp_path: Path) -> None:
    root = tmp_path / "jobs"
    spec = _write(
        tmp_path / "fleet.yaml",
        {
            "name": "slurm-fleet",
            "cluster": "slurm",
            "job_root": str(root),
            "slurm": SLURM,
            "fleet": {"consumers": {"trainer": {"admin": True}}},
            "generation": {
                "nodes": 1,
                "engine": "sim",
                "engines_per_node": 2,
                "served_model_name": "sim-8b",
                "startup_timeout_s": 60,
                "sim": {"speed": 4},
            },
            "router": {"backend_timeout_s": 30},
        },
    )
    up = run("fleet", "up", str(spec), "--json", timeout=300)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    fleet_job = Path(json.loads(up.stdout)["job_dir"])
    try:
        fleet_events = JobDir(fleet_job).read_events()
        t_start = next(e["t"] for e in fleet_events if e["phase"] == "starting")
        t_serving = next(e["t"] for e in fleet_events if e["phase"] == "fleet_serving")
        engines_before = {e.url for e in JobDir(fleet_job).engine_entries()}
        assert len(engines_before) == 2

        # bad input is refused before anything is queued
        before = set(root.iterdir())
        wrong = run("submit", str(trainer(tmp_path, "refit", served_model_name="qwen-72b")))
        assert wrong.returncode != 0 and "serves model 'sim-8b'" in wrong.stderr, wrong.stderr
        assert set(root.iterdir()) == before and _queued() == {JobDir(fleet_job).slurm_job_id()}

        # trainer A attaches, replays, holds a refit's pause, and is scancel'ed there
        first = run("submit", str(trainer(tmp_path, "hold")))
        assert first.returncode == 0, first.stderr
        job_a = job_dir_of(first.stdout)
        wait_for(lambda: (job_a / "holding.json").exists(), 240, "trainer A to hold the pause")
        key_a = JobDir(job_a).read_api_key()
        cancel = run("cancel", job_a.name, "--root", str(root))
        assert cancel.returncode == 0, cancel.stderr
        cancelled = time.monotonic()
        fleet_url = JobDir(fleet_job).read_state()["fleet_url"]
        admin = {"Authorization": "Bearer " + JobDir(fleet_job).read_admin_token()}
        wait_for(fleet_resumed(fleet_url, admin), 30, "the fleet to resume")
        resumed_s = time.monotonic() - cancelled
        router = JobDir(fleet_job).read_state()["router_url"]
        wait_for(key_revoked(router, key_a), 30, "trainer A's key to be revoked")

        # trainer B, resubmitted: attaches, refits at once, replays, finishes
        second = run("submit", str(trainer(tmp_path, "refit")), "--follow", timeout=400)
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
        job_b = job_dir_of(second.stdout)
        replay = json.loads((job_b / "replay.json").read_text())["rows"][0]
        assert replay["errors"] == 0 and replay["sessions_ok"] == replay["sessions"], replay
        first_rollout = json.loads((job_b / "first.json").read_text())
        b_start = next(e["t"] for e in JobDir(job_b).read_events() if e["phase"] == "starting")
        print(
            f"\nslurm standing fleet: its own start (Ray, engines, router) {t_serving - t_start:.1f} s; "
            f"after scancel of the trainer the lease resumed the fleet in {resumed_s:.1f} s; the "
            f"resubmitted trainer's first rollout {first_rollout['t'] - b_start:.1f} s after its driver "
            "started"
        )
        assert first_rollout["t"] - b_start < t_serving - t_start + 30
        assert {e.url for e in JobDir(fleet_job).engine_entries()} == engines_before
        assert not [e for e in JobDir(fleet_job).read_events() if e["phase"] == "engine_restarted"]
    finally:
        down = run("fleet", "down", "slurm-fleet", "--force", "--root", str(root), timeout=240)
    assert down.returncode == 0, down.stderr
    wait_for(squeue_empty, 60, "an empty queue")
    assert wait_no_leftovers(30) == [], leftovers()
    assert JobDir(fleet_job).read_result().outcome == "finished"


def _queued() -> set[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=10).stdout
    return {x.strip() for x in out.splitlines() if x.strip()}
