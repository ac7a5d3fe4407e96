"""The registration capability (``router.http.capability``): NeMo-RL's external-router flow, with no
header, on a router that holds the job's capability, in one process and behind worker processes.

Real routers and fake engines on 127.0.0.1. What must hold: the flow as NeMo-RL performs it works
(``POST {url}/workers`` blocks until the engine answers ``/health``, then rollouts under ``{url}/v1``
reach it, the capability never reaching the engine); a wrong capability is refused like a wrong key, on
every route under the prefix; the owner's routes still take the admin token alone; the router's prober
holds out an engine that stops answering and readmits it when it answers again.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest

from router import GenerationRouter
from router.config import RouterConfig
from router.http.capability import registration_url
from tests.support.capability_calls import ADMIN, KEY, call
from tests.support.http_backends import WORKER_MODES, FakeEngine, engine_factory, mode_id, router_factory


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., Awaitable[list[FakeEngine]]]]:
    async with engine_factory(FakeEngine, 1) as make:
        yield make


@pytest.fixture
def routers() -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(
        probe_interval_s=0.2,
        probe_failures_to_eject=2,
        probe_successes_to_readmit=2,
        api_key=KEY,
        admin_token=ADMIN,
    ) as make:
        yield make


async def wait_healthy(base: str, url: str, want: bool, cap_url: str) -> None:
    for _ in range(100):  # bounded: 10 s
        status, body = await call("GET", f"{cap_url}/workers")
        assert status == 200, body
        if any(w["url"] == url and w["healthy"] is want for w in body["workers"]):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{url} never became healthy={want}: {body}")


@pytest.mark.parametrize("workers", WORKER_MODES, ids=mode_id)
async def test_registration_flow_without_a_header_serves_and_holds_out(
    workers: int,
    engines: Callable[..., Awaitable[list[FakeEngine]]],
    routers: Callable[..., GenerationRouter],
) -> None:
    cap = secrets.token_urlsafe(32)
    router = routers([], registration_capability=cap, workers=workers)
    base = router.base_url()
    url = registration_url(base, cap)
    (e0, e1) = await engines(2)
    e1.healthy = False
    # NeMo-RL's flow: POST {router_url minus /v1}/workers {"url": replica}, no Authorization header.
    status, body = await call("POST", f"{url}/workers", {"url": e0.url})
    assert (status, body["success"]) == (200, True), body
    # A registration blocks until the replica answers /health: e1 answers once it is healthy.
    pending = asyncio.ensure_future(call("POST", f"{url}/workers", {"url": e1.url}))
    await asyncio.sleep(0.5)
    assert not pending.done()
    e1.healthy = True
    status, body = await asyncio.wait_for(pending, 10)
    assert status == 200, body
    # Rollouts under {router_url}/v1, with whatever key Gym sends (here a dummy).
    seen = set()
    for _ in range(12):
        status, body = await call("POST", f"{url}/v1/completions", {"prompt": "hi"}, token="EMPTY")
        assert status == 200, body
        assert body["path"] == "/v1/completions"  # the engine never sees the capability
        seen.add(body["backend"])
    assert seen == {"e0", "e1"}
    for engine in (e0, e1):
        for _, path, headers in engine.requests:
            assert cap not in path and cap not in str(headers)
    status, body = await call("POST", f"{url}/tokenize", {"prompt": "hi"})
    assert status == 200 and body["path"] == "/tokenize"
    # The plain URL with the client key serves the same engines.
    status, body = await call("POST", f"{base}/v1/completions", {"prompt": "hi"}, token=KEY)
    assert status == 200, body

    # Held out while it fails its probes, readmitted when it answers again; the rest keep serving.
    e1.healthy = False
    await wait_healthy(base, e1.url, False, url)
    for _ in range(6):
        status, body = await call("POST", f"{url}/v1/completions", {"prompt": "hi"})
        assert (status, body["backend"]) == (200, "e0")
    e1.healthy = True
    await wait_healthy(base, e1.url, True, url)


@pytest.mark.parametrize("workers", WORKER_MODES, ids=mode_id)
async def test_wrong_capability_is_refused_everywhere_and_owner_routes_keep_the_admin_token(
    workers: int,
    engines: Callable[..., Awaitable[list[FakeEngine]]],
    routers: Callable[..., GenerationRouter],
) -> None:
    cap = secrets.token_urlsafe(32)
    router = routers([], registration_capability=cap, workers=workers)
    base = router.base_url()
    (e0,) = await engines(1)
    wrong = registration_url(base, secrets.token_urlsafe(32))
    for method, path, body in (
        ("POST", "/workers", {"url": e0.url}),
        ("GET", "/workers", None),
        ("POST", "/v1/chat/completions", {"messages": []}),
        ("POST", "/tokenize", {"prompt": "x"}),
    ):
        for prefix in (wrong, f"{base}/t/{cap[:-1]}", f"{base}/t/"):
            status, answer = await call(method, prefix + path, body, token=ADMIN)
            assert status == 401, (method, prefix, path, status, answer)
    assert e0.requests == []  # nothing was probed or proxied for a stranger
    # The capability is no admin token: /fleet/* and the owner's /workers refuse it as a key.
    status, _ = await call("POST", f"{base}/workers", {"url": e0.url}, token=cap)
    assert status == 401
    status, _ = await call("GET", f"{base}/fleet/weight_version", token=cap)
    assert status == 401
    status, _ = await call("GET", f"{base}/workers", token=ADMIN)
    assert status == 200


def test_capability_is_refused_when_short_or_on_a_managed_router() -> None:
    with pytest.raises(ValueError, match="at least 32"):
        RouterConfig(host="127.0.0.1", port=0, admin_token=ADMIN, registration_capability="short")
    with pytest.raises(ValueError, match="owns its serving set"):
        RouterConfig(
            host="127.0.0.1",
            port=0,
            admin_token=ADMIN,
            health_managed=True,
            registration_capability=secrets.token_urlsafe(32),
        )
    cfg = RouterConfig(host="127.0.0.1", port=0, admin_token=ADMIN, registration_capability="x" * 40)
    assert "x" * 40 not in cfg.model_dump_json() + repr(cfg)
