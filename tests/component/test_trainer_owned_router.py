"""A router with a registration capability (``generation.owner: trainer``) toward the engines it is handed.

The router is configured as the builtin gateway configures it for a job whose trainer owns its engines
(API key, admin token, the capability, no engine key), in one process and behind worker processes; the
"engines" are real servers on 127.0.0.1 that record what reaches them. What must hold:

* no key of the job reaches a registered engine: not the client's on a rollout (Gym's dummy key under the
  capability, the job's API key on the main route as the Gym overlay sends it), not the router's on its
  fan-outs (the step counters behind ``GET /fleet/step``, the prefix-cache reset);
* an engine's answer is read up to a cap: a registered engine streaming a huge ``/metrics`` fails its own
  read, and the router stops reading it near the cap (measured by what the engine got to send);
* the router refuses to register itself (any spelling of its own address) or a URL with a path prefix.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import orjson
import pytest
from aiohttp import web

from router import GenerationRouter
from router.fleet.engine_reads import MAX_METRICS_BYTES
from router.http.capability import registration_url
from tests.support.capability_calls import ADMIN, KEY, call
from tests.support.http_backends import WORKER_MODES, mode_id, router_factory
from tests.support.recording_server import RecordingServer

ENGINE_METRICS = "vllm:prompt_tokens_total 5\nvllm:generation_tokens_total 7\n"
COMPLETION = orjson.dumps({"id": "c1", "choices": [{"text": "ok"}]}).decode()


@pytest.fixture
def routers() -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(probe_interval_s=0.2, api_key=KEY, admin_token=ADMIN) as make:
        yield make


@pytest.fixture
async def servers() -> AsyncIterator[Callable[..., Awaitable[RecordingServer]]]:
    started: list[RecordingServer] = []

    async def make(answers: dict[str, tuple[int, str, dict[str, str]]]) -> RecordingServer:
        server = await RecordingServer(answers).start()
        started.append(server)
        return server

    try:
        yield make
    finally:
        for s in started:
            await s.stop()


def capture_answers() -> dict[str, tuple[int, str, dict[str, str]]]:
    json_type = {"Content-Type": "application/json"}
    return {
        "/health": (200, "", {}),
        "/metrics": (200, ENGINE_METRICS, {}),
        "/v1/completions": (200, COMPLETION, json_type),
        "/reset_prefix_cache": (200, "{}", json_type),
    }


def capability_router(make: Callable[..., GenerationRouter], workers: int) -> tuple[GenerationRouter, str]:
    cap = secrets.token_urlsafe(32)
    router = make([], registration_capability=cap, workers=workers)
    return router, registration_url(router.base_url(), cap)


@pytest.mark.parametrize("workers", WORKER_MODES, ids=mode_id)
async def test_a_registered_engine_never_receives_a_key_of_the_job(
    workers: int,
    routers: Callable[..., GenerationRouter],
    servers: Callable[..., Awaitable[RecordingServer]],
) -> None:
    router, cap_url = capability_router(routers, workers)
    base = router.base_url()
    engine = await servers(capture_answers())
    status, body = await call("POST", f"{cap_url}/workers", {"url": engine.url})
    assert status == 200, body
    prompt = {"model": "m", "prompt": "hi"}
    for _ in range(3):  # rollouts as Gym sends them: its own key under the capability, the API key on /v1
        status, body = await call("POST", f"{cap_url}/v1/completions", prompt, token="EMPTY")
        assert status == 200, body
        status, body = await call("POST", f"{base}/v1/completions", prompt, token=KEY)
        assert status == 200, body
    # The owner's fan-outs: FleetClient.begin_step, the step rl-launch status reads, the cache reset.
    for method, path in (
        ("POST", "/fleet/step/begin"),
        ("GET", "/fleet/step"),
        ("POST", "/fleet/reset_prefix_cache"),
    ):
        status, body = await call(method, base + path, token=ADMIN)
        assert status == 200, (path, body)
    reached = {(m, p.split("?")[0]) for m, p, _ in engine.seen}
    assert {("POST", "/v1/completions"), ("GET", "/metrics"), ("POST", "/reset_prefix_cache")} <= reached
    print(f"\nwhat the registered engine saw: {sorted(set(engine.seen))}")
    assert engine.authorizations() == []


@dataclass
class HugeMetrics:
    """An engine whose ``/metrics`` streams ``total`` bytes of valid Prometheus text, chunked (no length
    declared), counting what it managed to send before the reader hung up."""

    total: int
    sent: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)
    runner: web.AppRunner | None = None
    url: str = ""

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        line = b"vllm:prompt_tokens_total 1\n"
        chunk = line * (256 * 1024 // len(line))
        try:
            while self.sent < self.total:
                await resp.write(chunk)
                self.sent += len(chunk)
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.done.set()
        return resp

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def start(self) -> HugeMetrics:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def test_a_huge_metrics_answer_fails_that_engine_and_is_not_read_on(
    routers: Callable[..., GenerationRouter],
    servers: Callable[..., Awaitable[RecordingServer]],
) -> None:
    router, cap_url = capability_router(routers, 1)
    base = router.base_url()
    good = await servers(capture_answers())
    huge = await HugeMetrics(total=16 * MAX_METRICS_BYTES).start()
    try:
        for url in (good.url, huge.url):
            status, body = await call("POST", f"{cap_url}/workers", {"url": url})
            assert status == 200, body
        status, body = await call("POST", f"{base}/fleet/step/begin", token=ADMIN)
        await asyncio.wait_for(huge.done.wait(), 30)
    finally:
        await huge.stop()
    print(f"\n/fleet/step/begin: {status} {body}; the huge engine sent {huge.sent / 2**20:.0f} MiB")
    assert status == 500  # one engine's counters could not be read
    errors = body["errors"]
    assert isinstance(errors, dict) and list(errors) == [huge.url], errors
    assert "cap" in str(errors[huge.url]), errors
    # Read whole it would have been all 128 MiB; the router stopped at its 8 MiB cap (what the sockets
    # buffered on both sides comes on top).
    assert huge.sent < 4 * MAX_METRICS_BYTES, huge.sent


@pytest.mark.parametrize("workers", WORKER_MODES, ids=mode_id)
async def test_the_router_refuses_itself_and_a_path_prefixed_url(
    workers: int,
    routers: Callable[..., GenerationRouter],
    servers: Callable[..., Awaitable[RecordingServer]],
) -> None:
    router, cap_url = capability_router(routers, workers)
    port = router.port
    engine = await servers(capture_answers())
    for own in (
        f"http://127.0.0.1:{port}",
        f"http://localhost:{port}/v1",
        f"http://127.0.0.1:{port}/",
        f"{cap_url}",  # the router behind its own capability: a path, and itself
    ):
        status, body = await call("POST", f"{cap_url}/workers", {"url": own})
        print(f"\nregister {own}: {status} {body}")
        assert status == 400 and body["code"] == "ADD_WORKER_FAILED", (own, body)
        assert "this router" in str(body["message"]) or "path" in str(body["message"]), body
    status, body = await call("POST", f"{cap_url}/workers", {"url": f"http://localhost:{port}"})
    assert status == 400 and "this router" in str(body["message"]), body
    for prefixed in (f"{engine.url}/t/x", f"{engine.url}/v1/completions", f"{engine.url}/proxy/v1"):
        status, body = await call("POST", f"{cap_url}/workers", {"url": prefixed})
        assert status == 400 and "path" in str(body["message"]), (prefixed, body)
    status, body = await call("GET", f"{cap_url}/workers")
    assert body["workers"] == [], body
    assert engine.seen == []  # nothing was probed for a refused URL
    # An engine's own URL, bare or with /v1, still registers.
    status, body = await call("POST", f"{cap_url}/workers", {"url": f"{engine.url}/v1/"})
    assert status == 200, body


@pytest.mark.parametrize("workers", WORKER_MODES, ids=mode_id)
async def test_the_owners_registration_refuses_the_router_itself_too(
    workers: int,
    routers: Callable[..., GenerationRouter],
    servers: Callable[..., Awaitable[RecordingServer]],
) -> None:
    """The owner's ``POST /workers`` (admin token, a router whose serving set is not a fleet
    controller's) goes through the same refusal as the capability's: the router as its own engine
    recurses whoever registered it."""
    router = routers([], workers=workers)
    base = router.base_url()
    engine = await servers(capture_answers())
    for own in (f"http://127.0.0.1:{router.port}", f"http://localhost:{router.port}/v1"):
        status, body = await call("POST", f"{base}/workers", {"url": own}, token=ADMIN)
        assert status == 400 and "this router" in str(body["message"]), (own, body)
    status, body = await call("POST", f"{base}/workers", {"url": f"{engine.url}/t/x"}, token=ADMIN)
    assert status == 400 and "path" in str(body["message"]), body
    assert engine.seen == []
    status, body = await call("POST", f"{base}/workers", {"url": engine.url}, token=ADMIN)
    assert status == 200, body
