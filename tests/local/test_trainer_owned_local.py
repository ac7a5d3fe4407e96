"""Engines the trainer owns (``generation.owner: trainer``), on a real local job, as a user runs it.

The job starts no engines; the test plays the trainer: it starts two simulated engines as processes of
its own (``python -m launcher.engines.sim``, no key) and a listener that logs every request's
``Authorization``, and registers all three the way NeMo-RL does (``POST {router_url}/workers``, no header).
Then rollouts as Gym sends them (its dummy key under the capability; the job's API key on the main route,
as the Gym overlay does), the owner's ``FleetClient.begin_step`` and cache reset, and ``rl-launch status
--json`` as the user runs it. What must hold:

* ``rl-launch status`` judges the registered engines: all HEALTHY and in the gateway; one SIGKILLed shows
  HELD_OUT (out of the gateway, the reason saying rl-launch does not restart it) while the other serves;
  back on its port, it is HEALTHY and in the gateway again, with no restart of ours;
* no key of the job ever reached a registered URL: not on a rollout, a fan-out or a status scrape.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.fleet.client import FleetClient
from launcher.jobdir import JobDir
from router.ports import free_port
from tests.support.running_job import wait_for
from tests.support.trainer_owned import TrainerProcess, call, trainer_owned_job

pytestmark = pytest.mark.ray

CAPTURE = r"""
import json, sys
from aiohttp import web

log = open(sys.argv[2], "a", buffering=1)

async def handle(request):
    await request.read()
    log.write(json.dumps([request.method, request.path, request.headers.get("Authorization")]) + "\n")
    if request.path == "/metrics":
        return web.Response(text="vllm:prompt_tokens_total 3\nvllm:generation_tokens_total 4\n")
    if request.path == "/v1/completions":
        return web.json_response({"id": "capture", "choices": [{"text": "ok", "index": 0}]})
    return web.json_response({})

app = web.Application()
app.router.add_route("*", "/{tail:.*}", handle)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


class Process(TrainerProcess):
    """One process of the trainer's (an engine or the capture listener) on a fixed port, without the
    job's key in its environment."""

    def environment(self) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if not k.startswith("RL_LAUNCH_API_KEY")}


def sim_engine(tmp_path: Path, i: int) -> Process:
    port = free_port("127.0.0.1")
    argv = [sys.executable, "-m", "launcher.engines.sim", "--host", "127.0.0.1", "--port", str(port)]
    return Process([*argv, "--model-name", "sim", "--speed", "50"], tmp_path / f"sim{i}.log", port)


@pytest.fixture
def trainer_processes(tmp_path: Path) -> Iterator[tuple[list[Process], Process, Path]]:
    engines = [sim_engine(tmp_path, i).start() for i in range(2)]
    seen = tmp_path / "capture.jsonl"
    port = free_port("127.0.0.1")
    capture = Process([sys.executable, "-c", CAPTURE, str(port), str(seen)], tmp_path / "capture.log", port)
    capture.start()
    try:
        yield engines, capture, seen
    finally:
        for p in (*engines, capture):
            p.kill()


def test_status_judges_registered_engines_and_no_key_reaches_them(
    trainer_processes: tuple[list[Process], Process, Path], tmp_path: Path
) -> None:
    engines, capture, seen = trainer_processes
    with trainer_owned_job(tmp_path, "trainer-owned", "sim", within_s=180) as run:
        router_url = run.router_url
        jd = JobDir(run.job)
        base = jd.read_state()["router_url"]
        wait_for(lambda: all(p.ready() for p in (*engines, capture)), 60, "the trainer's engines")
        for p in (*engines, capture):
            status, body = call("POST", f"{router_url}/workers", {"url": p.url})
            assert status == 200 and body["success"] is True, body

        # Rollouts as Gym sends them, and the owner's fleet calls.
        prompt = {"model": "sim", "prompt": "hello", "max_tokens": 4}
        for _ in range(3):
            assert call("POST", f"{router_url}/v1/completions", prompt, key="EMPTY")[0] == 200
            assert call("POST", f"{base}/v1/completions", prompt, key=jd.read_api_key())[0] == 200
        fleet = FleetClient(base, jd.read_admin_token(), timeout_s=30)
        assert fleet.begin_step() == 1
        assert call("POST", f"{base}/fleet/reset_prefix_cache", key=jd.read_admin_token())[0] == 200

        def dashboard() -> dict[str, dict[str, Any]]:
            return {e["url"]: e for e in run.status()["engines"]}

        urls = [engines[0].url, engines[1].url, capture.url]

        last: list[Any] = []

        def rows_are(*wanted: tuple[str, bool]) -> dict[str, dict[str, Any]] | None:
            rows = dashboard()
            got = [(rows[u]["state"], rows[u].get("in_gateway")) for u in urls if u in rows]
            last[:] = [got, rows]
            return rows if got == list(wanted) else None

        healthy = ("HEALTHY", True)
        try:
            wait_for(lambda: rows_are(healthy, healthy, healthy), 30, "every registered engine HEALTHY")
        except AssertionError:
            raise AssertionError(f"the dashboard's rows: {last}") from None

        # One engine SIGKILLed: the router holds it out, and the dashboard says so (not "HEALTHY?").
        engines[1].kill()
        rows = wait_for(lambda: rows_are(healthy, ("HELD_OUT", False), healthy), 30, "the held-out row")
        print(f"\nthe killed engine's row: {rows[engines[1].url]}")
        assert "does not restart" in rows[engines[1].url]["last_reason"]
        for _ in range(4):
            assert call("POST", f"{router_url}/v1/completions", prompt, key="EMPTY")[0] == 200
        # Back on its port: readmitted by the router's probes, and HEALTHY on the dashboard again.
        engines[1].start()
        wait_for(engines[1].ready, 60, "the restarted engine")
        wait_for(lambda: rows_are(healthy, healthy, healthy), 30, "the readmitted engine")
        events = [str(e.get("phase") or e.get("kind")) for e in jd.read_events()]
        assert not any("restart" in e for e in events), events

        # No key of the job reached the registered listener: rollouts, fan-outs, status scrapes.
        logged = [json.loads(line) for line in seen.read_text().splitlines()]
        print(f"the registered listener saw: {sorted({tuple(x) for x in logged}, key=str)}")
        assert {("POST", "/v1/completions"), ("GET", "/metrics"), ("POST", "/reset_prefix_cache")} <= {
            (m, p) for m, p, _ in logged
        }
        assert [x for x in logged if x[2] is not None] == []
