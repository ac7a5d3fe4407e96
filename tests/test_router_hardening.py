"""Router hardening (issue 9): one test per finding, each against real sockets on 127.0.0.1.

Sections are owned by area; add to your own section rather than editing another's.
"""

from __future__ import annotations

import asyncio
import gzip
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router import GenerationRouter
from router.limits import HttpLimits
from router.policies import CacheAware, ConsistentHash, LoadTracker, RouteRequest
from tests.http_backends import FakeEngine, dead_url

CHAT = "/v1/chat/completions"

# --- HTTP exactness / status contract / affinity ---


@dataclass
class RawBackend:
    """A backend speaking raw bytes: ``answer(head, body)`` returns what to write back (``None``: never
    answer; a list: parts written 0.2 s apart). Records every request (head, body) and when each of its
    connections was closed."""

    answer: Callable[[bytes, bytes], bytes | list[bytes] | None]
    requests: list[tuple[bytes, bytes]] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    server: asyncio.Server | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                reply = self.answer(head, body)
                if reply is None:
                    await reader.read()  # hold the request until the peer closes
                    break
                for i, part in enumerate([reply] if isinstance(reply, bytes) else reply):
                    if i:
                        await asyncio.sleep(0.2)
                    writer.write(part)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            writer.close()

    async def start(self) -> RawBackend:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()


def ok_json(payload: bytes = b'{"ok":true}') -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(payload),
        payload,
    )


def headers_of(head: bytes) -> dict[bytes, bytes]:
    out = {}
    for line in head.split(b"\r\n")[1:]:
        if b":" in line:
            name, value = line.split(b":", 1)
            out[name.strip().lower()] = value.strip()
    return out


@pytest.fixture
async def raw_backends() -> AsyncIterator[Callable[..., Awaitable[RawBackend]]]:
    made: list[RawBackend] = []

    async def make(answer: Callable[[bytes, bytes], bytes | list[bytes] | None]) -> RawBackend:
        b = await RawBackend(answer).start()
        made.append(b)
        return b

    yield make
    for b in made:
        await b.stop()


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., Awaitable[list[FakeEngine]]]]:
    started: list[FakeEngine] = []

    async def make(n: int = 1, **kwargs: object) -> list[FakeEngine]:
        out = [await FakeEngine(name=f"e{len(started) + i}", **kwargs).start() for i in range(n)]  # type: ignore[arg-type]
        started.extend(out)
        return out

    yield make
    for e in started:
        e.release_stream.set()
        await e.stop()


@pytest.fixture
def routers() -> object:
    made: list[GenerationRouter] = []

    def make(backends: list[str], limits: HttpLimits | None = None, **kwargs: object) -> GenerationRouter:
        kwargs.setdefault("policy", "round_robin")
        r = GenerationRouter(backends, host="127.0.0.1", port=0, **kwargs)  # type: ignore[arg-type]
        if limits is not None:
            r.http_limits = limits
        r.serve_in_background()
        made.append(r)
        return r

    yield make
    for r in made:
        r.stop()


async def post(url: str, body: bytes | dict[str, object], **kwargs: object) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        async with s.post(url, data=data, **kwargs) as r:  # type: ignore[arg-type]
            return r.status, await r.read()


