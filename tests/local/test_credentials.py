"""Credentials with one use each (issue 28: findings 1, 3 and the revocation half of 8).

* An admin consumer's client key (its Gym overlay's, ``RL_POLICY_API_KEY``) opens no admin route; its
  admin key (the job's own ``secrets/admin_token``) opens the refit routes but neither ``/workers`` nor a
  generation route.
* The engines take a key of their own (``secrets/engine_key``): no consumer key nor the owner's client key
  opens an engine directly.
* ``POST /workers`` on a router whose serving set is its fleet controller's is refused without a probe:
  a stranger's URL never sees a request, let alone the engine key.
* Revoking a consumer ends what its key held: the refit transaction it began, the plain pause it made,
  and its requests held meanwhile (401 when dispatched).

Real routers on 127.0.0.1 (OS-chosen ports) in front of the simulated engines, one process and two worker
processes; one real local standing fleet (Ray, ``rl-launch fleet up`` / ``submit``) for the launcher's
wiring. Every wait is bounded in time; files are written under ``tmp_path`` only.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from router import GenerationRouter
from router.consumers import (
    ConsumerKeys,
    add_admin_key,
    add_consumer,
    new_key,
    read_consumers,
    remove_consumer,
)
from tests.support.http_backends import WORKER_MODES, mode_id, router_factory
from tests.support.recording_server import RecordingServer
from tests.support.specs import local_spec, sim, trainer_command, write_spec

OWNER_KEY = "owner-key-" + "o" * 20
ADMIN_TOKEN = "admin-token-" + "a" * 20
ENGINE_KEY = "engine-key-" + "e" * 20
COMPLETIONS = "/v1/completions"


# -- the consumers file -------------------------------------------------------------------------------------
def test_an_admin_key_is_its_own_entry_and_goes_with_its_account(tmp_path: Path) -> None:
    path = tmp_path / "consumers.json"
    client, admin = new_key(), new_key()
    add_consumer(path, "job-1", client, weight=2, job="/jobs/job-1")
    add_admin_key(path, "job-1", admin, job="/jobs/job-1", weight=2)
    table = read_consumers(path)
    assert set(table) == {"job-1", "job-1.admin"}
    assert not table["job-1"].admin and not table["job-1"].is_admin_key
    assert table["job-1.admin"].admin and table["job-1.admin"].account == "job-1"
    keys = ConsumerKeys(path)
    assert set(keys.accounts()) == {"job-1"} and keys.accounts()["job-1"].admin  # the job "may refit"
    with pytest.raises(ValueError, match="admin keys"):
        add_consumer(path, "other.admin", new_key())
    assert remove_consumer(path, "job-1")  # revoking the account revokes its admin key too
    assert read_consumers(path) == {}


# -- through the router -------------------------------------------------------------------------------------
@pytest.fixture(params=WORKER_MODES, ids=mode_id)
def routers(request: pytest.FixtureRequest) -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(
        policy="round_robin",
        probe_interval_s=0,
        api_key=OWNER_KEY,
        admin_token=ADMIN_TOKEN,
        backend_api_key=ENGINE_KEY,
        workers=int(request.param),
    ) as make:
        yield make


@pytest.fixture
async def engines(sims) -> list[Any]:  # type: ignore[no-untyped-def]
    """Two simulated engines that take the engine key only, as a job's engines do."""
    return await sims(2, api_key=ENGINE_KEY)  # type: ignore[no-any-return]


