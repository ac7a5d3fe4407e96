"""The trainer of a job attached to a standing fleet (``generation: {fleet: NAME}``), locally and on Slurm,
and the two checks both tests make once a trainer holding the fleet's pause is gone: the fleet resumed on its
own (``fleet_resumed``), and the gone trainer's key no longer opens the router (``key_revoked``)."""

from __future__ import annotations

import json
import textwrap
import urllib.error
import urllib.request
from collections.abc import Callable

# The trainer of an attached job. Modes:
#   hold: replay a little, then open a refit (its pause) and sleep inside it until killed;
#   refit: refit at once (the fleet's versions in the client), then replay and finish;
#   load SECONDS CONCURRENCY: closed-loop completions for SECONDS with CONCURRENCY, timestamps to a file;
#   pause: try to pause the fleet with the job's own key (a plain consumer), record the status.
TRAINER = textwrap.dedent(
    """\
    import json, os, subprocess, sys, threading, time, urllib.error, urllib.request
    mode, job = sys.argv[1], os.environ["RL_JOB_DIR"]
    base, key = os.environ["RL_POLICY_BASE_URL"], os.environ["RL_POLICY_API_KEY"]
    model = os.environ["RL_POLICY_MODEL_NAME"]
    def out(name, data):
        json.dump(data, open(os.path.join(job, name), "w"))
    def complete(prompt, max_tokens=8):
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens}).encode()
        req = urllib.request.Request(base + "/completions", data=body, headers={
            "Content-Type": "application/json", "Authorization": "Bearer " + key})
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers)
    if mode in ("hold", "refit"):
        from launcher.fleet.client import FleetClient
        fleet = FleetClient.from_job_dir(job)
    if mode == "refit":  # a resubmitted trainer refits first: what a killed one left unverified is held out
        current = fleet.weight_version().result
        with fleet.refit(version="v2", source="external", lease_s=10, deadline_s=60):
            pass
        out("refit.json", {"before": current, "t": time.time()})
    status, headers = complete("first rollout")
    out("first.json", {"t": time.time(), "status": status, "version": headers.get("x-rl-weight-version")})
    if mode == "hold":
        subprocess.run(["rl-launch", "bench", "replay", "--url", base, "--workload", "longtail", "--scale",
                        "0.03", "--seed", "5", "--json", os.path.join(job, "replay.json")], check=True)
        with fleet.refit(version="held-v1", source="external", lease_s=4, deadline_s=600):
            out("holding.json", {"t": time.time()})
            time.sleep(600)  # killed here, holding the fleet's pause
    elif mode == "refit":
        subprocess.run(["rl-launch", "bench", "replay", "--url", base, "--workload", "longtail", "--scale",
                        "0.03", "--seed", "6", "--json", os.path.join(job, "replay.json")], check=True)
    elif mode == "load":
        seconds, concurrency = float(sys.argv[2]), int(sys.argv[3])
        done, lock, stop = [], threading.Lock(), time.time() + seconds
        def loop():
            while time.time() < stop:
                complete("load", 16)
                with lock:
                    done.append(time.time())
        threads = [threading.Thread(target=loop) for _ in range(concurrency)]
        for t in threads: t.start()
        for t in threads: t.join(120)
        out("completions.json", done)
    elif mode == "pause":
        req = urllib.request.Request(os.environ["RL_ROUTER_URL"] + "/fleet/pause", data=b"{}", method="POST",
                                     headers={"Authorization": "Bearer " + key})
        try:
            urllib.request.urlopen(req, timeout=10)
            out("pause.json", {"status": 200})
        except urllib.error.HTTPError as e:
            out("pause.json", {"status": e.code, "body": e.read().decode()[:300]})
    """
)


def fleet_resumed(fleet_url: str, admin: dict[str, str]) -> Callable[[], bool]:
    """A check to poll: the standing fleet's router and every engine are unpaused (its ``/fleet/is_paused``
    at ``fleet_url``, asked with the ``admin`` token's headers)."""

    def resumed() -> bool:
        req = urllib.request.Request(fleet_url + "/fleet/is_paused", headers=admin)
        body = json.loads(urllib.request.urlopen(req, timeout=5).read())["result"]
        return not body["router_paused"] and not any(body["engines_paused"].values())

    return resumed


def key_revoked(router_url: str, key: str) -> Callable[[], bool]:
    """A check to poll: the fleet's router at ``router_url`` answers ``key`` with 401."""

    def revoked() -> bool:
        req = urllib.request.Request(router_url + "/v1/models", headers={"Authorization": "Bearer " + key})
        try:
            urllib.request.urlopen(req, timeout=5)
        except urllib.error.HTTPError as exc:
            return exc.code == 401
        return False

    return revoked
