"""An unmodified NeMo-RL ``remote_vllm`` run on the fleet by changing a URL and a key (issue 39).

NeMo-RL's client keeps only the origin of ``control_base_url`` and sends its one key (``api_key_env_var``)
to every call, the generation URL's ``/health`` and ``/v1/models`` included. So the router serves vLLM's
control API at the root of the fleet URL's origin as well as under ``/control``
(``router.fleet.vllm_control``), its open ``/health`` says ``"control_fanout": true``, and its
``GET /v1/models`` takes the admin token and an admin consumer's key (``router.http.auth.Access.LISTING``),
while generation keeps taking the client keys only.

Real router over HTTP (one process, and one with 2 worker processes that relay the control routes),
simulated engines; NeMo-RL's calls are ``tests.support.trainer_replays.NemoRlRemoteVllm`` with its default
paths, its ``control_base_url`` the driver's ``RL_CONTROL_BASE_URL`` (``control_url_of``), its key the
admin token. vLLM's other control paths at the root are refused in vLLM's shape and reach no backend.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
import pytest
from aiohttp import web

from launcher.driver.gym_wiring import control_url_of
from launcher.gateways.fleet_endpoint import FleetEndpoint
from router import GenerationRouter
from router.consumers import add_admin_key, add_consumer, new_key
from router.fleet.api import FleetApi
from router.fleet.vllm_control import UNSUPPORTED
from router.http.app import PROXIED_ROUTES
from router.http.auth import RouteTable
from router.policies import make_policy
from router.policies.base import LoadTracker
from router.state.backends import BackendSet
from router.state.pause_gate import PauseGate
from tests.support.checkpoints import checkpoint
from tests.support.http_backends import router_factory
from tests.support.recording_server import RecordingServer
from tests.support.refit_calls import TOKEN, chat, checksums, in_thread
from tests.support.trainer_replays import NEMO_RL_PATHS, NemoRlRemoteVllm, nemo_rl_version_dir

CLIENT_KEY = "client-key-" + "c" * 24
TENANT_KEY = new_key()
TENANT_ADMIN_KEY = new_key()
NEMO_RL_ORDER = [
    "/health",  # base_url's
    "/health",  # control_base_url's
    "/v1/models",  # base_url's
    "/server_info",
    "/pause",
    "/collective_rpc",
    "/resume",
    "/reset_prefix_cache",  # its async loop's invalidate_kv_cache, after the resume
]


async def test_no_root_control_path_is_a_generation_route() -> None:
    """The root mount shares the generation URL's origin: no route the fleet's API registers there may
    be a proxied route's path (``/health`` and ``/v1/models`` stay the generation URL's)."""
    table = RouteTable(web.Application())
    FleetApi(BackendSet(make_policy("round_robin"), LoadTracker()), PauseGate()).add_routes(table)
    root = {r.path for r in table.marked() if not r.path.startswith(("/control/", "/fleet/"))}
    assert {"/pause", "/collective_rpc", "/server_info", "/sleep"} <= root
    assert not root & {path for path, _ in PROXIED_ROUTES} and "/health" not in root, root


@pytest.fixture(params=[1, 2], ids=["one-process", "2-workers"])
def keyed(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., GenerationRouter]]:
    """Routers keyed as a job's: the client key on generation, the admin token on the control URL, and a
    consumers file with a tenant's client key and its admin key."""
    path = tmp_path / "consumers.json"
    add_consumer(path, "tenant", TENANT_KEY)
    add_admin_key(path, "tenant", TENANT_ADMIN_KEY)
    with router_factory(
        policy="round_robin",
        probe_interval_s=0,
        api_key=CLIENT_KEY,
        admin_token=TOKEN,
        consumers_file=str(path),
        workers=request.param,
    ) as make:
        yield make


