"""The router's rules, each against real aiohttp backends and a real router on 127.0.0.1."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router import GenerationRouter, RouterBindError
from router.config import RouterConfig
from router.http.status import CLIENT_RETRIED_STATUSES
from tests.support.http_backends import FakeEngine, dead_url, engine_factory, router_factory

CHAT = "/v1/chat/completions"


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., Awaitable[list[FakeEngine]]]]:
    async with engine_factory(FakeEngine, 2) as make:
        yield make


@pytest.fixture
def routers() -> Iterator[Callable[..., GenerationRouter]]:
    # probing off: these tests count outcomes; probing has its own tests
    with router_factory(policy="round_robin", probe_interval_s=0) as make:
        yield make


async def post(url: str, body: bytes | dict[str, object], **kwargs: object) -> tuple[int, bytes, object]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        async with s.post(url, data=data, **kwargs) as r:  # type: ignore[arg-type]
            return r.status, await r.read(), r.headers


async def test_body_passes_byte_for_byte(engines, routers) -> None:
    (e,) = await engines(1)
    r = routers([e.api_url])
    big = os.urandom(512 * 1024)
    status, body, _ = await post(r.base_url() + CHAT, big, headers={"Content-Type": "application/json"})
    assert status == 200
    got = orjson.loads(body)
    assert got["len"] == len(big) and got["sha256"] == hashlib.sha256(big).hexdigest()
    assert got["path"] == CHAT


async def test_response_bytes_and_encoding_untouched(routers) -> None:
    from aiohttp import web

    raw = gzip.compress(b'{"x": "' + b"a" * 100000 + b'"}')

    async def gz(request: web.Request) -> web.Response:
        return web.Response(
            body=raw,
            headers={
                "Content-Encoding": "gzip",
                "Content-Type": "application/json",
                "Connection": "keep-alive, X-Secret",
                "X-Secret": "hop",
                "Keep-Alive": "timeout=5",
            },
        )

    app = web.Application()
    app.router.add_post(CHAT, gz)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        r = routers([f"http://127.0.0.1:{port}/v1"])
        status, body, headers = await post(r.base_url() + CHAT, b"{}")
        assert status == 200
        assert body == raw  # compressed bytes, exactly
        assert headers["Content-Encoding"] == "gzip"
        assert int(headers["Content-Length"]) == len(raw)
        assert "X-Secret" not in headers and "Keep-Alive" not in headers
    finally:
        await runner.cleanup()


async def test_streaming_is_chunk_by_chunk(engines, routers) -> None:
    (e,) = await engines(1)
    r = routers([e.api_url])
    async with aiohttp.ClientSession() as s:
        async with s.post(r.base_url() + CHAT, data=b'{"stream": true}') as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
            assert first == b'data: {"chunk": 1}\n\n'  # arrived while the backend still holds chunk 2
            e.release_stream.set()
            rest = await asyncio.wait_for(resp.content.read(), 5)
    assert rest == b'data: {"chunk": 2}\n\ndata: [DONE]\n\n'


async def test_stream_broken_after_first_byte_ends_with_error_event(engines, routers) -> None:
    (e,) = await engines(1, mode="break_stream")
    r = routers([e.api_url])
    async with aiohttp.ClientSession() as s:
        async with s.post(r.base_url() + CHAT, data=b'{"stream": true}') as resp:
            assert resp.status == 200
            await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
            e.release_stream.set()
            rest = await asyncio.wait_for(resp.content.read(), 5)
    assert rest.startswith(b"event: error\ndata: ")
    assert orjson.loads(rest.split(b"data: ", 1)[1])["error"]["code"] == 500
    assert r.drain_backend_outcomes() == {e.url: (0, 1)}


async def test_tokenize_maps_to_backend_origin(engines, routers) -> None:
    (e,) = await engines(1)
    r = routers([e.api_url])
    status, body, _ = await post(r.base_url() + "/tokenize", {"prompt": "hello world"})
    assert status == 200 and orjson.loads(body)["path"] == "/tokenize"
    async with aiohttp.ClientSession() as s, s.get(r.base_url() + "/v1/models") as resp:
        assert resp.status == 200 and (await resp.json())["path"] == "/v1/models"


async def test_unknown_path_is_routers_own_404(engines, routers) -> None:
    (e,) = await engines(1)
    r = routers([e.api_url])
    status, body, _ = await post(r.base_url() + "/v1/embeddings", {})
    assert status == 404 and orjson.loads(body)["router"] is True
    assert e.requests == []


@pytest.mark.parametrize("code", [400, 404, 422, 429])
async def test_backend_4xx_passes_unchanged(engines, routers, code: int) -> None:
    (e,) = await engines(1, mode="status", status=code)
    r = routers([e.api_url])
    status, body, _ = await post(r.base_url() + CHAT, {})
    assert status == code and orjson.loads(body)["backend"] == "e0"
    assert len(e.requests) == 1  # never retried: the backend's answer is the answer


async def test_killed_backend_is_500_without_retry_and_200_with(engines, routers) -> None:
    (e,) = await engines(1)
    dead = dead_url()
    r1 = routers([dead], max_attempts=1)
    status, body, _ = await post(r1.base_url() + CHAT, {})
    assert status == 500
    assert orjson.loads(body)["error"]["type"] == "backend_connect"
    r2 = routers([dead, e.api_url])
    for _ in range(4):  # round robin: half of the first attempts land on the dead one
        status, body, _ = await post(r2.base_url() + CHAT, {})
        assert status == 200 and orjson.loads(body)["backend"] == "e0"
    outcomes = r2.drain_backend_outcomes()
    assert outcomes[e.url] == (4, 0)
    assert outcomes[dead.removesuffix("/v1")][1] >= 1


async def test_reset_backend_is_500(engines, routers) -> None:
    (e,) = await engines(1, mode="reset")
    r = routers([e.api_url], max_attempts=1)
    status, body, _ = await post(r.base_url() + CHAT, {})
    assert status == 500 and orjson.loads(body)["error"]["type"] == "backend_reset"


async def test_hanging_backend_is_500_after_timeout_not_504(engines, routers) -> None:
    (e,) = await engines(1, mode="hang")
    r = routers([e.api_url], backend_timeout_s=0.5, max_attempts=1)
    t0 = time.monotonic()
    status, body, _ = await post(r.base_url() + CHAT, {})
    took = time.monotonic() - t0
    assert status == 500 and orjson.loads(body)["error"]["type"] == "backend_timeout"
    assert 0.4 <= took < 5


async def test_no_serving_backend_answers_configured_status(engines, routers) -> None:
    r = routers([])
    status, body, _ = await post(r.base_url() + CHAT, {})
    assert status == 409 and orjson.loads(body)["error"]["type"] == "no_healthy_backend"
    r2 = routers([], no_healthy_backend_status=422)
    assert (await post(r2.base_url() + CHAT, {}))[0] == 422
    async with aiohttp.ClientSession() as s:
        async with s.get(r.base_url() + "/health") as resp:
            assert resp.status == 200  # liveness does not depend on backends
        async with s.get(r.base_url() + "/readiness") as resp:
            assert resp.status == 503


@pytest.mark.parametrize("code", sorted(CLIENT_RETRIED_STATUSES | {200, 302, 501}))
def test_statuses_clients_retry_are_refused(code: int) -> None:
    with pytest.raises(ValueError, match=str(code)):
        RouterConfig(no_healthy_backend_status=code)


def test_port_conflict_names_the_address() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(RouterBindError, match=f"127.0.0.1:{port}"):
            GenerationRouter(RouterConfig(host="127.0.0.1", port=port, insecure_admin=True))


def test_bad_urls_and_options_are_named() -> None:
    with pytest.raises(ValueError, match="ftp://x"):
        GenerationRouter(RouterConfig(insecure_admin=True), ["ftp://x:1/v1"])
    with pytest.raises(ValueError, match="no port"):
        GenerationRouter(RouterConfig(insecure_admin=True), ["http://host/v1"])
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        RouterConfig(policy="fastest")
    with pytest.raises(ValueError, match="65535"):
        RouterConfig(port=65536)


async def test_drain_hands_over_both_counts_once(engines, routers) -> None:
    (good,) = await engines(1)
    (bad,) = await engines(1, mode="status", status=500)
    r = routers([good.api_url, bad.api_url])
    for _ in range(6):
        await post(r.base_url() + CHAT, {})
    # round robin: the first lands on the good one; each later one on the 500 first (the retry on the
    # good one moves the cursor back), so 5 failed attempts, all retried
    assert r.drain_backend_outcomes() == {good.url: (6, 0), bad.url: (0, 5)}
    assert r.drain_backend_outcomes() == {}


async def test_health_managed_takes_failing_backend_out(engines, routers) -> None:
    (e,) = await engines(1)
    dead = dead_url()
    r = routers([dead, e.api_url], health_managed=True)
    for _ in range(3):
        status, _, _ = await post(r.base_url() + CHAT, {})
        assert status == 200
    assert r.serving_backends() == [e.url]
    r.set_serving_backends([dead, e.api_url])  # the controller re-adds; whole-set replacement
    assert len(r.serving_backends()) == 2
    r3 = routers([dead, e.api_url], health_managed=False)
    for _ in range(3):
        await post(r3.base_url() + CHAT, {})
    assert len(r3.serving_backends()) == 2  # unmanaged: a blip removes nothing


async def test_active_probing_removes_and_readmits(engines, routers) -> None:
    a, b = await engines(2)
    r = routers([a.api_url, b.api_url], probe_interval_s=0.1)
    b.healthy = False
    for _ in range(50):
        if r.serving_backends() == [a.url]:
            break
        await asyncio.sleep(0.05)
    assert r.serving_backends() == [a.url]
    b.healthy = True
    for _ in range(50):
        if len(r.serving_backends()) == 2:
            break
        await asyncio.sleep(0.05)
    assert sorted(r.serving_backends()) == sorted([a.url, b.url])


async def test_set_serving_backends_accepts_new_urls(engines, routers) -> None:
    a, b = await engines(2)
    r = routers([a.api_url])
    r.set_serving_backends([b.api_url])
    status, body, _ = await post(r.base_url() + CHAT, {})
    assert status == 200 and orjson.loads(body)["backend"] == "e1"


async def test_workers_api_blocks_until_healthy_and_rejects_dead(engines, routers) -> None:
    (e,) = await engines(1)
    e.healthy = False
    r = routers([], worker_health_timeout_s=5)
    url = r.base_url()

    async def heal() -> None:
        await asyncio.sleep(0.8)
        e.healthy = True

    async with aiohttp.ClientSession() as s:
        healer = asyncio.create_task(heal())
        t0 = time.monotonic()
        async with s.post(url + "/workers", json={"url": e.url}) as resp:
            assert resp.status == 200 and (await resp.json())["success"] is True
        assert time.monotonic() - t0 >= 0.7  # it waited for /health
        await healer
        async with s.post(url + "/workers", json={"url": e.api_url}) as resp:
            body = await resp.json()
            assert resp.status == 400 and body["code"] == "ADD_WORKER_FAILED"  # duplicate (same engine)
        async with s.get(url + "/workers") as resp:
            assert (await resp.json())["urls"] == [e.url]
        r_short = routers([], worker_health_timeout_s=0.5)
        async with s.post(r_short.base_url() + "/workers", json={"url": dead_url()}) as resp:
            assert resp.status == 400 and (await resp.json())["code"] == "ADD_WORKER_FAILED"
        async with s.post(url + "/workers", data=b"not json") as resp:
            assert resp.status == 400
        from urllib.parse import quote

        async with s.delete(url + "/workers/" + quote(e.url, safe="")) as resp:
            assert resp.status == 200
        async with s.get(url + "/workers") as resp:
            assert (await resp.json())["urls"] == []


async def test_metrics_exposed(engines, routers) -> None:
    (e,) = await engines(1)
    r = routers([e.api_url, dead_url()], policy="cache_aware")
    for _ in range(4):
        await post(r.base_url() + CHAT, {"messages": [{"role": "user", "content": "x" * 1000}]})
    async with aiohttp.ClientSession() as s, s.get(r.base_url() + "/metrics") as resp:
        text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "rl_router_requests",
        "rl_router_in_flight",
        "rl_router_errors",
        "rl_router_request_duration_seconds",
        "rl_router_backend_in_flight",
        "rl_router_backend_successes",
        "rl_router_backend_failures",
        "rl_router_policy_decisions",
        "rl_router_policy_stat",
    ):
        assert name in families, name
    ok = [s for s in families["rl_router_requests"].samples if s.labels.get("status") == "200"]
    assert sum(s.value for s in ok) == 4


async def test_auth_for_clients_admin_and_backends(engines, routers) -> None:
    (e,) = await engines(1)
    r = routers([e.api_url], api_key="client-key", admin_token="admin-key", backend_api_key="engine-key")
    base = r.base_url()
    assert (await post(base + CHAT, {}))[0] == 401
    assert (await post(base + CHAT, {}, headers={"Authorization": "Bearer wrong"}))[0] == 401
    status, _, _ = await post(base + CHAT, {}, headers={"Authorization": "Bearer client-key"})
    assert status == 200
    assert e.requests[-1][2]["Authorization"] == "Bearer engine-key"  # replaced toward the engine
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/workers", headers={"Authorization": "Bearer client-key"}) as resp:
            assert resp.status == 401
        async with s.get(base + "/workers", headers={"Authorization": "Bearer admin-key"}) as resp:
            assert resp.status == 200
        async with s.get(base + "/health") as resp:
            assert resp.status == 200
        async with s.get(base + "/metrics") as resp:
            assert resp.status == 200
    r2 = routers([e.api_url], api_key="client-key")
    await post(r2.base_url() + CHAT, {}, headers={"Authorization": "Bearer client-key"})
    assert e.requests[-1][2]["Authorization"] == "Bearer client-key"  # forwarded unchanged


async def test_hop_by_hop_request_headers_dropped(engines, routers) -> None:
    (e,) = await engines(1)
    r = routers([e.api_url])
    await post(
        r.base_url() + CHAT,
        {},
        headers={
            "Connection": "keep-alive, X-Drop-Me",
            "X-Drop-Me": "1",
            "Proxy-Authorization": "x",
            "X-Keep": "yes",
        },
    )
    seen = e.requests[-1][2]
    assert seen.get("X-Keep") == "yes"
    assert "X-Drop-Me" not in seen and "Proxy-Authorization" not in seen


async def test_router_stops_and_frees_port(engines) -> None:
    r = GenerationRouter(RouterConfig(insecure_admin=True))
    r.serve_in_background()
    assert r.is_serving()
    port = r.port
    r.stop()
    assert not r.is_serving()
    # the same port binds again at once
    again = GenerationRouter(RouterConfig(port=port, insecure_admin=True))
    again.stop()
