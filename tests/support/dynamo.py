"""Dynamo for the tests that run it: the runtime's presence, the training command of a Dynamo job, and its
generation section.

``have_runtime()`` skips the test, with the reason, without the Dynamo venv (``RL_LAUNCH_DYNAMO_PYTHON``),
etcd, nats-server or ``ss``. ``TRAINER``: replays through the frontend, kills a worker, resets the cache and
records what it saw in ``dynamo_trainer.json`` (the local and the Slurm Dynamo jobs run it). ``mocker``: the
``generation`` section of ``dynamo.mocker`` workers serving the tiny model as ``tiny``.
"""

from __future__ import annotations

import os
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest

TRAINER = textwrap.dedent(
    """\
    import json, os, re, signal, subprocess, sys, time, urllib.request
    job = os.environ["RL_JOB_DIR"]
    url = os.environ["RL_ROUTER_URL"]  # the key-checking front
    # The frontend's own /health (its instance list) is on loopback on this node, as the driver announced.
    events = [json.loads(x) for x in open(os.path.join(job, "events.jsonl"))]
    frontend = next(e["frontend_url"] for e in events if e["phase"] == "gateway_frontend")
    def instances():
        health = json.load(urllib.request.urlopen(frontend + "/health", timeout=2))
        return sorted(str(i["instance_id"]) for i in health["instances"] if i["endpoint"] == "generate")
    def listing():
        return json.load(open(os.path.join(job, "engines", "node-0.urls.json")))["engines"]
    body = json.dumps({"model": os.environ["RL_POLICY_MODEL_NAME"], "prompt": [1, 2, 3, 4], "max_tokens": 4})
    req = urllib.request.Request(url + "/v1/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": "Bearer " + os.environ["RL_POLICY_API_KEY"]})
    first = json.load(urllib.request.urlopen(req, timeout=10))
    reset = subprocess.run(["rl-launch", "fleet", "reset-cache", job, "--json"],
                           capture_output=True, text=True)
    before = instances()
    replay = subprocess.Popen(["rl-launch", "bench", "replay", "--url", os.environ["RL_POLICY_BASE_URL"],
                               "--workload", "longtail", "--scale", "0.05", "--seed", "3",
                               "--retry-attempts", "3", "--json", os.path.join(job, "replay.json")])
    time.sleep(1.5)
    victim = listing()[0]
    if sys.argv[1:] == ["external"]:  # on Slurm the worker is on another node: the test kills it
        json.dump(victim, open(os.path.join(job, "kill_me.json"), "w"))
        killed = os.path.join(job, "killed.json")
        deadline = time.time() + 60
        while not os.path.exists(killed) and time.time() < deadline:
            time.sleep(0.1)
        t_kill = json.load(open(killed))["t"]
    else:
        port = victim["url"].rsplit(":", 1)[1]
        ss = subprocess.run(["ss", "-H", "-tlnp", f"sport = :{port}"], capture_output=True, text=True).stdout
        pid = int(re.search(r"pid=(\\d+)", ss).group(1))
        t_kill = time.time()
        os.killpg(pid, signal.SIGKILL)
    rejoined = None
    deadline = time.time() + 120
    while time.time() < deadline:
        entry = listing()[0]
        try:
            now = instances()
        except OSError:
            now = []
        if entry["generation"] >= 1 and entry["url"] and len(now) == 2 and now != before:
            rejoined = time.time() - t_kill
            break
        time.sleep(0.2)
    code = replay.wait()
    time.sleep(6)  # the controller writes the frontend's view every 5 ticks: let it see the rejoined worker
    json.dump({"reset_rc": reset.returncode, "reset": reset.stdout,
               "first": first, "before": before, "after": instances(), "victim": victim["url"],
               "new_url": listing()[0]["url"], "recovery_s": rejoined},
              open(os.path.join(job, "dynamo_trainer.json"), "w"))
    sys.exit(code)
    """
)


def missing_runtime() -> list[str]:
    """Every part a Dynamo test lacks, each with how to install it (one skip names them all, so that
    installing one does not reveal the next)."""
    missing = []
    if not os.environ.get("RL_LAUNCH_DYNAMO_PYTHON"):
        how = 'export RL_LAUNCH_DYNAMO_PYTHON="$(.ci/install-dynamo.sh)"'
        missing.append(f"RL_LAUNCH_DYNAMO_PYTHON is not set ({how})")
    binaries = [b for b in ("etcd", "nats-server", "ss") if shutil.which(b) is None]
    if binaries:
        how = "apt-get install etcd-server nats-server iproute2"
        missing.append(f"{', '.join(binaries)} not on PATH ({how})")
    return missing


def have_runtime() -> None:
    missing = missing_runtime()
    if missing:
        pytest.skip("; ".join(missing))


def mocker(model: Path, engines_per_node: int, **more: Any) -> dict[str, Any]:
    """A ``generation`` section of ``engines_per_node`` ``dynamo.mocker`` workers of ``model`` (served as
    ``tiny``), then ``more`` as it is (``startup_timeout_s``...)."""
    return {
        "engine": "dynamo-mocker",
        "engines_per_node": engines_per_node,
        "model": str(model),
        "served_model_name": "tiny",
        **more,
    }