async def metric_samples(router: GenerationRouter, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    async with aiohttp.ClientSession() as s, s.get(router.base_url() + "/metrics") as resp:
        text = await resp.text()
    for f in text_string_to_metric_families(text):
        if f.name == family:
            return {
                tuple(sorted(x.labels.items())): x.value for x in f.samples if not x.name.endswith("_created")
            }
    return {}


async def is_closed(reader: asyncio.StreamReader, within_s: float) -> bool:
    """True when the peer closes the connection within ``within_s`` (EOF or reset)."""
    try:
        data = await asyncio.wait_for(reader.read(65536), within_s)
    except TimeoutError:
        return False
    except ConnectionError:
        return True
    return data == b""


# -- item 2: exact HTTP ---------------------------------------------------------------------------------


async def test_gzip_request_body_is_forwarded_as_sent(raw_backends, routers) -> None:
    backend = await raw_backends(lambda head, body: ok_json())
    r = routers([backend.url + "/v1"])
    bomb = gzip.compress(b"0" * 20_000_000)  # ~20 KB that inflates to 20 MB
    status, _ = await post(
        r.base_url() + CHAT,
        bomb,
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
    )
    assert status == 200
    head, body = backend.requests[0]
    assert body == bomb  # the compressed bytes, never inflated
    assert headers_of(head)[b"content-encoding"] == b"gzip"
    assert headers_of(head)[b"content-length"] == str(len(bomb)).encode()


async def test_expect_100_continue_is_answered_by_the_router_and_not_forwarded(raw_backends, routers) -> None:
    backend = await raw_backends(lambda head, body: ok_json())
    r = routers([backend.url + "/v1"])
    reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
    body = b'{"messages": []}'
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert interim.startswith(b"HTTP/1.1 100 Continue")
    writer.write(body)
    final = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert final.startswith(b"HTTP/1.1 200")
    writer.close()
    head, forwarded = backend.requests[0]
    assert forwarded == body
    assert b"expect" not in headers_of(head)


async def test_backend_interim_1xx_is_never_relayed_as_the_answer(raw_backends, routers) -> None:
    # each part arrives on its own, as from an engine that sends 100 at once and the answer later
    interim = [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>\r\n\r\n"]
    backend = await raw_backends(lambda head, body: [*interim, ok_json(b'{"final":1}')])
    r = routers([backend.url + "/v1"])
    for _ in range(2):  # the second request reuses the kept-alive upstream connection
        status, body = await asyncio.wait_for(post(r.base_url() + CHAT, {}), 5)
        assert (status, body) == (200, b'{"final":1}')
    assert len(backend.requests) == 2


async def test_backend_header_flood_is_500_counted_and_not_buffered(raw_backends, routers) -> None:
    flood = b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (4 * 1024 * 1024) + b"\r\nContent-Length: 2\r\n\r\n{}"
    a = await raw_backends(lambda head, body: flood)
    b = await raw_backends(lambda head, body: flood)
    r = routers([a.url + "/v1", b.url + "/v1"], limits=HttpLimits(max_backend_header_bytes=16 * 1024))
    status, body = await post(r.base_url() + CHAT, {})
    assert status == 500
    error = orjson.loads(body)["error"]
    assert error["type"] == "backend_headers_too_large" and "16384 bytes" in error["message"]
    assert (len(a.requests), len(b.requests)) == (1, 1)  # a failed attempt: retried on the other one
    errors = await metric_samples(r, "rl_router_errors")
    assert errors[(("kind", "headers_too_large"),)] == 2.0


async def test_client_gone_cancels_upstream_frees_slot_and_is_never_retried(raw_backends, routers) -> None:
    hang = await raw_backends(lambda head, body: None)  # takes the request, never answers
    spare = await raw_backends(lambda head, body: ok_json())
    r = routers([hang.url + "/v1", spare.url + "/v1"], backend_timeout_s=1.0)
    _, writer = await asyncio.open_connection("127.0.0.1", r.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    for _ in range(100):
        if hang.requests:
            break
        await asyncio.sleep(0.02)
    assert len(hang.requests) == 1
    assert sum(r.in_flight().values()) == 1
    writer.close()  # the client gives up
    await asyncio.wait_for(hang.closed.wait(), 2)  # the upstream request was aborted
    for _ in range(50):
        if sum(r.in_flight().values()) == 0:
            break
        await asyncio.sleep(0.02)
    assert sum(r.in_flight().values()) == 0  # its slot is free at once, not after the backend timeout
    await asyncio.sleep(1.5)  # past the backend timeout: nothing may re-send it elsewhere
    assert spare.requests == []
    requests = await metric_samples(r, "rl_router_requests")
    assert requests == {(("route", CHAT), ("status", "499")): 1.0}
    assert r.drain_backend_outcomes() == {}  # the client left: not the backend's failure


async def test_half_open_connection_flood_is_capped_and_timed_out(engines, routers) -> None:
    (e,) = await engines(1)
    limits = HttpLimits(head_timeout_s=0.5, keepalive_timeout_s=30.0, max_client_connections=100)
    r = routers([e.api_url], limits=limits)
    conns = []
    for i in range(200):  # half send a partial head, half nothing at all
        reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
        if i % 2:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        conns.append((reader, writer))
    t0 = time.monotonic()
    closed = await asyncio.gather(*(is_closed(reader, 5) for reader, _ in conns))
    took = time.monotonic() - t0
    assert all(closed) and took < 3  # every one closed: at once above the cap, at the head deadline below
    assert r.connections is not None and r.connections.open == 0
    errors = await metric_samples(r, "rl_router_errors")
    assert errors[(("kind", "connection_cap"),)] == 100.0
    assert errors[(("kind", "head_timeout"),)] == 100.0
    for _, writer in conns:
        writer.close()
    assert (await post(r.base_url() + CHAT, {}))[0] == 200  # real requests still served


async def test_slow_head_on_kept_alive_connection_closed_but_idle_one_kept(engines, routers) -> None:
    (e,) = await engines(1)
    r = routers([e.api_url], limits=HttpLimits(head_timeout_s=0.4, keepalive_timeout_s=1.5))
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
    writer.write(request)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200")
    await reader.readexactly(int(headers_of(head)[b"content-length"]))
    assert not await is_closed(reader, 0.9)  # idle past the head deadline: kept (keep-alive governs)
    writer.write(b"GET /v1/models HTTP/1.1\r\nHo")  # a head started and never finished
    assert await is_closed(reader, 1.0)
    reader2, writer2 = await asyncio.open_connection("127.0.0.1", r.port)
    writer2.write(request)
    head = await asyncio.wait_for(reader2.readuntil(b"\r\n\r\n"), 5)
    await reader2.readexactly(int(headers_of(head)[b"content-length"]))
    assert await is_closed(reader2, 3.0)  # idle past the keep-alive timeout: closed
    writer.close()
    writer2.close()


def test_open_file_soft_limit_is_raised_toward_the_hard_limit() -> None:
    code = (
        "import resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "from router import GenerationRouter\n"
        "r = GenerationRouter([], port=0)\n"
        "r.serve_in_background()\n"
        "now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]\n"
        "r.stop()\n"
        "print(now == hard or hard == resource.RLIM_INFINITY and now > 256, r.connections.cap)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "True"


async def test_non_utf8_authorization_is_401(engines, routers) -> None:
    (e,) = await engines(1)
    r = routers([e.api_url], api_key="client-key")
    reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\x80key\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 401")
    writer.close()


async def test_metrics_count_the_status_sent_for_a_too_large_body(engines, routers) -> None:
    (e,) = await engines(1)
    r = routers([e.api_url], max_request_bytes=1024)
    status, _ = await post(r.base_url() + CHAT, b"x" * 4096)
    assert status == 413
    requests = await metric_samples(r, "rl_router_requests")
    assert requests == {(("route", CHAT), ("status", "413")): 1.0}


# -- item 3: the status contract, every row ------------------------------------------------------------

FAILURES: dict[str, dict[str, object]] = {
    "refused": {},
    "reset": {"mode": "reset"},
    "hang": {"mode": "hang"},
    **{str(code): {"mode": "status", "status": code} for code in (500, 502, 503, 504, 520)},
}
FAILURE_TYPE = {"refused": "backend_connect", "reset": "backend_reset", "hang": "backend_timeout"}


async def failing(engines, row: str) -> tuple[str, FakeEngine | None]:
    if row == "refused":
        return dead_url(), None
    (e,) = await engines(1, **FAILURES[row])
    return e.api_url, e


@pytest.mark.parametrize("row", list(FAILURES))
async def test_failed_attempt_is_retried_once_on_another_backend(engines, routers, row: str) -> None:
    bad_url, bad = await failing(engines, row)
    (good,) = await engines(1)
    r = routers([bad_url, good.api_url], backend_timeout_s=0.5)  # round robin: the bad one goes first
    status, body = await post(r.base_url() + CHAT, {})
    assert status == 200 and orjson.loads(body)["backend"] == good.name
    assert len(good.requests) == 1
    if bad is not None:
        assert len(bad.requests) == 1


@pytest.mark.parametrize("row", list(FAILURES))
async def test_two_failed_attempts_answer_500_with_the_backends_error(engines, routers, row: str) -> None:
    first_url, first = await failing(engines, row)
    second_url, second = await failing(engines, row)
    r = routers([first_url, second_url], backend_timeout_s=0.5)
    status, body = await post(r.base_url() + CHAT, {})
    assert status == 500
    error = orjson.loads(body)["error"]
    assert error["code"] == 500
    if row in FAILURE_TYPE:
        assert error["type"] == FAILURE_TYPE[row]
    else:
        assert error["type"] == "backend_status"
        assert second is not None
        assert f"answered {row}" in error["message"]
        assert f'"backend":"{second.name}"' in error["message"]  # the backend's own error body
    for e in (first, second):
        if e is not None:
            assert len(e.requests) == 1  # once each: one retry, never two on one backend


@pytest.mark.parametrize("code", [400, 401, 404, 408, 413, 422, 429])
async def test_4xx_passes_through_unchanged_and_is_not_retried(engines, routers, code: int) -> None:
    (a,) = await engines(1, mode="status", status=code)
    (b,) = await engines(1)
    r = routers([a.api_url, b.api_url])
    status, body = await post(r.base_url() + CHAT, {})
    assert status == code and orjson.loads(body)["backend"] == a.name
    assert (len(a.requests), len(b.requests)) == (1, 0)


async def test_no_backend_is_409_and_never_a_retried_status(routers) -> None:
    r = routers([])
    status, body = await post(r.base_url() + CHAT, {})
    assert status == 409 and orjson.loads(body)["error"]["type"] == "no_healthy_backend"


async def test_last_backend_failing_reports_500_not_409(engines, routers) -> None:
    (bad,) = await engines(1, mode="status", status=503)
    r = routers([bad.api_url])
    status, body = await post(r.base_url() + CHAT, {})
    assert status == 500 and orjson.loads(body)["error"]["type"] == "backend_status"


async def test_retry_excludes_the_failed_backend_where_the_policy_would_repeat_it(engines, routers) -> None:
    # consistent_hash sends one session to one backend every time: only the exclusion moves the retry
    (bad,) = await engines(1, mode="status", status=503)
    (good,) = await engines(1)
    r = routers([bad.api_url, good.api_url], policy="consistent_hash")
    ring = ConsistentHash()
    load = LoadTracker(r.serving_backends())
    session = next(
        s
        for s in (f"s{i}" for i in range(1000))
        if ring.choose(RouteRequest(CHAT, headers={"X-Session-ID": s}), load) == bad.url
    )
    status, body = await post(r.base_url() + CHAT, {}, headers={"X-Session-ID": session})
    assert status == 200 and orjson.loads(body)["backend"] == good.name
    assert (len(bad.requests), len(good.requests)) == (1, 1)


async def test_timeout_not_retried_when_retry_on_timeout_is_off(engines, routers) -> None:
    (hang,) = await engines(1, mode="hang")
    (good,) = await engines(1)
    r = routers([hang.api_url, good.api_url], backend_timeout_s=0.3, retry_on_timeout=False)
    status, body = await post(r.base_url() + CHAT, {})
    assert status == 500 and orjson.loads(body)["error"]["type"] == "backend_timeout"
    assert good.requests == []


async def test_5xx_does_not_eject_a_health_managed_backend(engines, routers) -> None:
    # one poisoned request answered 500 by every engine must not empty the fleet
    a, b = await engines(2, mode="status", status=500)
    r = routers([a.api_url, b.api_url], health_managed=True)
    assert (await post(r.base_url() + CHAT, {}))[0] == 500
    assert sorted(r.serving_backends()) == sorted([a.url, b.url])
    assert r.drain_backend_outcomes() == {a.url: (0, 1), b.url: (0, 1)}  # reported to the controller


# -- item 5: affinity follows the backend that served --------------------------------------------------


async def test_affinity_records_the_retry_target_never_the_failed_backend(engines, routers) -> None:
    (good,) = await engines(1)
    policy = CacheAware(block_bytes=64)
    r = routers([dead_url(), good.api_url], policy=policy)
    dead, live = r.serving_backends()
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]})
    prepared = policy.prepare(RouteRequest(CHAT, body=body))
    policy.commit(prepared, dead)  # an earlier turn went to the backend that is now dead
    assert policy.index.continuation_holders(prepared.features)[0] == (dead,)
    status, reply = await post(r.base_url() + CHAT, body)
    assert status == 200 and orjson.loads(reply)["backend"] == good.name
    assert policy.index.continuation_holders(prepared.features)[0] == (live,)
