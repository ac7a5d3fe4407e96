"""An elastic fleet on the local Slurm cluster (``slurm/cluster.sh``, 3 nodes), as a user runs it: a
standing fleet on one node (``rl-launch fleet up``), a replay through its router, ``rl-launch fleet grow``
by a node mid-replay (a Slurm job of its own, whose engines join), the bad inputs refused, ``rl-launch
fleet shrink`` of that node mid-replay (drained, its grow job ended, the node idle in ``sinfo``), and the
fleet brought down with nothing left in the queue or on any node. No request fails and none is retried.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from launcher.jobdir import JobDir
from launcher.status.rollouts import record_dir_of
from router.record.format import read_records
from router.state.backends import canonical_backend_url
from tests.test_launcher_slurm import squeue_empty, wait_no_leftovers

pytestmark = pytest.mark.slurm

RL_LAUNCH = str(Path(sys.executable).with_name("rl-launch"))
SLURM = {"partition": "debug", "time": "00:20:00", "cpus_per_task": 2, "gpus_per_node": 0}


@pytest.fixture(scope="module", autouse=True)
def slurm_cluster() -> None:
    from tests.test_slurm_cluster import _slurm_unreachable

    reason = _slurm_unreachable()
    if reason:
        pytest.skip(
            f"no Slurm cluster reachable: {reason} (slurm/cluster.sh start, then run on its login node)"
        )


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RL_LAUNCH, *args], capture_output=True, text=True, timeout=timeout)


def node_states() -> dict[str, str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=30)
    return dict(line.split() for line in out.stdout.splitlines() if line.strip())


def queued() -> set[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30)
    return {x.strip() for x in out.stdout.split()}


def elastic(job: Path) -> dict[str, Any]:
    return JobDir(job).read_state().get("elastic") or {}


def test_grow_and_shrink_mid_replay_on_slurm(tmp_path: Path) -> None:
    root = tmp_path / "jobs"
    spec = tmp_path / "fleet.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "elastic-fleet",
                "cluster": "slurm",
                "job_root": str(root),
                "slurm": SLURM,
                "fleet": {},
                "generation": {
                    "nodes": 1,
                    "engine": "sim",
                    "engines_per_node": 2,
                    "served_model_name": "sim-8b",
                    "startup_timeout_s": 60,
                    "sim": {"speed": 0.5},
                },
                "router": {"backend_timeout_s": 30},
            },
            sort_keys=False,
        )
    )
    up = run("fleet", "up", str(spec), "--json", timeout=300)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    job = Path(json.loads(up.stdout)["job_dir"])
    jd = JobDir(job)
    fleet_job_id = jd.slurm_job_id()
    replay: subprocess.Popen[str] | None = None
    try:
        state = jd.read_state()
        (driver_node,) = state["nodes"]["generation"]
        env = {**os.environ, "RL_POLICY_API_KEY": jd.read_api_key()}
        replay = subprocess.Popen(
            [
                RL_LAUNCH,
                "bench",
                "replay",
                "--url",
                state["router_url"],
                "--workload",
                "longtail",
                "--scale",
                "0.08",
                "--seed",
                "7",
                "--retry-attempts",
                "3",
                "--json",
                str(tmp_path / "replay.json"),
                "--results-dir",
                str(tmp_path),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        time.sleep(3)

        # Grow by one node: a Slurm job of its own on a node the fleet does not hold.
        t_grow = time.time()
        grow = run(
            "fleet",
            "grow",
            "elastic-fleet",
            "--root",
            str(root),
            "--nodes",
            "1",
            "--wait",
            "--timeout",
            "180",
            timeout=240,
        )
        assert grow.returncode == 0, grow.stdout + grow.stderr
        (g,) = elastic(job)["grows"]
        assert g["state"] == "JOINED" and g["job_id"] and g["job_id"] != fleet_job_id, g
        grown = [n for n in elastic(job)["nodes"] if n["grow_id"] == g["id"]]
        assert len(grown) == 1 and grown[0]["name"] != driver_node, grown
        grown_node = grown[0]["name"]
        fleet = jd.read_state()["fleet"]
        assert {e["id"] for e in fleet["engines"]} >= {"node1-0", "node1-1"}
        print(f"\ngrow: joined {time.time() - t_grow:.1f} s after asking ({grow.stdout.strip()})")

        # Bad input: refused with the reason, nothing changed, nothing queued.
        before = queued()
        refusals = {
            "past the partition": run("fleet", "grow", "elastic-fleet", "--root", str(root), "--nodes", "2"),
            "below one engine": run("fleet", "shrink", "elastic-fleet", "--root", str(root), "--nodes", "2"),
            "not the fleet's": run(
                "fleet", "shrink", "elastic-fleet", "--root", str(root), "--node", "node9"
            ),
            "the driver's node": run(
                "fleet", "shrink", "elastic-fleet", "--root", str(root), "--node", driver_node
            ),
        }
        for what, got in refusals.items():
            print(f"refused ({what}): {got.stderr.strip()}")
            assert got.returncode != 0, (what, got.stdout)
        assert "partition debug has 3 node(s)" in refusals["past the partition"].stderr
        assert "would leave no engine serving" in refusals["below one engine"].stderr
        assert "node9 is not one of the fleet's" in refusals["not the fleet's"].stderr
        assert "runs the job's driver" in refusals["the driver's node"].stderr
        assert queued() == before and len(elastic(job)["grows"]) == 1
        assert all(n["state"] == "SERVING" for n in elastic(job)["nodes"])

        time.sleep(4)  # the grown engines take their share of the step
        t_shrink = time.time()
        shrink = run(
            "fleet",
            "shrink",
            "elastic-fleet",
            "--root",
            str(root),
            "--node",
            grown_node,
            "--wait",
            "--timeout",
            "180",
            timeout=240,
        )
        assert shrink.returncode == 0, shrink.stdout + shrink.stderr
        print(f"shrink: {shrink.stdout.strip()} in {time.time() - t_shrink:.1f} s")
        assert replay.poll() is None, "the replay ended before the shrink: nothing was measured"

        # The grow job ended and its node is idle; its engines are gone from the fleet and the router.
        deadline = time.monotonic() + 60
        while g["job_id"] in queued() or node_states().get(grown_node) != "idle":
            assert time.monotonic() < deadline, (queued(), node_states())
            time.sleep(0.5)
        view = elastic(job)
        assert [n["state"] for n in view["nodes"] if n["name"] == grown_node] == ["RELEASED"]
        assert view["node_seconds"]["given_back"] >= 0
        fleet = jd.read_state()["fleet"]
        assert {e["id"] for e in fleet["engines"]} == {"node0-0", "node0-1"}
        removed = json.loads((job / "engines" / "node-1.urls.json.removed").read_text())
        grown_urls = {canonical_backend_url(e["url"]) for e in removed["engines"]}

        def router_members() -> set[str]:  # the front's own view, refreshed every few controller ticks
            return {canonical_backend_url(m["url"]) for m in jd.read_state()["gateway"]["members"]}

        deadline = time.monotonic() + 15
        while grown_urls & router_members():
            assert time.monotonic() < deadline, router_members()
            time.sleep(0.5)
        assert len(router_members()) == 2

        out, _ = replay.communicate(timeout=600)
        assert replay.returncode == 0, out[-3000:]
        row = json.loads((tmp_path / "replay.json").read_text())["rows"][0]
        print(
            f"replay: {row['sessions']} sessions in {row.get('wall_s')} s, errors {row['errors']}, "
            f"retries {row['retries']}"
        )
        assert row["errors"] == 0 and row["retries"] == 0 and row["failed_requests"] == 0, row

        records = read_records(record_dir_of(job)).records
        assert records and all(len(r.attempts) == 1 for r in records), "the router retried a request"
        events = [e for e in jd.read_events() if e.get("phase") == "elastic"]
        joined = next(e for e in events if e["action"] == "grow_joined")
        drain = next(e for e in events if e["action"] == "drain")
        on_grown = sorted(r.t for r in records if r.engine and canonical_backend_url(r.engine) in grown_urls)
        assert on_grown, "the grown engines never served"
        print(
            f"grown engines: {len(on_grown)} requests, "
            f"the first {on_grown[0] - joined['t']:.1f} s after joining"
        )
        assert on_grown[0] - joined["t"] < 5
        assert on_grown[-1] < drain["t"] + 0.5, "a request went to a draining engine"
    finally:
        if replay is not None and replay.poll() is None:
            replay.kill()
        down = run("fleet", "down", "elastic-fleet", "--root", str(root), "--force", timeout=180)
        print(down.stdout[-500:], down.stderr[-500:])
    assert down.returncode == 0, down.stderr
    deadline = time.monotonic() + 60
    while not squeue_empty():
        assert time.monotonic() < deadline, queued()
        time.sleep(0.5)
    assert wait_no_leftovers(60) == []
    assert set(node_states().values()) == {"idle"}, node_states()
