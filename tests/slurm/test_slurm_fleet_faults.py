"""Faults a Slurm job recovers from, checked on one shared job on the real local Slurm cluster.

An engine killed on a generation node, an engine wedged, the router actor killed: each leaves the job
running and healthy again, so the three checks share one job (``running_job`` with ``cluster: slurm``)
instead of paying a Slurm allocation, a multi-node Ray start and a teardown each (~25 s apiece on CI's
2 cores). The job's training command is the fault trainer's agent (``tests/support/jobs.py``, serve mode):
it runs each fault inside the job, with the job's own keys and Ray address, and writes what it saw.

This module holds only checks that share the job: a check of its own job's "queue empty" would see the
shared one. At the module's end the job is cancelled as a user cancels it, and the queue and every node
namespace must be empty (``slurm_leftovers``). What ends a job (every engine dead, signals, the time
limit) keeps a job of its own in ``test_launcher_slurm.py``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.support.jobs import fault_trainer  # noqa: F401 (the fixture)
from tests.support.running_job import RunningJob, running_job  # noqa: F401 (the fixture)
from tests.support.slurm import (
    FAULT_GENERATION,
    slurm_cluster,  # noqa: F401 (autouse: skips the module without a cluster)
    squeue_empty,
    wait_no_leftovers,
    write_spec,
)

pytestmark = pytest.mark.slurm


def slurm_leftovers(job: Path) -> list[str]:
    """After the shared job's cancel: Slurm runs nothing and no node namespace holds a process of a job."""
    return ["squeue not empty"] if not squeue_empty() else wait_no_leftovers()


@pytest.fixture
def shared(running_job: Callable[..., RunningJob], fault_trainer: Path) -> RunningJob:  # noqa: F811
    """The one Slurm job of this module, healthy again (every engine HEALTHY, nothing paused) before each
    check: its agent serves fault requests for at most 18 minutes, inside the job's 20-minute limit."""
    spec = yaml.safe_load(write_spec(fault_trainer.parent, "fault-shared", "true").read_text())
    spec.pop("job_root")
    spec["training"]["command"] = f"{sys.executable} {fault_trainer} serve 1080"
    spec["generation"] = FAULT_GENERATION
    spec["router"] = {"policy": "cache_aware", "backend_timeout_s": 5}
    return running_job(spec, leftovers=slurm_leftovers)


def node0_events(shared: RunningJob, since: float) -> list[dict[str, object]]:
    return [e for e in shared.events(since) if e["phase"] == "fleet" and e.get("engine_id") == "node0-0"]


def test_engine_killed_on_a_generation_node_is_restarted_there(shared: RunningJob) -> None:
    job, since = shared.job, time.time()
    out = shared.inject("kill")
    assert json.loads((out / "done.json").read_text())["exit_code"] == 0
    replay = json.loads((out / "replay.json").read_text())["rows"][0]
    assert replay["errors"] == 0 and replay["sessions_ok"] == replay["sessions"], replay
    events = shared.events(since)
    victim = json.loads((out / "victim.json").read_text())
    fleet = node0_events(shared, since)
    assert [e["to_state"] for e in fleet][-1] == "HEALTHY"
    back = next(e for e in events if e["phase"] == "engine_restarted")
    generation_nodes = next(e for e in shared.events() if e["phase"] == "starting")["nodes"]["generation"]
    restarted_on = json.loads((job / "engines" / "node-0.urls.json").read_text())["node"]
    assert restarted_on == generation_nodes[0] and back["url"] != victim["victim"]
    print(
        f"\nslurm kill: out {fleet[0]['t'] - victim['t']:.1f}s, "
        f"readmitted {fleet[-1]['t'] - victim['t']:.1f}s "
        f"on {restarted_on} at {back['url']}; sessions lost {replay['errors']}"
    )
    shared.wait_healthy()  # squeue empty and no leftovers: checked once the module cancels the job


def test_wedged_engine_leaves_rotation_and_is_restarted(shared: RunningJob) -> None:
    since = time.time()
    out = shared.inject("wedge")
    assert json.loads((out / "done.json").read_text())["exit_code"] == 0
    replay = json.loads((out / "replay.json").read_text())["rows"][0]
    assert replay["errors"] == 0 and replay["sessions_ok"] == replay["sessions"], replay
    victim = json.loads((out / "victim.json").read_text())
    fleet = node0_events(shared, since)
    assert fleet[0]["t"] - victim["t"] < 5 + 2  # out within the backend timeout plus a tick
    assert [e["to_state"] for e in fleet][-1] == "HEALTHY"
    out_s, back_s = fleet[0]["t"] - victim["t"], fleet[-1]["t"] - victim["t"]
    print(f"\nslurm wedge: out {out_s:.1f}s, readmitted {back_s:.1f}s")
    shared.wait_healthy()


def test_killed_router_actor_comes_back_on_the_same_url(shared: RunningJob) -> None:
    out = shared.inject("kill_router")
    assert json.loads((out / "done.json").read_text())["exit_code"] == 0
    back = json.loads((out / "router_back.json").read_text())
    replay = json.loads((out / "replay.json").read_text())["rows"][0]
    print(f"\nslurm router kill: same URL back in {back['down_s']:.1f}s; sessions lost {replay['errors']}")
    assert back["down_s"] < 5
    assert replay["errors"] == 0 and replay["sessions_ok"] == replay["sessions"], replay
    shared.wait_healthy()