async def call(url: str, method: str, path: str, key: str | None, body: Any = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s, s.request(method, url + path, json=body, headers=headers) as r:
        raw = await r.read()
    try:
        return r.status, orjson.loads(raw)
    except orjson.JSONDecodeError:
        return r.status, raw.decode()


def nemo_rl(base_url: str, control_base_url: str | None) -> NemoRlRemoteVllm:
    """NeMo-RL's ``remote_vllm_cfg`` as a user moving a run sets it: the two URLs and the admin token,
    every ``*_path`` left at its default."""
    return NemoRlRemoteVllm(
        base_url=base_url,
        served_model_name="sim",
        api_key=TOKEN,
        control_base_url=control_base_url,
        paths=dict(NEMO_RL_PATHS),
    )


async def nemo_rl_run(nemo: NemoRlRemoteVllm, tmp_path: Path) -> tuple[dict[str, Any], str]:
    """Preflight, one refit of a fresh export, the async loop's cache reset; the derived version."""
    info = await in_thread(nemo.preflight)
    checkpoint_dir = tmp_path / "nemo-rl-exports"
    export = checkpoint(checkpoint_dir, nemo_rl_version_dir(checkpoint_dir, 1).name, b"1")
    refit = await in_thread(nemo.refit, export)
    await in_thread(nemo.invalidate_kv_cache)
    return info, refit[-1].answer["weight_version"]


async def test_nemo_rl_with_default_paths_preflights_and_refits_the_fleet_at_its_origin(
    sims, keyed, tmp_path: Path
) -> None:
    engines = await sims(2)
    before = checksums(engines)
    router = keyed([e.url for e in engines])
    url = router.base_url()
    nemo = nemo_rl(f"{url}/v1", control_url_of(url))  # RL_POLICY_BASE_URL, RL_CONTROL_BASE_URL
    info, version = await nemo_rl_run(nemo, tmp_path)

    calls = nemo.transport.calls
    assert [c.status for c in calls] == [200] * len(NEMO_RL_ORDER), [c.brief() for c in calls]
    assert [urlsplit(c.url).path for c in calls] == NEMO_RL_ORDER
    assert all(urlsplit(c.url).netloc == urlsplit(url).netloc for c in calls)
    assert nemo.transport.api_key == TOKEN  # the one Bearer of every call above
    control_health = calls[1].answer
    assert control_health["control_fanout"] is True and "total_backends" not in control_health
    assert info["fleet"]["total_backends"] == 2 and info["fleet"]["control_fanout"] is True, info
    # The refit ran as the fleet's transaction: canary, every engine, one checksum, the derived version.
    assert calls[5].answer["refit"]["canary"] is not None, calls[5].answer
    assert version == "version_00000001-c1" and calls[-1].answer["weight_version"] == version
    assert {e.rl.weight_version for e in engines} == {version} == {router.fleet.current_version}
    after = checksums(engines)
    assert after[0] == after[1] != before[0]
    assert not any(e.scheduler.gen_paused for e in engines)
    status, weight_info = await call(url, "GET", "/weight_info", TOKEN)
    assert (status, weight_info) == (200, {"weight_version": version})
    print(f"\n[control origin] NeMo-RL, default paths: {[c.brief()[:60] for c in calls]}")


async def test_generation_keeps_its_keys_and_the_model_list_takes_the_admin_ones(sims, keyed) -> None:
    """Generation: the client keys only (the admin token 401, an admin consumer's key 403, as before);
    ``GET /v1/models``: those and the admin keys; the rest of the client routes as strict as before."""
    engines = await sims(2)
    url = keyed([e.url for e in engines]).base_url()
    body = {**chat(), "model": "sim"}
    generation = {
        key: (await call(url, "POST", "/v1/chat/completions", key, body))[0]
        for key in (CLIENT_KEY, TENANT_KEY, TOKEN, TENANT_ADMIN_KEY, None)
    }
    assert generation == {CLIENT_KEY: 200, TENANT_KEY: 200, TOKEN: 401, TENANT_ADMIN_KEY: 403, None: 401}
    listing = {
        key: await call(url, "GET", "/v1/models", key)
        for key in (CLIENT_KEY, TENANT_KEY, TOKEN, TENANT_ADMIN_KEY, None, "not-a-key")
    }
    for key in (CLIENT_KEY, TENANT_KEY, TOKEN, TENANT_ADMIN_KEY):
        status, models = listing[key]
        assert status == 200 and [m["id"] for m in models["data"]] == ["sim"], (key, models)
    assert listing[None][0] == listing["not-a-key"][0] == 401
    tokenize = {"model": "sim", "prompt": "hello"}
    assert (await call(url, "POST", "/tokenize", TOKEN, tokenize))[0] == 401
    assert (await call(url, "POST", "/tokenize", TENANT_ADMIN_KEY, tokenize))[0] == 403
    assert (await call(url, "POST", "/tokenize", CLIENT_KEY, tokenize))[0] == 200
    # The open /health: 200 for probes with no key at all, the control fan-out flag for NeMo-RL.
    assert await call(url, "GET", "/health", None) == (200, {"status": "ok", "control_fanout": True})
    # The root control routes: the admin keys only.
    assert (await call(url, "GET", "/is_paused", TOKEN))[0] == 200
    assert (await call(url, "GET", "/is_paused", TENANT_ADMIN_KEY))[0] == 200
    assert (await call(url, "POST", "/pause", CLIENT_KEY))[0] == 401
    assert (await call(url, "POST", "/pause", TENANT_KEY))[0] == 403
    assert (await call(url, "POST", "/pause", None))[0] == 401


async def test_vllms_other_control_paths_at_the_root_are_refused_and_reach_no_engine(keyed) -> None:
    backend = await RecordingServer().start()
    try:
        url = keyed([backend.url]).base_url()
        refused = {path: await call(url, "POST", path, TOKEN, {}) for path in UNSUPPORTED}
        for path, (status, answer) in refused.items():
            assert status == 404, (path, answer)
            error = answer["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == 404, error
            assert f"POST {path} is not served" in error["message"] and "reload_weights" in error["message"]
        status, answer = await call(url, "GET", "/pause", TOKEN)  # a control path, another method
        assert status == 405 and "(wrong method)" in answer["error"]["message"], answer
        assert (await call(url, "POST", "/sleep", None))[0] == 401
        assert (await call(url, "POST", "/sleep", CLIENT_KEY))[0] == 401
        assert (await call(url, "POST", "/sleep", TENANT_KEY))[0] == 403
        # No catch-all at the root: an unknown path is still the router's own 404 (a client route).
        status, answer = await call(url, "POST", "/not_a_vllm_route", CLIENT_KEY)
        assert status == 404 and "is not served by the router" in answer["error"]["message"], answer
        assert (await call(url, "POST", "/not_a_vllm_route", TOKEN))[0] == 401
        await asyncio.sleep(0.1)
    finally:
        await backend.stop()
    assert backend.seen == [], backend.seen  # nothing reached the engine, not even the refused calls


async def test_the_driver_fleet_endpoint_serves_the_control_api_at_its_root(sims, tmp_path: Path) -> None:
    """Beside vllm-router / Ray Serve the fleet URL is the driver's fleet endpoint: nothing else serves
    its root, so ``/health`` and ``/v1/models`` there are the control URL's (admin, the fleet's count).
    NeMo-RL's ``base_url`` is the front; a simulated engine stands in for it here (no vllm-router)."""
    engines = await sims(2)
    endpoint = FleetEndpoint("127.0.0.1", 0, TOKEN, None)
    await asyncio.to_thread(endpoint.start)
    try:
        await asyncio.to_thread(endpoint.serving, [e.url for e in engines])
        status, health = await call(endpoint.url, "GET", "/health", TOKEN)
        assert status == 200 and health["total_backends"] == 2 and health["control_fanout"] is True
        status, models = await call(endpoint.url, "GET", "/v1/models", TOKEN)
        assert status == 200 and [m["id"] for m in models["data"]] == ["sim"], models
        assert (await call(endpoint.url, "GET", "/health", None))[0] == 401
        nemo = nemo_rl(engines[0].url, control_url_of(endpoint.url))
        _, version = await nemo_rl_run(nemo, tmp_path)
        assert [c.status for c in nemo.transport.calls] == [200] * len(NEMO_RL_ORDER)
        assert [urlsplit(c.url).path for c in nemo.transport.calls] == NEMO_RL_ORDER
        assert {e.rl.weight_version for e in engines} == {version} == {endpoint.weight_version}
        assert (await call(endpoint.url, "POST", "/sleep", TOKEN))[0] == 404
    finally:
        await asyncio.to_thread(endpoint.stop)
