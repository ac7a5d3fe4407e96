"""A job's Ray takes its own token, and keeps its files where only the job's user can enter.

The attack, as the review ran it: a client in a clean environment (any account on the cluster, no
credential) calls ``ray.init`` on the job's head and, connected, finds the ``router`` actor (whose config
holds every secret) and could run tasks as the job's user. With ``RAY_AUTH_MODE=disabled`` it connected;
now it is refused, while the training command, given the token's file by the driver, still attaches.
Ray's session (logs, sockets) lives under a 0700 parent instead of the shared, world-writable
``/tmp/ray``. The attack runs from inside the training command, so it is bounded by the job.
"""

from __future__ import annotations

import json
import os
import stat
import textwrap
from pathlib import Path

import pytest

from tests.support.jobs import run_job

pytestmark = [pytest.mark.ray, pytest.mark.timeout(400)]

ATTACKER = textwrap.dedent(
    """\
    import json, sys
    import ray
    out = {"connected": False}
    try:
        ray.init(address=sys.argv[1], namespace="rl-launch", log_to_driver=False)
        out["connected"] = True
        out["router_actor"] = ray.get_actor("router") is not None
        out["uid"] = ray.get(ray.remote(lambda: __import__("os").getuid()).remote())
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
    print("ATTACK " + json.dumps(out), flush=True)
    """
)

TRAINER = textwrap.dedent(
    """\
    import json, os, socket, subprocess, sys
    from launcher.steps.ray_node import private_temp_dir
    job = os.environ["RL_JOB_DIR"]
    attacker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attacker.py")
    address = os.environ["RAY_ADDRESS"]

    def attack(env):
        env = {**env, "PATH": "/usr/bin:/bin", "HOME": os.path.join(job, "attacker-home"),
               "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # loopback, as every Ray of the tests
        proc = subprocess.run([sys.executable, attacker, address], env=env, capture_output=True,
                              text=True, timeout=120)
        line = [x for x in proc.stdout.splitlines() if x.startswith("ATTACK ")]
        return json.loads(line[-1][7:]) if line else {"connected": None, "stderr": proc.stderr[-500:]}

    report = {
        "stranger": attack({}),
        "with_token": attack({"RAY_AUTH_MODE": "token",
                              "RAY_AUTH_TOKEN_PATH": os.environ["RAY_AUTH_TOKEN_PATH"]}),
        "trainer_env": {k: os.environ.get(k)
                        for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")},
        "temp_dir": str(private_temp_dir(job)),
    }
    json.dump(report, open(os.path.join(job, "ray_auth.json"), "w"))
    """
)


def test_stranger_cannot_attach_to_the_jobs_ray_and_its_files_are_private(tmp_path: Path) -> None:
    attacker = tmp_path / "attacker.py"
    attacker.write_text(ATTACKER)
    proc, job = run_job(tmp_path, "attack", trainer_text=TRAINER, name="rayauth", engines_per_node=1)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((job / "ray_auth.json").read_text())
    assert report["stranger"]["connected"] is False, report["stranger"]
    assert "Failed to connect" in report["stranger"].get("error", ""), report["stranger"]
    # The control: the same client with the job's token file gets in (so the refusal is the token's).
    assert report["with_token"]["connected"] is True and report["with_token"]["router_actor"], report
    token_file = Path(report["trainer_env"]["RAY_AUTH_TOKEN_PATH"])
    assert report["trainer_env"]["RAY_AUTH_MODE"] == "token"
    assert report["trainer_env"]["RAY_AUTH_TOKEN"] is None  # the file's path, never the token itself
    assert token_file == job / "secrets" / "ray_token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    for path in (job / "spec.resolved.yaml", job / "driver.log", job / "state.json", job / "events.jsonl"):
        assert token not in path.read_text(), path
    # Ray's files: under a parent only this user can enter (Ray itself makes its folders 0777).
    temp_dir = Path(report["temp_dir"])
    parent = temp_dir.parent.stat()
    assert parent.st_uid == os.getuid() and stat.S_IMODE(parent.st_mode) == 0o700
    assert any(temp_dir.glob("session_*/logs")), f"no Ray session under {temp_dir}"
    assert len(str(next(temp_dir.glob("session_*")) / "sockets" / "plasma_store")) < 108
