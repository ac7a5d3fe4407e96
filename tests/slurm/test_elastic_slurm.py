"""An elastic fleet on the local Slurm cluster (``slurm/cluster.sh``, 3 nodes), as a user runs it: a
standing fleet on one node (``rl-launch fleet up``), a replay through its router, ``rl-launch fleet grow``
by a node mid-replay (a Slurm job of its own, whose engines join), the bad inputs refused, ``rl-launch
fleet shrink`` of that node mid-replay (drained, its grow job ended, the node idle in ``sinfo``), and the
fleet brought down with nothing left in the queue or on any node. No request fails and none is retried
for a failure (the drain moves the requests in flight, or sends again one caught before its first token).
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
from launcher.jobdir.paths import record_dir as record_dir_of
from router.record.format import read_records
from router.state.backends import canonical_backend_url
from tests.support.cli import RL_LAUNCH
from tests.support.running_job import DRAIN_REACHES_ROUTER_S, retried_for_failure
from tests.support.slurm import SLURM, run, slurm_cluster, squeue_empty, wait_no_leftovers  # noqa: F401 (autouse)

pytestmark = pytest.mark.slurm


def node_states() -> dict[str, str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=30)
    return dict(line.split() for line in out.stdout.splitlines() if line.strip())


def queued() -> set[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30)
    return {x.strip() for x in out.stdout.split()}


def assert_nothing_left() -> None:
    """Nothing in the queue, no process in any node's namespace, every node idle (bounded waits)."""
    deadline = time.monotonic() + 60
    while not squeue_empty():
        assert time.monotonic() < deadline, queued()
        time.sleep(0.5)
    assert wait_no_leftovers(60) == []
    assert set(node_states().values()) == {"idle"}, node_states()


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
                    "sim": {"speed": 0.3},
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

        # A grow that cannot start waits in the queue, says why, and can be cancelled: the last free node
        # is taken by another job (whole), so the grow's job pends with Slurm's reason.
        (free,) = {"node1", "node2", "node3"} - {driver_node, grown_node}
        blocker = subprocess.run(
            [
                "sbatch",
                "--parsable",
                "--exclusive",
                "-w",
                free,
                "-t",
                "5",
                "--output=/dev/null",
                "--wrap",
                "sleep 300",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert blocker.returncode == 0, blocker.stderr
        blocker_id = blocker.stdout.strip().split(";")[0]
        try:
            grow2 = run("fleet", "grow", "elastic-fleet", "--root", str(root), "--nodes", "1")
            assert grow2.returncode == 0 and "grow g2" in grow2.stdout, grow2.stdout + grow2.stderr

            def g2() -> dict[str, Any]:
                return next(g for g in elastic(job)["grows"] if g["id"] == "g2")

            deadline = time.monotonic() + 30
            while not (g2()["state"] == "PENDING" and g2()["reason"] not in ("", "None")):
                assert time.monotonic() < deadline, g2()
                time.sleep(0.5)
            status = run("status", str(job), "--once", timeout=60)
            line = next((x for x in status.stdout.splitlines() if "grow g2" in x), "")
            print(f"queued grow in status: {line.strip()}")
            assert "PENDING (" in line, status.stdout[-2000:] + status.stderr[-2000:]
            cancel = run("fleet", "grow", "elastic-fleet", "--root", str(root), "--cancel", "g2")
            assert cancel.returncode == 0, cancel.stderr
            deadline = time.monotonic() + 30
            while g2()["job_id"] in queued() or g2()["state"] != "CANCELLED":
                assert time.monotonic() < deadline, (g2(), queued())
                time.sleep(0.5)
        finally:
            subprocess.run(["scancel", blocker_id], capture_output=True, timeout=30)

        time.sleep(2)  # the grown engines take their share of the step
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
        # No request retried for a failure: one the drain caught moved, or was sent again before its
        # first token, to an engine that stays.
        retried = retried_for_failure(records)
        assert records and not retried, [(r.attempts, r.moves) for r in retried[:3]]
        reasons = {m["reason"] for r in records for m in r.moves or []}
        assert reasons <= {"drained", "removed"}, reasons
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
        assert on_grown[-1] < drain["t"] + DRAIN_REACHES_ROUTER_S, "a request went to a draining engine"
    finally:
        if replay is not None and replay.poll() is None:
            replay.kill()
        down = run("fleet", "down", "elastic-fleet", "--root", str(root), "--force", timeout=180)
        print(down.stdout[-500:], down.stderr[-500:])
    assert down.returncode == 0, down.stderr
    assert_nothing_left()


TAIL_TRAINER = r"""
import json, os, subprocess, sys, time
job = os.environ["RL_JOB_DIR"]
rl = os.path.join(os.path.dirname(sys.executable), "rl-launch")
out = {}
def state():
    return json.load(open(os.path.join(job, "state.json")))
def wait(pred, timeout_s, what):
    deadline = time.time() + timeout_s  # bounded
    while not pred():
        if time.time() > deadline:
            out["timeout"] = what
            json.dump(out, open(os.path.join(job, "tail.json"), "w"))
            sys.exit(3)
        time.sleep(0.5)
def replay(scale, name):
    return subprocess.run([rl, "bench", "replay", "--url", os.environ["RL_POLICY_BASE_URL"], "--workload",
                           "longtail", "--scale", str(scale), "--seed", "2", "--retry-attempts", "3",
                           "--json", os.path.join(job, name), "--results-dir", job], timeout=600).returncode
out["step1"] = replay(0.1, "step1.json")
released = lambda: [n for n in state()["elastic"]["nodes"] if n["state"] == "RELEASED"]
wait(released, 60, "the tail policy to give a node back")
node = released()[0]["name"]
sinfo = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], capture_output=True, text=True, timeout=30)
squeue = subprocess.run(["squeue", "-h", "-j", os.environ["SLURM_JOB_ID"], "-o", "%D %N"],
                        capture_output=True, text=True, timeout=30)
out["released"], out["sinfo"], out["squeue"] = node, sinfo.stdout.strip(), squeue.stdout.strip()
# The next step starts: a new weight version; the policy asks the node back (a grow job).
v = subprocess.run([rl, "fleet", "version", job, "--set", "step-2"], capture_output=True, text=True,
                   timeout=120)
out["stamp"] = v.returncode
joined = lambda: [g for g in state()["elastic"]["grows"] if g["state"] == "JOINED"]
wait(joined, 180, "the grow back to join")
grow = joined()[0]
out["grow"] = grow
engines = lambda: {e["id"]: e for e in state()["fleet"]["engines"]}
new_ids = [i for i in engines() if i.startswith("node%d-" % grow["indices"][0])]
wait(lambda: all(engines()[i]["state"] == "STALE" for i in new_ids), 30, "the grown engines to be held STALE")
out["grown_states"] = {i: engines()[i]["state"] for i in new_ids}
urls = [engines()[i]["url"] for i in new_ids]
args = [a for u in urls for a in ("--engine", u)]
v = subprocess.run([rl, "fleet", "version", job, "--set", "step-2", *args], capture_output=True, text=True,
                   timeout=120)  # the trainer refits them (here: stamps): readmitted
out["stamp_grown"] = v.returncode
wait(lambda: all(engines()[i]["state"] == "HEALTHY" for i in new_ids), 30, "the grown engines readmitted")
out["step2"] = replay(0.03, "step2.json")
json.dump(out, open(os.path.join(job, "tail.json"), "w"))
"""


def test_tail_policy_gives_a_node_back_and_grows_back_at_the_next_step(tmp_path: Path) -> None:
    """The tail policy on a job of its own allocation (1 training + 2 generation nodes): the step's tail
    shrinks the allocation itself (scontrol update: the node idle while the job runs on), the next step's
    new weight version grows it back by a grow job, whose engines are STALE until refit."""
    root = tmp_path / "jobs"
    script = tmp_path / "trainer.py"
    script.write_text(TAIL_TRAINER)
    spec = tmp_path / "tail.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "elastic-tail",
                "cluster": "slurm",
                "job_root": str(root),
                "slurm": SLURM,
                "training": {"nodes": 1, "command": f"{sys.executable} {script}"},
                "generation": {
                    "nodes": 2,
                    "engine": "sim",
                    "engines_per_node": 2,
                    "served_model_name": "sim-8b",
                    "startup_timeout_s": 60,
                    "sim": {"speed": 0.6},
                    "elastic": {
                        "floor_nodes": 1,
                        "shrink_below": 0.25,
                        "for_s": 3,
                        "capacity_per_engine": 16,
                    },
                },
                "router": {"backend_timeout_s": 30},
            },
            sort_keys=False,
        )
    )
    sub = run("submit", str(spec), "--json", timeout=120)
    assert sub.returncode == 0, sub.stderr
    job = Path(json.loads(sub.stdout)["job_dir"])
    deadline = time.monotonic() + 600
    while JobDir(job).read_result() is None or not JobDir(job).read_result().torn_down:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the job did not end"
        time.sleep(1)
    result = JobDir(job).read_result()
    out = json.loads((job / "tail.json").read_text()) if (job / "tail.json").exists() else {}
    print(f"\ntail policy job: {result}; {json.dumps(out)[:1500]}")
    assert result is not None and result.exit_code == 0, (
        result,
        out,
        (job / "driver.log").read_text()[-3000:],
    )
    assert out["sinfo"] == "idle", out  # the released node went back while the job ran on
    assert out["squeue"].split()[0] == "2", out  # the job's own allocation shrank from 3 nodes to 2
    assert out["grown_states"] and set(out["grown_states"].values()) == {"STALE"}, out
    for step in ("step1.json", "step2.json"):
        row = json.loads((job / step).read_text())["rows"][0]
        assert row["errors"] == 0 and row["retries"] == 0 and row["failed_requests"] == 0, (step, row)
    events = [e for e in JobDir(job).read_events() if e.get("phase") == "elastic"]
    decisions = [e["detail"] for e in events if e.get("action") == "policy"]
    print("\n".join(decisions))
    # (step 2's own tail may shrink again: a third decision)
    assert len(decisions) >= 2 and "shrink 1" in decisions[0] and "grow 1" in decisions[1], decisions
    assert "the weight version changed" in decisions[1]
    # scontrol's resize scripts went into the job's elastic directory, not where the job was submitted from
    assert list((job / "elastic").glob("slurm_job_*_resize.sh")), list((job / "elastic").iterdir())
    assert not list(Path.cwd().glob("slurm_job_*_resize.*")) and not list(tmp_path.glob("slurm_job_*"))
    assert_nothing_left()
