"""Engines the trainer owns (``generation.owner: trainer``): NeMo-RL's external-router flow against a job.

The job starts no engines; the test starts 2 real vLLM CPU engines itself, as NeMo-RL's vLLM workers are
started (its own processes, no key), and performs exactly NeMo-RL's registration, in a few lines of urllib
and no rl-launch client: for each replica ``POST {router_url without /v1}/workers {"url": <replica>}`` with
no Authorization header (blocking until the router has probed it), then rollouts under
``router_url + "/v1"`` with Gym's dummy key. The router URL is what the job hands its training command in
``$RL_ROUTER_REGISTRATION_URL``, read from inside the job the way a trainer reads it.

What must hold: registered engines serve through the router (both of them, round-robin); one killed is
held out (the rest keep serving) and readmitted when it returns on its port, with no rl-launch restart of
it; the dashboard (``rl-launch status --json``) shows each as the router judges it (HELD_OUT while held
out, HEALTHY again once readmitted), and the request record shows the rollouts; a registration without
the job's capability is refused and never reaches an engine; and after ``rl-launch cancel`` nothing of the
job is left (the engines are the trainer's: the test stops them itself).
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.engines.vllm.worker_ext import EXTENSION_CLS, WORKER_EXT_DIR
from launcher.jobdir import JobDir
from launcher.jobdir.paths import record_dir
from router.ports import free_port
from tests.support.running_job import wait_for
from tests.support.trainer_owned import TrainerProcess, trainer_owned_job
from tests.support.trainer_owned import call as trainer_call

pytestmark = [pytest.mark.vllm, pytest.mark.ray]

STARTUP_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 300


class Replica(TrainerProcess):
    """One vLLM server as NeMo-RL starts its own: ``vllm.entrypoints.openai.api_server``, no key."""

    def __init__(self, python: str, model: Path, log: Path) -> None:
        port = free_port("127.0.0.1")
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        argv += ["--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--max-model-len", "512", "--enforce-eager", "--worker-extension-cls", EXTENSION_CLS]
        super().__init__(argv, log, port, what="vLLM")

    def environment(self) -> dict[str, str]:
        env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        env.pop("VLLM_API_KEY", None)
        # As docs/trainer-owned.md advises for CPU engines: rl-launch's worker extension, which also asks
        # Linux for the AMX tile state (a stock vLLM 0.32 CPU worker on an AMX CPU dies with SIGILL on
        # its first short prompt: launcher/engines/vllm/worker_ext/rl_launch_amx.py).
        env["PYTHONPATH"] = os.pathsep.join(p for p in (WORKER_EXT_DIR, env.get("PYTHONPATH", "")) if p)
        return env


def call(method: str, url: str, body: Any = None, key: str | None = None) -> tuple[int, dict[str, Any]]:
    """``trainer_owned.call`` with the time a CPU engine may take to answer a rollout."""
    return trainer_call(method, url, body, key, timeout=REQUEST_TIMEOUT_S)


def workers(router_url: str) -> dict[str, bool]:
    _, body = call("GET", f"{router_url}/workers")
    return {w["url"]: w["healthy"] for w in body["workers"]}


@pytest.fixture
def replicas(vllm_python: str, tiny_model_dir: Path, tmp_path: Path) -> Iterator[list[Replica]]:
    engines = [Replica(vllm_python, tiny_model_dir, tmp_path / f"replica{i}.log") for i in range(2)]
    try:
        for e in engines:
            e.start()
        yield engines
    finally:
        for e in engines:
            e.kill()


def test_trainer_registers_its_engines_with_the_capability_url(
    replicas: list[Replica], tmp_path: Path
) -> None:
    # NeMo-RL's run script, played by the job's training command, is handed the registration URL.
    with trainer_owned_job(tmp_path, "nemo-rl-owned", "vllm", within_s=120) as run:
        job, router_url = run.job, run.router_url
        state = JobDir(job).read_state()
        assert (
            router_url.startswith(state["router_url"] + "/t/")
            and len(router_url) > len(state["router_url"]) + 40
        )
        assert not any(
            p.name.startswith("engine") for p in (job / "logs").iterdir()
        )  # rl-launch started none

        wait_for(lambda: all(r.ready() for r in replicas), STARTUP_TIMEOUT_S, "the trainer's vLLM engines")

        # A registration without the job's capability: refused, and nothing reaches the engine.
        stranger = f"{state['router_url']}/t/{'x' * 43}"
        for url in (f"{state['router_url']}/workers", f"{stranger}/workers"):
            status, body = call("POST", url, {"url": replicas[0].url})
            assert status == 401, (url, status, body)
        status, _ = call("POST", f"{stranger}/v1/completions", {"model": "tiny", "prompt": "hi"}, key="EMPTY")
        assert status == 401
        assert workers(router_url) == {}

        # NeMo-RL's flow: each replica registered without a header, then Gym's base URL.
        for r in replicas:
            status, body = call("POST", f"{router_url}/workers", {"url": r.url})
            assert status == 200 and body["success"] is True, body
        assert workers(router_url) == {r.url: True for r in replicas}
        policy_base_url = router_url + "/v1"

        def complete(n: int = 4) -> set[str]:
            served = set()
            for i in range(n):
                body = {"model": "tiny", "prompt": f"hello {i}", "max_tokens": 4, "temperature": 0}
                status, answer = call("POST", f"{policy_base_url}/completions", body, key="EMPTY")
                assert status == 200, answer
                served.add(answer["id"])
            return served

        complete()
        # Both engines served (round-robin): each replica's own /metrics counts requests it answered.
        for r in replicas:
            metrics = urllib.request.urlopen(f"{r.url}/metrics", timeout=5).read().decode()
            done = [ln for ln in metrics.splitlines() if ln.startswith("vllm:request_success_total")]
            assert sum(float(ln.rsplit(" ", 1)[1]) for ln in done) >= 1, (r.url, done)

        # The dashboard shows the registered engines: the router's view (members, how many healthy) and
        # one row per engine, scraped from the engine itself.
        states: dict[str, str] = {}

        def dashboard() -> tuple[int, int, set[str]]:
            snap = run.status()
            gateway = snap.get("gateway") or {}
            states.update({e["url"]: e["state"] for e in snap["engines"]})
            rows = {e["url"] for e in snap["engines"] if e.get("in_gateway")}
            return gateway.get("members", 0), gateway.get("healthy", 0), rows

        urls = {r.url for r in replicas}
        wait_for(lambda: dashboard() == (2, 2, urls), 30, "the dashboard's engines")

        # One killed: held out, the other serves on; back on its port: readmitted, no rl-launch restart.
        replicas[1].kill()
        wait_for(
            lambda: workers(router_url) == {replicas[0].url: True, replicas[1].url: False}, 60, "hold-out"
        )
        complete()
        # Judged on the dashboard as the router judges it: held out, out of rotation, not "HEALTHY?".
        held_out = (2, 1, {replicas[0].url})
        wait_for(lambda: dashboard() == held_out, 30, "the dashboard's held-out engine")
        assert states == {replicas[0].url: "HEALTHY", replicas[1].url: "HELD_OUT"}, states
        replicas[1].start()
        wait_for(replicas[1].ready, STARTUP_TIMEOUT_S, "the restarted replica")
        wait_for(lambda: workers(router_url) == {r.url: True for r in replicas}, 60, "readmission")
        complete()
        wait_for(lambda: dashboard() == (2, 2, urls), 30, "the dashboard's readmitted engine")
        assert set(states.values()) == {"HEALTHY"}, states
        events = [e.get("phase") or e.get("kind") for e in JobDir(job).read_events()]
        assert not any("restart" in str(e) for e in events), events

        # The request record holds the rollouts, and never the capability.
        def recorded() -> list[Path]:
            return [p for p in record_dir(job).rglob("*") if p.is_file() and p.stat().st_size]

        records = wait_for(recorded, 30, "the request record")
        capability = router_url.rsplit("/", 1)[1]
        for p in [*records, job / "driver.log", job / "events.jsonl", job / "state.json", run.spec_path]:
            assert capability.encode() not in p.read_bytes(), p
    # Cancelled by the user's rl-launch cancel, and nothing of the job left (trainer_owned_job).
    assert JobDir(job).read_result().outcome == "cancelled"
    # The trainer's engines are the trainer's: the job's end leaves them to it, untouched.
    assert all(r.ready() for r in replicas)
