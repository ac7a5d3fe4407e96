"""The refit window of a ``router.kind: ray-serve`` job: the driver's fleet endpoint beside Serve, real Ray
Serve, simulated engines.

* a local job of 3 replicas whose trainer refits through ``FleetClient`` and ``rl-launch fleet refit``:
  every engine's checksum moves together, responses carry the new ``x-rl-weight-version``; an engine given a
  broken directory is quarantined and Serve's routing passes it over (a single request would have killed
  it: the simulator's core dies on its first step on detached weights, as vLLM 0.32's does), no request
  fails; the next refit brings it back; a killed engine's replacement replica comes back on the
  checkpoint and is held out as stale until the refit after it;
* Serve's power-of-two routing (which ignores the call's exclusions on its own) obeys the fleet state the
  gateway writes: a held-out replica gets nothing, a replica the state does not list after a stamp
  refuses, and with every replica held out the answer is the no-healthy status at once.
"""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from launcher.jobdir import JobDir
from tests.support.checkpoints import checkpoint, unloadable
from tests.support.ray_serve import post_json

REFIT_TRAINER = textwrap.dedent(
    """\
    import glob, json, os, subprocess, sys, threading, time, urllib.error, urllib.request
    from pathlib import Path
    from launcher.fleet.client import FleetClient
    job, key = os.environ["RL_JOB_DIR"], os.environ["RL_POLICY_API_KEY"]
    base, model = os.environ["RL_POLICY_BASE_URL"], os.environ["RL_POLICY_MODEL_NAME"]
    ckpt = Path(__file__).parent / "ckpt"
    SETTLE_S = 1.0  # the ingress reads the fleet state at most every 0.5 s
    def chat(tag):
        body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": f"rollout {tag}"}]}
        req = urllib.request.Request(base + "/chat/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": "Bearer " + key})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                r.read()
                return [r.status, r.headers.get("x-rl-weight-version"), r.headers.get("x-rl-launch-replica")]
        except urllib.error.HTTPError as e:
            return [e.code, e.read().decode()[:300], None]
    def burst(n, tag):
        got = [None] * n
        def one(i):
            got[i] = chat(f"{tag}-{i}")
        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        [t.start() for t in threads]
        [t.join(90) for t in threads]
        return got
    def replica_of():  # engine URL -> Serve replica id, from the replicas' own records
        out = {}
        for p in glob.glob(os.path.join(job, "engines", "serve", "*.json")):
            r = json.load(open(p))
            out[r["url"].rstrip("/")] = r["replica"]
        return out
    def healthy(url):
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError as e:
            return repr(e)
    fleet = FleetClient.from_job_dir(job)
    out = {"fleet_url": fleet.url, "before": burst(6, "before")}
    out["checksums_before"] = fleet.checksum().result["groups"]
    engines = sorted(fleet.weight_version().result["engines"])
    out["engines"], out["replica_of"] = engines, replica_of()

    # 1: every engine reloads B, with rollouts in flight across the pause
    during = []
    t = threading.Thread(target=lambda: during.extend(burst(6, "during")))
    t.start()
    out["refit1"] = fleet.load_weights(ckpt / "B", version="step-1")
    t.join(90)
    out["during"] = during
    out["checksums_1"] = fleet.checksum().result["groups"]
    time.sleep(SETTLE_S)
    out["after1"] = burst(9, "after1")

    # 2: one engine gets a broken copy: quarantined, the others move to step-2
    victim = engines[0]
    out["victim"] = victim
    out["refit2"] = fleet.load_weights(ckpt / "C", version="step-2", per_engine={victim: ckpt / "broken"},
                                       check=False)
    deadline = time.time() + 60  # the fleet restores the victim from C's directory by itself (bounded)
    while time.time() < deadline and victim in fleet.stale_engines():
        time.sleep(0.3)
    out["stale_after2"] = fleet.stale_engines()
    time.sleep(SETTLE_S)
    out["after2"] = burst(12, "after2")
    out["checksums_2"] = fleet.checksum().result["groups"]
    time.sleep(2.0)  # a request that reached the victim would have killed its engine by now
    out["victim_health"] = healthy(victim)
    out["replica_of_after2"] = replica_of()

    # 3: the CLI refits the whole fleet, the quarantined engine included
    cli = subprocess.run([str(Path(sys.executable).with_name("rl-launch")), "fleet", "refit", job,
                          "--from", str(ckpt / "D"), "--version", "step-3"],
                         capture_output=True, text=True, timeout=120)
    out["cli"] = [cli.returncode, cli.stdout, cli.stderr[-2000:]]
    time.sleep(SETTLE_S)
    out["after3"] = burst(9, "after3")
    out["versions_3"] = fleet.weight_version().result

    # 4: an engine dies; Serve replaces its replica, whose engine comes back on the checkpoint: held out
    # as stale (the gateway's watcher hands it to the fleet endpoint) until the fleet restores it from
    # the last verified directory (D's, step-3) by itself
    dead = engines[1]
    urllib.request.urlopen(urllib.request.Request(dead + "/sim/fault", data=b'{"mode": "kill"}',
        headers={"Content-Type": "application/json", "Authorization": "Bearer " + key}), timeout=5).read()
    deadline, successor = time.time() + 90, None
    while time.time() < deadline and successor is None:  # bounded
        versions = fleet.weight_version(check=False).result or {}
        for u, v in (versions.get("engines") or {}).items():
            if u not in engines and v == "step-3" and u not in (versions.get("stale") or {}):
                successor = u
        time.sleep(0.3)
    out["successor"] = successor
    time.sleep(SETTLE_S)
    out["successor_replica"] = replica_of().get(successor) if successor else None
    out["after4"] = burst(12, "after4")
    out["refit5"] = fleet.load_weights(ckpt / "B", version="step-5")
    time.sleep(SETTLE_S)
    out["after5"] = burst(9, "after5")
    out["replica_of_5"] = replica_of()
    json.dump(out, open(os.path.join(job, "refit.json"), "w"))
    """
)


