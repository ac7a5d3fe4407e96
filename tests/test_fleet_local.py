"""Fleet health end to end in local mode: an engine dies mid-replay, leaves rotation, is restarted in
place on a new port and readmitted, and no session of a Gym-like client (3 retries) is lost."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.ray

TRAINER = textwrap.dedent(
    """\
    import json, os, subprocess, sys, time, urllib.request
    job = os.environ["RL_JOB_DIR"]
    victim = json.load(open(os.path.join(job, "engines", "node-0.urls.json")))["engines"][0]["url"]
    replay = subprocess.Popen(["rl-launch", "bench", "replay", "--url", os.environ["RL_POLICY_BASE_URL"],
                               "--workload", "longtail", "--scale", "0.05", "--seed", "3",
                               "--json", os.path.join(job, "replay.json")])
    time.sleep(3)
    req = urllib.request.Request(victim + "/sim/fault", data=json.dumps({"mode": "kill"}).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": "Bearer " + os.environ["RL_POLICY_API_KEY"]})
    urllib.request.urlopen(req, timeout=5).read()
    json.dump({"victim": victim, "t": time.time()}, open(os.path.join(job, "victim.json"), "w"))
    code = replay.wait()
    deadline = time.time() + 60  # stay up until the restarted engine is readmitted (bounded)
    while time.time() < deadline:
        fleet = json.load(open(os.path.join(job, "state.json"))).get("fleet", {})
        engine = next((e for e in fleet.get("engines", []) if e["id"] == "node0-0"), {})
        if engine.get("state") == "HEALTHY" and engine.get("previous_urls"):
            break
        time.sleep(0.5)
    sys.exit(code)
    """
)


def test_killed_engine_is_restarted_and_readmitted_without_losing_sessions(tmp_path: Path) -> None:
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    spec = {
        "name": "fleet-kill",
        "cluster": "local",
        "job_root": str(tmp_path / "jobs"),
        "training": {"command": f"{sys.executable} {trainer}"},
        "generation": {
            "engine": "sim",
            "engines_per_node": 3,
            "served_model_name": "sim-8b",
            "sim": {"speed": 3},
        },
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    import subprocess

    rl_launch = str(Path(sys.executable).with_name("rl-launch"))
    proc = subprocess.run([rl_launch, "submit", str(path)], capture_output=True, text=True, timeout=400)
    (job,) = list((tmp_path / "jobs").iterdir())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    replay = json.loads((job / "replay.json").read_text())["rows"][0]
    assert replay["errors"] == 0 and replay["sessions_ok"] == replay["sessions"], replay
    victim = json.loads((job / "victim.json").read_text())
    events = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines()]
    fleet = [e for e in events if e["phase"] == "fleet" and e.get("engine_id") == "node0-0"]
    path_taken = [e["to_state"] for e in fleet]
    for state in ("DEAD", "RESTARTING", "RECOVERING", "HEALTHY"):
        assert state in path_taken, path_taken
    back = next(e for e in events if e["phase"] == "engine_restarted")
    assert back["url"] != victim["victim"]  # a new port
    dead_t = next(e["t"] for e in fleet if e["to_state"] == "DEAD")
    healthy_t = next(e["t"] for e in fleet if e["to_state"] == "HEALTHY" and e["t"] > dead_t)
    out_t = next((e["t"] for e in fleet if e["to_state"] == "SUSPECT"), dead_t)
    print(
        f"\nkill -> out of rotation {out_t - victim['t']:.1f}s, -> DEAD {dead_t - victim['t']:.1f}s, "
        f"-> readmitted {healthy_t - victim['t']:.1f}s; sessions lost {replay['errors']}"
    )