async def call(
    base: str, method: str, path: str, key: str | None, body: Any = None, timeout_s: float = 30
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as s:
        async with s.request(method, base + path, json=body, headers=headers) as r:
            raw = await r.read()
            return r.status, (orjson.loads(raw) if raw[:1] in (b"{", b"[") else raw)


def completion(max_tokens: int = 4) -> dict[str, Any]:
    return {"model": "sim", "prompt": "hello fleet", "max_tokens": max_tokens}


async def until(check: Callable[[], Awaitable[bool]], what: str, within_s: float = 10.0) -> float:
    t0 = time.monotonic()
    while not await check():
        assert time.monotonic() - t0 < within_s, f"not within {within_s:g} s: {what}"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


def consumers(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A consumers file with an admin consumer ``ops`` (client and admin key) and a plain ``plain``."""
    path = tmp_path / "consumers.json"
    keys = {"ops": new_key(), "ops.admin": new_key(), "plain": new_key()}
    add_consumer(path, "ops", keys["ops"])
    add_admin_key(path, "ops", keys["ops.admin"])
    add_consumer(path, "plain", keys["plain"])
    return path, keys


async def test_each_key_opens_only_its_own_routes(engines, routers, tmp_path: Path) -> None:
    path, keys = consumers(tmp_path)
    base = routers([e.url + "/v1" for e in engines], consumers_file=str(path)).base_url()
    client, admin = keys["ops"], keys["ops.admin"]

    # The client key generates, and opens no admin route.
    assert (await call(base, "POST", COMPLETIONS, client, completion()))[0] == 200
    for method, route in (("POST", "/fleet/pause"), ("GET", "/workers"), ("POST", "/workers")):
        status, body = await call(base, method, route, client, {"url": "http://127.0.0.1:9"})
        assert status == 403, (route, body)
    # The admin key opens the refit routes, but neither /workers nor generation.
    status, body = await call(base, "GET", "/fleet/refit", admin)
    assert status == 200 and body["active"] is None, body
    for method, route in (("GET", "/workers"), ("POST", "/workers")):
        status, body = await call(base, method, route, admin, {"url": "http://127.0.0.1:9"})
        assert status == 403 and "owner's alone" in body["error"]["message"], body
    status, body = await call(base, "POST", COMPLETIONS, admin, completion())
    assert status == 403 and "admin key" in body["error"]["message"] and admin not in str(body), body
    # The owner's admin token keeps /workers; the owner's client key is a router credential only.
    assert (await call(base, "GET", "/workers", ADMIN_TOKEN))[0] == 200
    assert (await call(base, "GET", "/workers", OWNER_KEY))[0] == 401
    # No client key opens an engine: the router presents the engine key in place of the client's.
    for key in (OWNER_KEY, client, admin):
        status, _ = await call(engines[0].url, "POST", COMPLETIONS, key, completion())
        assert status == 401
    assert (await call(engines[0].url, "POST", COMPLETIONS, ENGINE_KEY, completion()))[0] == 200


async def test_workers_of_a_health_managed_router_never_reach_a_stranger(
    engines, routers, tmp_path: Path
) -> None:
    path, keys = consumers(tmp_path)
    stranger = await RecordingServer({"/health": (200, "ok", {})}).start()
    try:
        r = routers([e.url + "/v1" for e in engines], consumers_file=str(path), health_managed=True)
        base = r.base_url()
        for key in (ADMIN_TOKEN, keys["ops.admin"]):
            status, body = await call(base, "POST", "/workers", key, {"url": stranger.url})
            assert status == 403, body
        status, body = await call(base, "POST", "/workers", ADMIN_TOKEN, {"url": stranger.url})
        assert body["code"] == "ADD_WORKER_FAILED" and "fleet controller" in body["message"], body
        status, listed = await call(base, "GET", "/workers", ADMIN_TOKEN)
        assert stranger.url not in listed["urls"] and len(listed["urls"]) == 2, listed
        # Fan-outs reach the fleet's own engines only.
        for route in ("/fleet/pause", "/fleet/resume", "/fleet/reset_prefix_cache"):
            status, body = await call(base, "POST", route, ADMIN_TOKEN)
            assert status == 200, (route, body)
        assert stranger.seen == [] and stranger.authorizations() == []
    finally:
        await stranger.stop()


async def fleet_state(base: str) -> tuple[dict[str, Any], bool]:
    """(``GET /fleet/refit``, whether the router holds requests now), read with the owner's token."""
    status, refit = await call(base, "GET", "/fleet/refit", ADMIN_TOKEN)
    assert status == 200, refit
    status, paused = await call(base, "GET", "/fleet/is_paused", ADMIN_TOKEN)
    assert status == 200, paused
    return refit, paused["result"]["router_paused"]


async def test_revoking_the_holder_of_a_transaction_ends_it(engines, routers, tmp_path: Path) -> None:
    path, keys = consumers(tmp_path)
    base = routers([e.url + "/v1" for e in engines], consumers_file=str(path)).base_url()
    # source directory, nothing loaded yet: no engine touched, so all of them resume on the old version
    begin = {"version": "held-forever", "source": "directory", "lease_s": 120, "deadline_s": 600}
    status, txn = await call(base, "POST", "/fleet/refit/begin", keys["ops.admin"], begin)
    assert status == 200 and txn["phase"] == "paused" and txn["holder"] == "ops.admin", txn
    assert (await fleet_state(base))[1] is True
    t0 = time.monotonic()
    assert remove_consumer(path, "ops")  # the job ended: the fleet's driver revokes its keys

    async def ended() -> bool:
        refit, paused = await fleet_state(base)
        return refit["active"] is None and not paused

    took = await until(ended, "the revoked holder's transaction to end", within_s=10)
    refit, _ = await fleet_state(base)
    last = refit["last"]
    print(f"\nrevoked holder's refit (lease 120 s) aborted {time.monotonic() - t0:.2f} s after revocation")
    assert last["phase"] == "aborted" and "revoked" in last["error"] and refit["current"] is None, last
    assert took < 5
    assert (await call(base, "POST", COMPLETIONS, keys["plain"], completion()))[0] == 200  # serving again


async def test_revoking_the_holder_of_a_pause_resumes_and_refuses_its_held_requests(
    engines, routers, tmp_path: Path
) -> None:
    path, keys = consumers(tmp_path)
    base = routers([e.url + "/v1" for e in engines], consumers_file=str(path)).base_url()

    # A plain pause by the admin consumer, then its keys are revoked: the fleet resumes by itself.
    status, body = await call(base, "POST", "/fleet/pause?mode=keep", keys["ops.admin"])
    assert status == 200 and body["ok"], body
    assert remove_consumer(path, "ops")

    async def resumed() -> bool:
        return not (await fleet_state(base))[1]

    await until(resumed, "the revoked holder's pause to end", within_s=10)

    # Held requests of a consumer revoked while they wait are refused when dispatched, not served.
    late = new_key()
    add_consumer(path, "late", late)

    async def late_registered() -> bool:
        return (await call(base, "POST", COMPLETIONS, late, completion()))[0] == 200

    await until(late_registered, "the new consumer's key to be read")  # within 0.5 s, in every process
    await asyncio.sleep(0.6)  # the other worker process too
    assert (await call(base, "POST", "/fleet/pause?mode=keep", ADMIN_TOKEN))[0] == 200
    held = [
        asyncio.ensure_future(call(base, "POST", COMPLETIONS, k, completion())) for k in (late, keys["plain"])
    ]

    async def both_held() -> bool:
        status, body = await call(base, "GET", "/fleet/is_paused", ADMIN_TOKEN)
        return status == 200 and body["result"]["held"] >= 2

    await until(both_held, "both requests to be held")
    assert remove_consumer(path, "late")
    await asyncio.sleep(1.2)  # every process re-reads the file within 0.5 s of a change
    assert (await call(base, "POST", "/fleet/resume", ADMIN_TOKEN))[0] == 200
    (late_status, late_body), (plain_status, _) = await asyncio.wait_for(asyncio.gather(*held), 30)
    assert late_status == 401 and "revoked" in late_body["error"]["message"], late_body
    assert plain_status == 200


# -- a real standing fleet -----------------------------------------------------------------------------------
# The attached job's training command: what each of its keys opens, from inside the job, then a refit
# transaction held with a long lease until the job is cancelled.
PROBE = textwrap.dedent(
    """\
    import json, os, time, urllib.error, urllib.request, yaml
    from launcher.fleet.client import FleetClient
    job = os.environ["RL_JOB_DIR"]
    overlay = yaml.safe_load(open(os.path.join(job, "gym_overlay.yaml")))
    client = open(os.path.join(job, "secrets", "api_key")).read().strip()
    admin = open(os.path.join(job, "secrets", "admin_token")).read().strip()
    base = os.environ["RL_ROUTER_URL"]
    def status(method, path, key, body=None):
        data = json.dumps(body).encode() if body is not None else (b"{}" if method == "POST" else None)
        req = urllib.request.Request(base + path, data=data, method=method, headers={
            "Content-Type": "application/json", "Authorization": "Bearer " + key})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status
        except urllib.error.HTTPError as e:
            return e.code
    gen = {"model": os.environ["RL_POLICY_MODEL_NAME"], "prompt": "x", "max_tokens": 2}
    stranger = {"url": "http://127.0.0.1:9"}
    out = {
        "overlay_is_client_key": overlay["policy_api_key"] == client == os.environ["RL_POLICY_API_KEY"],
        "admin_in_env": any(admin in v for v in os.environ.values()),
        "client": {"generate": status("POST", "/v1/completions", client, gen),
                   "pause": status("POST", "/fleet/pause", client),
                   "get_workers": status("GET", "/workers", client),
                   "post_workers": status("POST", "/workers", client, stranger)},
        "admin": {"generate": status("POST", "/v1/completions", admin, gen),
                  "refit_state": status("GET", "/fleet/refit", admin),
                  "post_workers": status("POST", "/workers", admin, stranger)},
    }
    json.dump(out, open(os.path.join(job, "probe.json"), "w"))
    fleet = FleetClient.from_job_dir(job)
    with fleet.refit(version="held-v1", source="external", lease_s=120, deadline_s=600):
        json.dump({"t": time.time()}, open(os.path.join(job, "holding.json"), "w"))
        time.sleep(600)  # the job is cancelled here, holding the fleet's pause
    """
)


def _rl_launch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    rl = str(Path(sys.executable).with_name("rl-launch"))
    return subprocess.run([rl, *args], capture_output=True, text=True, timeout=timeout)


def _get(url: str, key: str) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None


def _wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout_s, f"timed out after {timeout_s:g} s waiting for {what}"
        time.sleep(0.2)
    return time.monotonic() - t0


@pytest.mark.ray
def test_a_standing_fleet_gives_each_credential_one_use(tmp_path: Path) -> None:
    from launcher.jobdir import JobDir
    from tests.support.running_job import job_processes

    root = tmp_path / "jobs"
    fleet_yaml = write_spec(
        tmp_path / "fleet.yaml",
        local_spec("creds", root=root, generation=sim(2), fleet={"consumers": {"trainer": {"admin": True}}}),
    )
    trainer_yaml = write_spec(
        tmp_path / "trainer.yaml",
        local_spec(
            "trainer",
            root=root,
            command=trainer_command(tmp_path, PROBE, file="probe.py"),
            generation={"fleet": "creds"},
        ),
    )
    up = _rl_launch("fleet", "up", str(fleet_yaml), "--json", timeout=240)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    fleet = JobDir(json.loads(up.stdout)["job_dir"])
    trainer = subprocess.Popen(
        [str(Path(sys.executable).with_name("rl-launch")), "submit", str(trainer_yaml)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:

        def holding() -> bool:
            if trainer.poll() is not None:
                out = trainer.stdout.read() if trainer.stdout else ""
                raise AssertionError(f"the trainer ended before holding its refit: {out[-3000:]}")
            return any((j / "holding.json").exists() for j in root.glob("trainer-*"))

        _wait_for(holding, 180, "the trainer to hold a refit")
        (job_path,) = root.glob("trainer-*")
        job = JobDir(job_path)
        seen = json.loads((job.path / "probe.json").read_text())
        print(f"\nfrom inside the admin consumer's job: {seen}")
        assert seen["overlay_is_client_key"] and not seen["admin_in_env"]
        assert seen["client"] == {"generate": 200, "pause": 403, "get_workers": 403, "post_workers": 403}
        assert seen["admin"] == {"generate": 403, "refit_state": 200, "post_workers": 403}

        # The engine key: the fleet's own, held by no consumer nor by the owner's client key.
        engine_key = fleet.read_engine_key()
        others = {fleet.read_api_key(), fleet.read_admin_token(), job.read_api_key(), job.read_admin_token()}
        assert engine_key and engine_key not in others
        assert (fleet.path / "secrets" / "engine_key").stat().st_mode & 0o777 == 0o600
        state = fleet.read_state()
        for entry in fleet.engine_entries():
            assert _get(entry.url + "/v1/models", fleet.read_api_key())[0] == 401
            assert _get(entry.url + "/v1/models", job.read_api_key())[0] == 401
            assert _get(entry.url + "/v1/models", engine_key)[0] == 200
        for path in (fleet.spec_file, fleet.state_file, fleet.driver_log, fleet.events_file):
            assert engine_key not in path.read_text(), path

        # The trainer's job ends (cancelled): its keys are revoked, and its transaction with them, long
        # before its 120 s lease.
        refit = _get(state["fleet_url"] + "/fleet/refit", fleet.read_admin_token())[1]
        assert refit["active"]["holder"] == f"{job.path.name}.admin", refit
        cancelled = time.monotonic()
        cancel = _rl_launch("cancel", str(job.path), timeout=120)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr

        def ended() -> bool:
            got = _get(state["fleet_url"] + "/fleet/refit", fleet.read_admin_token())[1]
            return got["active"] is None

        _wait_for(ended, 60, "the cancelled trainer's transaction to end")
        took = time.monotonic() - cancelled
        last = _get(state["fleet_url"] + "/fleet/refit", fleet.read_admin_token())[1]["last"]
        print(
            f"the cancelled holder's refit (lease 120 s) ended {took:.1f} s after rl-launch cancel: "
            f"{last['error']}"
        )
        assert last["phase"] == "aborted" and "revoked" in last["error"] and took < 60
        paused = _get(state["fleet_url"] + "/fleet/is_paused", fleet.read_admin_token())[1]["result"]
        assert not paused["router_paused"] and not any(paused["engines_paused"].values())
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, 9)
        trainer.wait(30)
        _rl_launch("fleet", "down", "creds", "--force", "--root", str(root), timeout=180)
        _wait_for(lambda: job_processes(fleet.path) == [], 60, "the fleet's processes to end")