def _run_job(tmp_path: Path) -> tuple[Any, Path]:
    from tests.support.jobs import run_job

    ckpt = tmp_path / "ckpt"
    for name, fill in (("B", b"b"), ("C", b"c"), ("D", b"d")):
        checkpoint(ckpt, name, fill)
    unloadable(ckpt, "broken")
    router = {"kind": "ray-serve", "policy": "round_robin", "serve_routing": "policy"}
    return run_job(tmp_path, "refit", trainer_text=REFIT_TRAINER, router=router, name="serve")


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_local_ray_serve_job_refits_quarantines_and_routes_around(tmp_path: Path) -> None:
    t0 = time.monotonic()
    proc, job = _run_job(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads((job / "refit.json").read_text())
    state = JobDir(job).read_state()
    print(f"\nray-serve refit job: {time.monotonic() - t0:.1f} s")

    # the driver serves the refit window beside Serve, and records where
    assert out["fleet_url"] == state["fleet_url"] != state["router_url"]
    engines, replica_of = out["engines"], out["replica_of"]
    assert len(engines) == 3 and set(replica_of) == set(engines)
    assert [s for s, _, _ in out["before"]] == [200] * 6
    assert {v for _, v, _ in out["before"]} == {None}  # nothing stamped yet

    # 1: every engine on B, checksums moved together; responses after it carry step-1
    (before,) = out["checksums_before"]
    (after1,) = out["checksums_1"]
    assert after1 != before and sorted(out["checksums_1"][after1]) == engines
    refit1 = out["refit1"]
    assert refit1["moved"] and refit1["quarantined"] == {} and sorted(refit1["verified"]) == engines
    assert [s for s, _, _ in out["during"]] == [200] * 6
    assert {(s, v) for s, v, _ in out["after1"]} == {(200, "step-1")}
    assert {r for _, _, r in out["after1"]} == set(replica_of.values())  # round robin: all three

    # 2: the victim is quarantined; the others serve step-2; nothing failed; the fleet then restores the
    # victim from C's directory with no trainer call, and it serves step-2 too
    victim = out["victim"]
    refit2 = out["refit2"]
    assert refit2["moved"] and list(refit2["quarantined"]) == [victim], refit2
    assert "reload" in refit2["quarantined"][victim]
    assert sorted(refit2["verified"]) == [e for e in engines if e != victim]
    assert {(s, v) for s, v, _ in out["after2"]} == {(200, "step-2")}, out["after2"]
    served = {r for _, _, r in out["after2"]}
    assert out["stale_after2"] == {}, out["stale_after2"]
    assert served == set(replica_of.values())
    (after2,) = out["checksums_2"]
    assert after2 not in (before, after1) and sorted(out["checksums_2"][after2]) == engines
    # no request reached it while quarantined: its engine still lives, in the same replica
    assert out["victim_health"] == 200
    assert out["replica_of_after2"][victim] == replica_of[victim]

    # 3: the CLI's refit reloads every engine, the quarantined one included, which serves again
    code, stdout, stderr = out["cli"]
    assert code == 0, stdout + stderr
    assert "3 engine(s) on 'step-3', 0 quarantined" in stdout
    assert {(s, v) for s, v, _ in out["after3"]} == {(200, "step-3")}
    assert {r for _, _, r in out["after3"]} == set(replica_of.values())
    assert set(out["versions_3"]["engines"].values()) == {"step-3"}
    assert out["versions_3"]["current"] == "step-3" and out["versions_3"]["stale"] == {}

    # 4: the successor of a killed engine comes back on the checkpoint and is restored to step-3 by the
    # fleet (no trainer call); it then serves step-3 like the rest
    successor = out["successor"]
    assert successor is not None and successor not in engines, out
    successor_replica = out["successor_replica"]
    assert successor_replica is not None and successor_replica not in replica_of.values()
    assert {(s, v) for s, v, _ in out["after4"]} == {(200, "step-3")}, out["after4"]
    assert successor_replica in {r for _, _, r in out["after4"]}
    # 5: the next refit reloads it with the rest, and it serves
    refit5 = out["refit5"]
    assert refit5["moved"] and refit5["quarantined"] == {} and successor in refit5["verified"]
    assert {(s, v) for s, v, _ in out["after5"]} == {(200, "step-5")}
    assert {r for _, _, r in out["after5"]} == set(out["replica_of_5"].values())
    assert successor_replica in out["replica_of_5"].values()

    # what the ingress read: written by the gateway, in fleet_state's shape
    from launcher.gateways.ray_serve.fleet_state import read_fleet_state

    final = read_fleet_state(job)
    assert final is not None and final.version == "step-5"
    assert {r.version for r in final.replicas.values()} == {"step-5"} and final.held_out() == {}
    events = [e["phase"] for e in JobDir(job).read_events()]
    assert "finished" in events and "fleet_refit" in events


# -- Serve's power-of-two routing and the fleet state, without the driver ----------------------------------


def _chat(text: str) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": text}], "max_tokens": 4}


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_power_of_two_routing_obeys_the_fleet_state(tmp_path: Path) -> None:
    from launcher.gateways.ray_serve.bench_arm import local_plan, local_ray, serve_app
    from launcher.gateways.ray_serve.fleet_state import (
        READ_EVERY_S,
        FleetState,
        ReplicaState,
        write_fleet_state,
    )
    from launcher.gateways.ray_serve.gateway import POWER_OF_TWO, engine_replicas
    from router.ports import free_port
    from router.state.versions import VERSION_HEADER

    job_dir = str(tmp_path / "job")
    os.makedirs(job_dir, exist_ok=True)
    plan = local_plan(3, POWER_OF_TWO, {"speed": 20}, job_dir, startup_timeout_s=60)
    with local_ray(), serve_app(plan, free_port("127.0.0.1")) as url:
        replicas = {r["replica"]: r["url"] for r in engine_replicas(job_dir)}
        assert len(replicas) == 3
        a, b, c = sorted(replicas)

        def write(version: str | None, states: dict[str, str | None]) -> None:
            listed = {rid: ReplicaState(replicas[rid], version, why) for rid, why in states.items()}
            write_fleet_state(job_dir, FleetState(version, listed))
            time.sleep(2 * READ_EVERY_S + 0.2)  # the ingress and the replicas read it again

        def served(n: int) -> list[tuple[int, str | None, str | None]]:
            out = []
            for i in range(n):
                status, headers, _ = post_json(url + "/v1/chat/completions", _chat(f"p{i}"))
                out.append((status, headers.get("x-rl-launch-replica"), headers.get(VERSION_HEADER)))
            return out

        # no state yet: every replica serves, no version header
        first = served(12)
        assert {s for s, _, _ in first} == {200} and {v for _, _, v in first} == {None}

        # one replica held out: power of two never picks it, every answer carries the version
        write("v1", {a: "quarantined by refit r1", b: None, c: None})
        got = served(24)
        assert {(s, v) for s, _, v in got} == {(200, "v1")}, got
        assert {r for _, r, _ in got} <= {b, c} and len({r for _, r, _ in got}) == 2

        # after a stamp a replica the state does not list (a replacement) refuses: passed over, no failure
        write("v1", {a: None, b: None})
        got = served(24)
        assert {(s, v) for s, _, v in got} == {(200, "v1")} and {r for _, r, _ in got} <= {a, b}, got

        # every replica held out: the no-healthy status at once, with the reason
        write("v1", {a: "stale: serves 'default'", b: "stale: serves 'default'", c: "quarantined"})
        t = time.monotonic()
        status, _, body = post_json(url + "/v1/chat/completions", _chat("nobody"))
        assert status == 409 and b"held out" in body and b"stale: serves 'default'" in body, body
        assert time.monotonic() - t < 2.0
