"""The router's port stays the job's: no other user can bind it, not even while the router restarts.

The attack: another user of the node (here uid 65534, so these tests need root, as CI runs) binds the
router's port the moment the router's Ray actor dies, before Ray restarts it. The restarted router then
cannot bind, and Gym's next requests, each with the job's API key in ``Authorization``, go to the
stranger. The driver now holds the port with a placeholder socket (``router.ports.PortHold``)
that the router binds beside (``SO_REUSEPORT``, same user only).
"""

from __future__ import annotations

import json
import os
import socket
import textwrap
from pathlib import Path

import pytest

from router.http.app import bind_listening_socket
from router.ports import PortHold
from tests.support.jobs import run_job
from tests.support.port_stranger import stranger


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run the attack as another user (CI runs as root)")


def test_no_other_user_binds_a_held_port_and_the_router_binds_beside_it() -> None:
    _need_root()
    hold = PortHold.reserve("127.0.0.1", (21000, 21999))
    try:
        out = json.loads(stranger("127.0.0.1", hold.port, 1.0).communicate(timeout=30)[0])
        assert out["bound"] is None and out["attempts"] > 10, out
        router = bind_listening_socket("127.0.0.1", hold.port, reuse_port=True)
        client = socket.create_connection(("127.0.0.1", hold.port), timeout=5)
        accepted, _ = router.accept()  # the placeholder never listens: the router gets the connection
        for s in (client, accepted, router):
            s.close()
        # The router is gone (as when its actor dies): still nobody else gets the port.
        out = json.loads(stranger("127.0.0.1", hold.port, 1.0).communicate(timeout=30)[0])
        assert out["bound"] is None, out
    finally:
        hold.release()
    # Released, the port is anyone's again (so the stranger above was refused by the hold alone).
    out = json.loads(stranger("127.0.0.1", hold.port, 1.0).communicate(timeout=30)[0])
    assert out["bound"] == "127.0.0.1", out


TRAINER = textwrap.dedent(
    """\
    import json, os, subprocess, sys, time, urllib.request
    import ray
    sys.path.insert(0, TESTS_DIR)
    from port_stranger import stranger
    job, url = os.environ["RL_JOB_DIR"], os.environ["RL_ROUTER_URL"]
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    ray.init(address=os.environ["RAY_ADDRESS"], namespace="rl-launch", log_to_driver=False)
    attacker = stranger(host, int(port), 8.0)
    time.sleep(0.5)
    t = time.time()
    ray.kill(ray.get_actor("router"), no_restart=False)
    body = json.dumps({"model": "sim-8b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    answered = None
    while time.time() - t < 30:  # Gym, retrying through the restart (bounded)
        req = urllib.request.Request(url + "/v1/chat/completions", data=body.encode(), headers={
            "Content-Type": "application/json", "Authorization": "Bearer " + os.environ["RL_POLICY_API_KEY"]})
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                answered = resp.status
                break
        except Exception:
            time.sleep(0.05)
    report = {"stranger": json.loads(attacker.communicate(timeout=60)[0]), "answered": answered,
              "back_s": time.time() - t}
    json.dump(report, open(os.path.join(job, "port_hold.json"), "w"))
    """
)


@pytest.mark.ray
@pytest.mark.timeout(400)
def test_router_restart_leaves_its_port_to_no_one_else(tmp_path: Path) -> None:
    _need_root()
    tests_dir = Path(__file__).resolve().parents[1] / "support"  # where port_stranger.py lives
    trainer = TRAINER.replace("TESTS_DIR", repr(str(tests_dir)))
    proc, job = run_job(tmp_path, "hold", trainer_text=trainer, name="porthold", engines_per_node=1)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((job / "port_hold.json").read_text())
    assert report["stranger"]["bound"] is None, report
    assert report["stranger"]["attempts"] > 10, report
    assert report["answered"] == 200, report  # the restarted router is back on the same URL
