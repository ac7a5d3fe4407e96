"""Real aiohttp backends on 127.0.0.1 (OS-chosen ports) that behave like engines, for router tests.

Each backend answers the OpenAI routes with a JSON echo naming itself, so a test can tell where a request
landed and whether the body arrived intact; ``mode`` switches it into the failure shapes the router must
handle (hang, reset, mid-stream break).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import orjson
import pytest
from aiohttp import web

from router import GenerationRouter
from router.config import RouterConfig
from router.policies.base import Policy


@dataclass
class FakeEngine:
    name: str
    mode: str = "ok"  # ok | hang | reset | break_stream | status
    status: int = 200
    healthy: bool = True
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    release_stream: asyncio.Event = field(default_factory=asyncio.Event)
    runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/v1"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append((request.method, request.path, dict(request.headers)))
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "reset":
            assert request.transport is not None
            request.transport.abort()
            await asyncio.sleep(1)
        if request.path == "/v1/stream" or (body and b'"stream": true' in body):
            return await self.stream(request)
        payload = {
            "backend": self.name,
            "path": request.path,
            "len": len(body),
            "sha256": hashlib.sha256(body).hexdigest(),
        }
        if request.path == "/tokenize":
            payload["count"] = len(body) // 4
        status = self.status if self.mode == "status" else 200
        return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")

    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"chunk": 1}\n\n')
        # The second chunk waits for the test: if the router buffered, the client would never see chunk 1.
        await asyncio.wait_for(self.release_stream.wait(), 10)
        if self.mode == "break_stream":
            assert request.transport is not None
            request.transport.abort()
            return resp
        await resp.write(b'data: {"chunk": 2}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def start(self) -> FakeEngine:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self.health)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


def dead_url() -> str:
    """A URL on which nothing listens (a port bound then released)."""
    from router.ports import free_port

    return f"http://127.0.0.1:{free_port()}/v1"


@contextlib.asynccontextmanager
async def engine_factory(
    cls: type[FakeEngine] = FakeEngine, default_n: int = 1
) -> AsyncIterator[Callable[..., Awaitable[list[FakeEngine]]]]:
    """``make(n, **fields)`` starts ``n`` engines named e0, e1, ... (unique across calls); every engine
    started is released and stopped on exit. The body of each test file's ``engines`` fixture."""
    started: list[FakeEngine] = []

    async def make(n: int = default_n, **kwargs: object) -> list[FakeEngine]:
        out = [await cls(name=f"e{len(started) + i}", **kwargs).start() for i in range(n)]  # type: ignore[arg-type]
        started.extend(out)
        return out

    try:
        yield make
    finally:
        for e in started:
            e.release_stream.set()
            await e.stop()


WORKER_MODES = (1, 2)
"""The router's worker-process counts every hardening test runs against: one process, and two worker
processes in front of the routing state (``rl-launch router``'s default mode). What one enforces the
other must enforce too (issue 17: the worker relay had none of the single process's bounds)."""


def mode_id(workers: int) -> str:
    return "one-process" if workers == 1 else f"{workers}-workers"


@pytest.fixture(name="workers", params=WORKER_MODES, ids=mode_id)
def workers_fixture(request: pytest.FixtureRequest) -> int:
    """The fixture ``workers``: a test that takes it runs once per count in ``WORKER_MODES``. A test module
    imports it as ``workers_fixture``, so that its tests' ``workers`` argument shadows no import."""
    return int(request.param)


@contextlib.contextmanager
def router_factory(**defaults: object) -> Iterator[Callable[..., GenerationRouter]]:
    """``make(backends, **settings)`` starts a router on 127.0.0.1 (OS-chosen port) with ``defaults``
    under ``settings``; a ``Policy`` object as ``policy`` becomes the router's own policy object. Every
    router made is stopped on exit. The body of each test file's ``routers`` fixture.

    A router given neither ``api_key`` nor ``admin_token`` is made with ``insecure_admin`` (its admin
    routes open, as the tests of routing, limits and the like call them without a token); the tests of
    the admin surface give tokens."""
    made: list[GenerationRouter] = []

    def make(backends: list[str], **settings: object) -> GenerationRouter:
        for key, value in defaults.items():
            settings.setdefault(key, value)
        if settings.get("api_key") is None and settings.get("admin_token") is None:
            settings.setdefault("insecure_admin", True)
        policy = settings.get("policy")
        obj = policy if isinstance(policy, Policy) else None
        if obj is not None:
            settings["policy"] = obj.name
        r = GenerationRouter(RouterConfig(host="127.0.0.1", port=0, **settings), backends, policy=obj)  # type: ignore[arg-type]
        r.serve_in_background()
        made.append(r)
        return r

    try:
        yield make
    finally:
        for r in made:
            r.stop()


async def engine_in_flight(router: GenerationRouter) -> str:
    """The engine the router counts the one request in flight on (bounded wait: 2 s)."""
    loop = asyncio.get_running_loop()
    for _ in range(200):
        busy = [u for u, n in (await loop.run_in_executor(None, router.in_flight)).items() if n]
        if busy:
            return busy[0]
        await asyncio.sleep(0.01)
    raise AssertionError("no engine has the request in flight")
