"""An elastic fleet in local mode (the same driver, manager and router as on Slurm, without sbatch): a
Gym-like client replays a rollout step while the fleet grows by a node and then gives it back.

* grow mid-replay: the new engines join (HEALTHY) and take requests within seconds of joining;
* shrink mid-replay: the drained node's engines get no new request, the step's requests in flight on it are
  moved at once to the engines that stay (issue 41: the builtin router continues each from its tokens so
  far; another front lets them finish there), then the engines stop and leave the fleet; no request of the
  step fails and none is retried. One long
  request sent straight to a grown engine outlasts the drain timeout: the drain is seen DRAINING in
  `rl-launch status`, and ends by its timeout, aborting that request only (the Slurm test drains to zero);
* bad input (below one engine, a node that is not the fleet's, a grow of 0) is refused with the reason and
  changes nothing.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from launcher.jobdir import JobDir
from launcher.jobdir.paths import record_dir as record_dir_of
from router.record.format import read_records
from router.state.backends import canonical_backend_url
from tests.support.running_job import DRAIN_REACHES_ROUTER_S, retried_for_failure
from tests.support.specs import local_spec, run_spec, sim, trainer_command

pytestmark = pytest.mark.ray

TRAINER = textwrap.dedent(
    """\
    import json, os, subprocess, sys, time
    job = os.environ["RL_JOB_DIR"]
    rl = os.path.join(os.path.dirname(sys.executable), "rl-launch")
    def fleet(*args):
        p = subprocess.run([rl, "fleet", *args], capture_output=True, text=True, timeout=180)
        return {"args": list(args), "code": p.returncode, "out": p.stdout.strip(), "err": p.stderr.strip(),
                "t": time.time()}
    out = {}
    replay = subprocess.Popen([rl, "bench", "replay", "--url", os.environ["RL_POLICY_BASE_URL"],
                               "--workload", "longtail", "--scale", "0.08", "--seed", "5",
                               "--retry-attempts", "3", "--json", os.path.join(job, "replay.json"),
                               "--results-dir", job])
    time.sleep(2)
    out["refused"] = [fleet("shrink", job, "--nodes", "1"),            # the only node: no engine left
                      fleet("shrink", job, "--node", "not-a-node"),     # not the fleet's
                      fleet("grow", job, "--nodes", "0")]               # bad count (click refuses)
    out["grow"] = fleet("grow", job, "--nodes", "1", "--wait", "--timeout", "120")
    time.sleep(5)  # the new engines take their share
    import urllib.request
    grown = json.load(open(os.path.join(job, "engines", "node-1.urls.json")))["engines"]
    # The engines take the job's own engine key (no client key opens them); the job's user can read it.
    key = {"Authorization": "Bearer " + open(os.path.join(job, "secrets", "engine_key")).read().strip()}
    out["grown_served"] = {}
    for e in grown:  # each grown engine's own count of finished requests, before it is drained
        text = urllib.request.urlopen(urllib.request.Request(e["url"].rstrip("/") + "/metrics", headers=key),
                                      timeout=5).read().decode()
        out["grown_served"][e["url"]] = sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                                            if x.startswith("vllm:request_success_total"))
    # One long request sent straight to a grown engine (not through the router, so not part of the step):
    # it keeps that engine busy past the drain timeout, so the drain lasts long enough to be seen in
    # `rl-launch status` and ends by its timeout, aborting only that request.
    import threading
    def long_request():
        body = json.dumps({"model": "sim-8b", "prompt": "x", "max_tokens": 1500}).encode()
        req = urllib.request.Request(grown[0]["url"].rstrip("/") + "/v1/completions", data=body,
                                     headers={**key, "Content-Type": "application/json"})
        try:
            out["long_request"] = urllib.request.urlopen(req, timeout=120).status
        except Exception as exc:
            out["long_request"] = repr(exc)[:200]
    threading.Thread(target=long_request, daemon=True).start()
    time.sleep(0.5)
    out["shrink"] = fleet("shrink", job, "--nodes", "1", "--drain-timeout", "8")
    st = subprocess.run([rl, "status", job, "--json"], capture_output=True, text=True, timeout=60)
    out["status_draining"] = json.loads(st.stdout) if st.returncode == 0 else st.stderr
    st = subprocess.run([rl, "status", job, "--once"], capture_output=True, text=True, timeout=60,
                        env={**os.environ, "COLUMNS": "200"})
    out["status_text"] = st.stdout
    deadline = time.time() + 60
    while time.time() < deadline:  # bounded: until the node is given back
        nodes = json.load(open(os.path.join(job, "state.json")))["elastic"]["nodes"]
        if not any(n["state"] == "DRAINING" for n in nodes):
            break
        time.sleep(0.3)
    # The front's own view (vllm-router: its /workers; ours: its backends), refreshed every few ticks.
    canon = lambda u: u.rstrip("/").removesuffix("/v1")
    grown_urls = {canon(e["url"]) for e in grown}
    deadline = time.time() + 20
    while time.time() < deadline:
        gateway = json.load(open(os.path.join(job, "state.json")))["gateway"]
        members = {canon(m["url"]) for m in gateway["members"]}
        if not members & grown_urls:
            break
        time.sleep(0.3)
    out["members_after"], out["grown_urls"] = sorted(members), sorted(grown_urls)
    out["replay_running_after_shrink"] = replay.poll() is None
    code = replay.wait()
    json.dump(out, open(os.path.join(job, "elastic_calls.json"), "w"))
    sys.exit(code)
    """
)


def run_job(
    tmp_path: Path, router: dict[str, object] | None = None
) -> tuple[subprocess.CompletedProcess[str], Path]:
    spec = local_spec(
        "elastic-local",
        root=tmp_path / "jobs",
        command=trainer_command(tmp_path, TRAINER),
        generation=sim(2, speed=0.3),
        router=router,
    )
    return run_spec(tmp_path / "spec.yaml", spec, timeout=600)


def elastic_events(job: Path) -> list[dict[str, object]]:
    return [e for e in JobDir(job).read_events() if e.get("phase") == "elastic"]


FRONTS = {
    "builtin": {"backend_timeout_s": 10},
    "vllm-router": {"kind": "vllm-router", "vllm_router": {"policy": "round_robin"}},
}


@pytest.mark.parametrize("front", list(FRONTS))
def test_grow_then_shrink_mid_replay_loses_and_retries_nothing(tmp_path: Path, front: str) -> None:
    proc, job = run_job(tmp_path, FRONTS[front])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    calls = json.loads((job / "elastic_calls.json").read_text())
    replay = json.loads((job / "replay.json").read_text())["rows"][0]
    print(
        f"\nreplay: {replay['sessions']} sessions, wall {replay.get('wall_s')}, errors {replay['errors']}, "
        f"retries {replay['retries']}; grow: {calls['grow']['out']}; shrink: {calls['shrink']['out']}"
    )
    assert replay["errors"] == 0 and replay["retries"] == 0 and replay["failed_requests"] == 0, replay
    assert calls["replay_running_after_shrink"], "the replay ended before the shrink: nothing was measured"

    below, stranger, zero = calls["refused"]
    assert below["code"] != 0 and "would leave no engine serving" in below["err"], below
    assert stranger["code"] != 0 and "not-a-node is not one of the fleet's" in stranger["err"], stranger
    assert zero["code"] != 0 and "--nodes" in zero["err"], zero
    assert calls["grow"]["code"] == 0, calls["grow"]
    assert calls["shrink"]["code"] == 0, calls["shrink"]

    events = elastic_events(job)
    actions = [e["action"] for e in events]
    for action in ("refused", "grow", "grow_starting", "grow_joined", "drain", "node_released"):
        assert action in actions, actions
    joined = next(e for e in events if e["action"] == "grow_joined")
    released = next(e for e in events if e["action"] == "node_released")
    # the long request kept its engine busy: the drain ended by its timeout, aborting that one request
    assert "drain timeout (8 s): 1 request(s) still in flight were aborted" in released["detail"], released
    assert calls["long_request"] != 200, calls["long_request"]

    assert len(calls["members_after"]) == 2 and not set(calls["members_after"]) & set(calls["grown_urls"]), (
        "the front still routes to the drained engines",
        calls["members_after"],
    )
    served = calls["grown_served"]
    print(f"grown engines' own counts of finished requests: {served}")
    assert len(served) == 2 and sum(served.values()) > 0, served
    if front == "builtin":  # ours spreads sessions; vllm-router 0.1.17's round_robin is its own business
        assert all(n > 0 for n in served.values()), served
    fleet = json.loads((job / "state.json").read_text())["fleet"]
    assert {e["id"] for e in fleet["engines"]} == {"node0-0", "node0-1"}  # gone from the fleet
    elastic = json.loads((job / "state.json").read_text())["elastic"]
    assert elastic["node_seconds"]["given_back"] > 0 and elastic["final"]

    # `rl-launch status` while the node drained: its engines DRAINING, the node DRAINING in the elastic
    # view, and the line that says so.
    live = calls["status_draining"]
    assert isinstance(live, dict), live
    states = {e["id"]: e["state"] for e in live["engines"]}
    assert states.get("node1-0") == "DRAINING" and states.get("node1-1") == "DRAINING", states
    assert live["elastic"]["counts"]["DRAINING"] == 1, live["elastic"]
    assert "DRAINING" in calls["status_text"] and "node-seconds held" in calls["status_text"]
    if front != "builtin":
        return  # the request record is the builtin router's: the timing checks below read it

    # The grown node's engines (node1-*) served requests, starting within seconds of joining, and none
    # after they were released; the drained engines were never sent a request after the drain began.
    drain = next(e for e in events if e["action"] == "drain")
    records = read_records(record_dir_of(job)).records
    moves = {r.id: r.moves for r in records if r.moves}
    print(f"requests moved off the drained node: {len(moves)} {list(moves.values())}")
    retried = retried_for_failure(records)
    assert records and not retried, f"the router retried {[(r.id, r.attempts) for r in retried]}"
    fleet = json.loads((job / "state.json").read_text())["fleet"]
    listing = json.loads((job / "engines" / "node-1.urls.json.removed").read_text())
    grown_urls = {canonical_backend_url(e["url"]) for e in listing["engines"]}
    assert len(grown_urls) == 2, listing
    for moved in moves.values():  # only off the drained node's engines, by the drain (or its push)
        assert all(m["from"] in grown_urls and m["reason"] in ("drained", "removed") for m in moved), moved
    on_grown = sorted(r.t for r in records if r.engine and canonical_backend_url(r.engine) in grown_urls)
    assert on_grown, "the grown engines never served"
    first = on_grown[0] - joined["t"]
    print(f"grown engines: {len(on_grown)} requests, the first {first:.1f} s after joining")
    assert first < 5
    assert all(t < drain["t"] + DRAIN_REACHES_ROUTER_S for t in on_grown), (
        "a request went to a draining engine"
    )
