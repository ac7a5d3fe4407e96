"""Router hardening (issue 9), the HTTP path: one test per finding, each against real sockets on 127.0.0.1.

The admin surface, health probing, ``RouterConfig`` and secrets have theirs in ``test_router_hardening.py``.

Every test that runs a router runs it twice (the ``workers`` fixture): as one process and with two worker
processes (issue 17). A test that cannot apply to one mode says why.

Sections are owned by area; add to your own section rather than editing another's.
"""

from __future__ import annotations

import asyncio
import gzip
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router import GenerationRouter
from router.config import RouterConfig
from router.http.limits import HttpLimits
from router.policies import (
    CacheAware,
    ConsistentHash,
    LoadTracker,
    NoBackendAvailable,
    RoundRobin,
    RouteRequest,
)
from tests.support.http_backends import (
    FakeEngine,
    dead_url,
    engine_factory,
    router_factory,
    workers_fixture,  # noqa: F401 (the fixture)
)

CHAT = "/v1/chat/completions"

# --- HTTP exactness / status contract / affinity ---


@dataclass
class RawBackend:
    """A backend speaking raw bytes: ``answer(head, body)`` returns what to write back (``None``: never
    answer; a list: parts written 0.2 s apart). Records every request (head, body) and when each of its
    connections was closed."""

    answer: Callable[[bytes, bytes], bytes | list[bytes] | None]
    requests: list[tuple[bytes, bytes]] = field(default_factory=list)
    connections: int = 0
    close_after: bool = False  # close the connection after each answer
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    server: asyncio.Server | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
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
                if self.close_after:
                    break
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

    async def make(
        answer: Callable[[bytes, bytes], bytes | list[bytes] | None], close_after: bool = False
    ) -> RawBackend:
        b = await RawBackend(answer, close_after=close_after).start()
        made.append(b)
        return b

    yield make
    for b in made:
        await b.stop()


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., Awaitable[list[FakeEngine]]]]:
    async with engine_factory(FakeEngine, 1) as make:
        yield make


# A policy object lives in one process: with worker processes the router builds its own from the config
# (GenerationRouter refuses an injected one). The tests that inject or inspect the object therefore run
# with one process only (parametrized so, not skipped: in CI nothing may skip).
ONE_PROCESS = pytest.mark.parametrize("workers", [1], ids=["one-process"])


@pytest.fixture
def routers(workers: int) -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(policy="round_robin", probe_interval_s=0, workers=workers) as base:

        def make(backends: list[str], limits: HttpLimits | None = None, **kwargs: object) -> GenerationRouter:
            """A router on an OS-chosen port with the serving set as given: active probing off, so the
            forwarding path alone decides what these tests see (the prober has its own tests)."""
            if limits is not None:
                kwargs["http"] = limits
            return base(backends, **kwargs)

        yield make


async def post(url: str, body: bytes | dict[str, object], **kwargs: object) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        async with s.post(url, data=data, **kwargs) as r:  # type: ignore[arg-type]
            return r.status, await r.read()


async def metric_samples(
    router: GenerationRouter, family: str, sample: str | None = None, path: str = "/metrics"
) -> dict[tuple[tuple[str, str], ...], float]:
    """Samples of one metric family by their labels (only the sample named ``sample`` if given), from
    ``path`` (``/fleet/metrics``: the per-consumer families, the owner's; open on these routers)."""
    async with aiohttp.ClientSession() as s, s.get(router.base_url() + path) as resp:
        text = await resp.text()
    for f in text_string_to_metric_families(text):
        if f.name == family:
            return {
                tuple(sorted(x.labels.items())): x.value
                for x in f.samples
                if not x.name.endswith("_created") and (sample is None or x.name == sample)
            }
    return {}


async def outcomes(
    router: GenerationRouter, done: Callable[[dict[str, tuple[int, int]]], bool], within_s: float = 5.0
) -> dict[str, tuple[int, int]]:
    """The router's per-backend outcomes, drained until ``done`` holds for their sum (bounded). A worker
    process reports an attempt's outcome to the router process in a one-way message after answering
    its client, so it can land a moment after the answer; in one process it is there at once."""
    total: dict[str, tuple[int, int]] = {}
    deadline = time.monotonic() + within_s
    while True:
        for url, (ok, failed) in router.drain_backend_outcomes().items():
            before = total.get(url, (0, 0))
            total[url] = (before[0] + ok, before[1] + failed)
        if done(total) or time.monotonic() > deadline:
            return total
        await asyncio.sleep(0.02)


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


async def test_half_open_connection_flood_is_capped_and_timed_out(engines, routers, workers: int) -> None:
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
    # Every one closed: above the cap the oldest unauthenticated one makes room for the new (issue 38:
    # a new connection is never refused while one that presented no key could go), the rest at the head
    # deadline.
    assert all(closed) and took < 3
    if workers == 1:
        assert r.connections is not None and r.connections.open == 0
    errors = await metric_samples(r, "rl_router_errors")
    assert (("kind", "connection_cap"),) not in errors
    if workers == 1:
        assert errors[(("kind", "keyless_evicted"),)] == 100.0
        assert errors[(("kind", "head_timeout"),)] == 100.0
    else:
        # Each worker admits its share of the cap (50) and the kernel decides which worker accepts each
        # connection: at least the configured 100 are closed for newer ones, and every connection was
        # either closed so or timed out. The gates are the workers' (the router process has none to read).
        evicted = errors[(("kind", "keyless_evicted"),)]
        assert evicted >= 100.0 and evicted + errors[(("kind", "head_timeout"),)] == 200.0
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


def test_open_file_soft_limit_is_raised_toward_the_hard_limit(workers: int) -> None:
    # With workers, the processes that accept client connections are the workers: their limit is read.
    code = (
        "import resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "from router import GenerationRouter, RouterConfig\n"
        f"r = GenerationRouter(RouterConfig(port=0, workers={workers}, insecure_admin=True))\n"
        "r.serve_in_background()\n"
        "def soft_of(pid):\n"
        "    line = next(l for l in open(f'/proc/{pid}/limits') if l.startswith('Max open files'))\n"
        "    return int(line.split()[3])\n"
        "nows = [soft_of(p) for p in r.worker_pids()] or [resource.getrlimit(resource.RLIMIT_NOFILE)[0]]\n"
        "r.stop()\n"
        "print(all(now == hard or hard == resource.RLIM_INFINITY and now > 256 for now in nows))\n"
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


@pytest.mark.parametrize("code", [400, 401, 404, 408, 413, 422, 429, 499])
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
    assert await metric_samples(r, "rl_router_errors") == {(("kind", "no_backend"),): 1.0}
    assert await metric_samples(r, "rl_router_requests") == {(("route", CHAT), ("status", "409")): 1.0}


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
    # Nor count against either engine's health (issue 28): it failed on both, so it is the request's,
    # counted against its consumer. The count is read through /fleet/metrics (the per-consumer families
    # are the owner's, issue 38), after the failures' frames in worker mode (same channel, in order), so
    # an empty drain is not a frame still on its way.
    family, sample = "rl_router_consumer_poisoned", "rl_router_consumer_poisoned_total"
    assert await metric_samples(r, family, sample, "/fleet/metrics") == {(("consumer", "owner"),): 1.0}
    assert r.drain_backend_outcomes() == {}


# -- item 5: affinity follows the backend that served --------------------------------------------------


@ONE_PROCESS
async def test_affinity_records_the_retry_target_never_the_failed_backend(engines, routers, workers) -> None:
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


# -- item 9: the heart, pinned with literal expected values (mutation-tested) -------------------------


def test_never_answer_set_is_literal() -> None:
    from router.http.status import validate_no_healthy_status

    for retried in (404, 408, 429, 500, 502, 503, 504, 520):
        with pytest.raises(ValueError, match=f"={retried} is retried by clients"):
            validate_no_healthy_status(retried)
    for outside in (501, 599, 200, 302, 399, 600, 0):
        with pytest.raises(ValueError, match=f"={outside} must be a 4xx"):
            validate_no_healthy_status(outside)
    for usable in (400, 409, 410, 418, 422, 451, 499):
        assert validate_no_healthy_status(usable) == usable
    for not_int in (True, 409.0, "409", None):
        with pytest.raises(ValueError, match="integer"):
            validate_no_healthy_status(not_int)  # type: ignore[arg-type]


def test_error_shapes_are_literal() -> None:
    from router.http.status import (
        BACKEND_FAILURE_STATUS,
        DEFAULT_NO_HEALTHY_BACKEND_STATUS,
        error_body,
        sse_error_event,
    )

    assert (BACKEND_FAILURE_STATUS, DEFAULT_NO_HEALTHY_BACKEND_STATUS) == (500, 409)
    assert error_body("m", "k", 409) == b'{"error":{"message":"m","type":"k","code":409},"router":true}'
    assert (
        sse_error_event("m", "k")
        == b'event: error\ndata: {"error":{"message":"m","type":"k","code":500}}\n\n'
    )


def test_load_cap_formula_and_its_edge() -> None:
    policy = CacheAware(load_factor=1.25, load_slack=3)
    assert policy.load_cap(LoadTracker([])) == 5  # ceil(1.25 * 1 / 1) + 3
    load = LoadTracker(["a", "b", "c", "d"])
    assert policy.load_cap(load) == 4  # ceil(1.25 * 1 / 4) + 3
    for url, n in (("a", 6), ("b", 2), ("c", 1), ("d", 1)):
        for _ in range(n):
            load.acquire(url)
    assert policy.load_cap(load) == 7  # ceil(1.25 * 11 / 4) + 3
    body = orjson.dumps({"messages": [{"role": "user", "content": "the session " * 40}]})
    req = policy.prepare(RouteRequest(CHAT, body=body))
    policy.commit(req, "a")
    assert policy.choose(req, load) == "a"  # 6 in flight < 7: affinity
    load.acquire("a")
    assert policy.load_cap(load) == 7  # ceil(1.25 * 12 / 4) + 3
    assert policy.choose(req, load) in ("c", "d")  # 7 in flight is not < 7: least loaded instead
    assert policy.decisions == {"affinity": 1, "balanced": 1, "cold": 0}


def test_byte_cap_formula_and_its_edge() -> None:
    policy = CacheAware(byte_load_factor=1.5)
    assert CacheAware(byte_load_factor=0).byte_cap(LoadTracker(["a"]), 10) is None
    load = LoadTracker(["a", "b", "c", "d"])
    load.acquire("a", 3000)
    assert policy.byte_cap(load, 1000) == 1500.0  # 1.5 * (3000 + 1000) / 4
    body = orjson.dumps({"messages": [{"role": "user", "content": "long context " * 40}]})
    req = policy.prepare(RouteRequest(CHAT, body=body))
    w = len(body)
    for held, expect_affinity in ((w, True), (w + 1, False)):
        load = LoadTracker(["a", "b", "c"])
        load.acquire("a", held)  # byte cap = 1.5 * (held + w) / 3: exactly `held` when held == w
        policy.commit(req, "a")
        chosen = policy.choose(req, load)
        assert (chosen == "a") is expect_affinity, (held, chosen)


def test_choose_excludes_failed_holders_and_records_nothing() -> None:
    policy = CacheAware()
    load = LoadTracker(["a", "b"])
    body = orjson.dumps({"messages": [{"role": "user", "content": "x" * 3000}]})
    req = policy.prepare(RouteRequest(CHAT, body=body))
    policy.choose(req, load)
    assert len(policy.index) == 0  # choose decides only
    policy.commit(req, "a")
    assert policy.choose(req, load) == "a"
    assert policy.choose(req, load, frozenset({"a"})) == "b"
    policy.commit(req, "b")
    assert policy.index.continuation_holders(req.features) == (("b", "a"), 3)
    policy.retract(req, "b")
    assert policy.index.continuation_holders(req.features) == (("a",), 3)
    policy.retract(req, "a")
    assert len(policy.index) == 0 and policy.index.continuation_holders(req.features) == ((), 0)


def test_prompt_start_literal_offsets() -> None:
    from router.policies.prefix_index import prompt_start

    assert prompt_start(b'{"note":"a\\"messages","messages":[{"role":"user"}]}') == 22  # escaped key skipped
    assert prompt_start(b'{"note":"a\\"messages"}') == 0  # only the escaped one: none
    assert prompt_start(b'{"model":"m","prompt":"p","messages":[]}') == 13  # the earliest key
    assert prompt_start(b'{"model":"m","input":"i"}') == 13
    assert prompt_start(b'{"model":"m"}') == 0


def test_block_hashes_message_boundaries_and_fixed_blocks() -> None:
    from router.policies.prefix_index import block_hashes

    chat = b'{"messages":[{"a":1}, \n {"b":2} ],"max_tokens":4}'
    assert block_hashes(chat, 1024, 1) == [hash((0, chat[1:19])), hash((hash((0, chat[1:19])), chat[19:30]))]
    h1 = hash((0, chat[1:9]))
    assert block_hashes(chat, 8, 1)[:3] == [
        h1,
        hash((h1, chat[9:17])),
        hash((hash((h1, chat[9:17])), chat[17:19])),
    ]
    assert len(block_hashes(chat, 8, 1)) == 5  # 8 + 8 + 2 up to the first boundary, 8 + 3 to the second
    assert len(block_hashes(chat, 8, 1, max_blocks=2)) == 2
    prompt = b'{"model":"m","prompt":"' + b"x" * 50 + b'"}'  # completions: no boundary, fixed blocks
    a = hash((0, prompt[13:29]))
    b = hash((a, prompt[29:45]))
    assert block_hashes(prompt, 16, 13) == [a, b, hash((b, prompt[45:61]))]  # partial last block dropped
    assert block_hashes(prompt, 16, 13, max_blocks=1) == [a]
    assert block_hashes(b'{"prompt":"short"}', 64, 1) == []


def test_prefix_index_literal_behaviour() -> None:
    from router.policies.prefix_index import ENTRY_BYTES, PrefixIndex

    assert ENTRY_BYTES == 200  # the measured estimate the byte budget is converted with
    index = PrefixIndex(max_bytes=800, holders_per_block=2)
    assert index.max_entries == 4
    index.record([11, 12, 13], "a")
    assert index.continuation_holders([11, 12, 13]) == (("a",), 3)  # an exact repeat
    assert index.continuation_holders([11, 12, 13, 14]) == (("a",), 3)  # continues after a leaf
    assert index.continuation_holders([11, 12, 99]) == ((), 2)  # diverges: merely shares a prefix
    assert index.continuation_holders([99]) == ((), 0)
    index.record([11, 12, 13], "b")
    index.record([11, 12, 13], "c")
    assert index.continuation_holders([11, 12, 13]) == (("c", "b"), 3)  # at most 2 holders, newest first
    index.record([11, 12, 14], "d")  # block 12 now has two continuations
    assert index.continuation_holders([11, 12]) == (("d", "c"), 2)
    assert index.continuation_holders([11, 12, 15]) == ((), 2)
    assert (len(index), index.evictions, index.approx_bytes) == (4, 0, 800)
    index.record([21], "e")  # the least recently used entry (13) goes
    assert (len(index), index.evictions) == (4, 1)
    assert index.continuation_holders([11, 12, 13]) == ((), 2)
    index.discard([11, 12], "d")
    assert index.continuation_holders([11, 12]) == (("c",), 2)
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixIndex(max_bytes=199)
    assert PrefixIndex(max_bytes=200).max_entries == 1
    with pytest.raises(ValueError, match="holders_per_block"):
        PrefixIndex(holders_per_block=0)


async def test_in_flight_counts_request_and_bytes_until_it_ends(raw_backends, routers) -> None:
    hang = await raw_backends(lambda head, body: None)
    r = routers([hang.url + "/v1"], backend_timeout_s=5)
    task = asyncio.create_task(post(r.base_url() + CHAT, b"x" * 1000))
    for _ in range(100):
        if hang.requests:
            break
        await asyncio.sleep(0.02)
    assert r.in_flight() == {hang.url: 1}
    assert r.backends.load.bytes_in_flight(hang.url) == 1000
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.wait_for(hang.closed.wait(), 2)
    await asyncio.sleep(0.05)
    assert r.in_flight() == {hang.url: 0} and r.backends.load.bytes_in_flight(hang.url) == 0


async def test_retry_is_counted_and_both_counts_released(engines, routers) -> None:
    (bad,) = await engines(1, mode="status", status=503)
    (good,) = await engines(1)
    r = routers([bad.api_url, good.api_url])
    status, _ = await post(r.base_url() + CHAT, b"y" * 300)
    assert status == 200
    assert r.in_flight() == {bad.url: 0, good.url: 0}
    assert r.backends.load.total_bytes_in_flight == 0
    assert await metric_samples(r, "rl_router_retries") == {(): 1.0}
    assert await metric_samples(r, "rl_router_policy_decisions") == {(("policy", "round_robin"),): 2.0}
    errors = await metric_samples(r, "rl_router_errors")
    assert errors == {(("kind", "status"),): 1.0}


def test_cache_aware_options_defaults_and_edges_are_literal() -> None:
    p = CacheAware()
    assert (p.block_bytes, p.load_factor, p.load_slack, p.byte_load_factor, p.max_blocks) == (
        1024,
        1.25,
        3,
        1.5,
        8192,
    )
    assert (p.index.max_bytes, p.index.holders_per_block) == (64 * 1024 * 1024, 4)
    edge = CacheAware(
        block_bytes=16, load_factor=1.0, load_slack=1, byte_load_factor=1.0, max_prompt_bytes=100
    )
    assert (edge.block_bytes, edge.max_blocks) == (16, 6)
    assert CacheAware(byte_load_factor=0).byte_load_factor == 0
    for bad, field_name in (
        ({"block_bytes": 15}, "block_bytes"),
        ({"load_factor": 0.99}, "load_factor"),
        ({"load_slack": 0}, "load_slack"),
        ({"byte_load_factor": 0.99}, "byte_load_factor"),
    ):
        with pytest.raises(ValueError, match=field_name):
            CacheAware(**bad)  # type: ignore[arg-type]
    assert p.stats() == {
        "index_entries": 0.0,
        "index_bytes": 0.0,
        "index_evictions": 0.0,
        "decisions_affinity": 0.0,
        "decisions_balanced": 0.0,
        "decisions_cold": 0.0,
    }


def test_cache_aware_cold_and_balanced_decisions_are_counted() -> None:
    policy = CacheAware(block_bytes=64)
    load = LoadTracker(["a", "b"])
    assert policy.choose(RouteRequest(CHAT, body=b""), load) in ("a", "b")  # nothing to hash: cold
    body = orjson.dumps({"messages": [{"role": "user", "content": "z" * 300}]})
    req = policy.prepare(RouteRequest(CHAT, body=body))
    policy.choose(req, load)  # never seen: cold
    policy.commit(req, "a")
    for _ in range(8):
        load.acquire("a")  # cap = ceil(1.25 * 9 / 2) + 3 = 9 > 8: still under
    assert policy.choose(req, load) == "a"
    load.acquire("a")  # 9 in flight, cap = ceil(1.25 * 10 / 2) + 3 = 10 > 9: under
    assert policy.choose(req, load) == "a"
    for _ in range(3):
        load.acquire("a")  # 12 in flight, cap = ceil(1.25 * 13 / 2) + 3 = 12: not under
    assert policy.choose(req, load) == "b"
    assert policy.decisions == {"affinity": 2, "balanced": 1, "cold": 2}
    stats = policy.stats()
    assert (stats["decisions_affinity"], stats["decisions_balanced"], stats["decisions_cold"]) == (
        2.0,
        1.0,
        2.0,
    )
    assert (stats["index_entries"], stats["index_bytes"]) == (
        float(len(policy.index)),
        200.0 * len(policy.index),
    )
    with pytest.raises(NoBackendAvailable):
        policy.choose(req, LoadTracker([]))


def test_message_boundaries_only_between_message_objects() -> None:
    from router.policies.prefix_index import PrefixIndex, _boundaries, block_hashes

    assert _boundaries(b'{"messages":[{"a":{"b":1}},{"c":2}]}', 1) == [25, 33]  # nested: the outer "}"
    assert _boundaries(b'{"messages":[{"a":1},"x"]}', 1) == []  # "}," then no "{": not a boundary
    assert _boundaries(b'{"messages":[{"a":1}, ', 1) == []  # truncated after the comma
    assert _boundaries(b'{"messages":[{"a":1}  ', 1) == []  # truncated after the brace
    body = b'{"prompt":"' + b"y" * 40 + b'"}'
    assert block_hashes(body, 16) == block_hashes(body, 16, 0)  # start defaults to the first byte
    assert len(block_hashes(body, 16)) == 3
    assert PrefixIndex().max_bytes == 67108864 and PrefixIndex().holders_per_block == 4
    one = PrefixIndex(holders_per_block=1)
    one.record([5], "a")
    one.record([5], "b")
    assert one.continuation_holders([5]) == (("b",), 1)


def test_prefix_index_record_and_discard_edges() -> None:
    from router.policies.prefix_index import PrefixIndex

    index = PrefixIndex(holders_per_block=3)
    index.record([11, 12, 13], "a")
    index.record([11, 12, 13, 16], "a")  # the same backend's next turn: 13 stops being a leaf
    assert index.continuation_holders([11, 12, 13, 17]) == ((), 3)
    assert index.continuation_holders([11, 12, 13, 16, 18]) == (("a",), 4)
    index.record([31], "a")
    index.record([31], "b")
    index.record([31], "a")
    assert index.continuation_holders([31]) == (("a", "b"), 1)  # most recent first
    index.record([31], "c")
    index.discard([31], "a")  # not the newest holder
    assert index.continuation_holders([31, 32]) == (("c", "b"), 1)  # still a leaf, continued
    index.discard([999], "a")  # unknown block: nothing to do
    index.discard([31], "zzz")
    assert index.continuation_holders([31]) == (("c", "b"), 1)
    lru = PrefixIndex(max_bytes=600)  # 3 entries
    lru.record([1], "a")
    lru.record([2], "a")
    lru.record([1], "a")  # refreshes 1 (the fast path)
    lru.record([3], "a")
    lru.record([4], "a")  # evicts the least recently used: 2
    assert lru.continuation_holders([1]) == (("a",), 1)
    assert lru.continuation_holders([2]) == ((), 0)
    assert lru.evictions == 1


def test_cache_aware_single_backend_and_prepared_requests() -> None:
    policy = CacheAware()
    one = LoadTracker(["a"])
    one.acquire("a", 100)
    assert policy.byte_cap(one, 50) == 225.0  # 1.5 * (100 + 50) / 1
    assert policy.byte_cap(LoadTracker([]), 10) == 15.0  # an empty fleet divides by one, not zero
    assert policy.load_cap(one) == 6  # ceil(1.25 * 2 / 1) + 3
    body = orjson.dumps({"messages": [{"role": "user", "content": "q" * 2000}]})
    prepared = policy.prepare(RouteRequest(CHAT, body=body))
    assert policy.prepare(prepared) is prepared  # features are computed once
    assert policy.choose(prepared, one) == "a"


class ExplodingPolicy(RoundRobin):
    def choose(self, request: RouteRequest, load: LoadTracker, exclude: frozenset[str] = frozenset()) -> str:
        raise RuntimeError("a bug in a policy")


@ONE_PROCESS
async def test_an_escaping_error_is_counted_as_the_500_sent(engines, routers, workers: int) -> None:
    (e,) = await engines(1)
    r = routers([e.api_url], policy=ExplodingPolicy())
    status, _ = await post(r.base_url() + CHAT, {})
    assert status == 500
    assert await metric_samples(r, "rl_router_requests") == {(("route", CHAT), ("status", "500")): 1.0}


async def test_success_is_recorded_and_timed_for_every_response_shape(engines, raw_backends, routers) -> None:
    big = b"b" * 300_000  # above the small-response size: streamed, with its length
    plain = await raw_backends(lambda head, body: b"HTTP/1.1 200 OK\r\nContent-Length: 300000\r\n\r\n" + big)
    (e,) = await engines(1)
    r = routers([plain.url + "/v1", e.api_url])
    async with aiohttp.ClientSession() as s:
        async with s.post(r.base_url() + CHAT, data=b"{}") as resp:
            assert resp.status == 200 and resp.headers["Content-Length"] == "300000"
            assert await resp.read() == big
        async with s.post(r.base_url() + CHAT, data=b'{"stream": true}') as resp:
            e.release_stream.set()
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    expected = {plain.url: (1, 0), e.url: (1, 0)}
    assert await outcomes(r, lambda got: got == expected) == expected
    latency = await metric_samples(
        r, "rl_router_request_duration_seconds", "rl_router_request_duration_seconds_count"
    )
    assert latency == {(("route", CHAT),): 2.0}
    total = await metric_samples(
        r, "rl_router_request_duration_seconds", "rl_router_request_duration_seconds_sum"
    )
    assert 0 < total[(("route", CHAT),)] < 30
    assert await metric_samples(r, "rl_router_requests") == {(("route", CHAT), ("status", "200")): 2.0}


async def test_plain_body_broken_midway_is_cut_and_counted(raw_backends, routers) -> None:
    short = b"HTTP/1.1 200 OK\r\nContent-Length: 400000\r\n\r\n" + b"c" * 1000
    backend = await raw_backends(lambda head, body: [short, b""])
    r = routers([backend.url + "/v1"])

    async def cut_request() -> None:
        async with aiohttp.ClientSession() as s, s.post(r.base_url() + CHAT, data=b"{}") as resp:
            assert resp.status == 200  # the status line was sent before the body broke
            await resp.read()

    async def close_backend_after_headers() -> None:
        for _ in range(100):
            if backend.requests:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        assert backend.server is not None
        backend.server.close()
        for task in asyncio.all_tasks():
            if task.get_coro().__qualname__.startswith("RawBackend._serve"):  # type: ignore[union-attr]
                task.cancel()

    closer = asyncio.create_task(close_backend_after_headers())
    with pytest.raises(aiohttp.ClientPayloadError):
        await asyncio.wait_for(cut_request(), 10)
    await closer
    assert await metric_samples(r, "rl_router_errors") == {(("kind", "stream_broken"),): 1.0}
    expected = {backend.url: (0, 1)}
    assert await outcomes(r, lambda got: got == expected) == expected


async def test_a_huge_5xx_body_is_quoted_only_in_part(raw_backends, routers) -> None:
    page = b"E" * 1_000_000
    backend = await raw_backends(
        lambda head, body: b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 1000000\r\n\r\n" + page
    )
    r = routers([backend.url + "/v1"], limits=HttpLimits(max_error_body_bytes=100))
    status, body = await post(r.base_url() + CHAT, {})
    assert status == 500
    message = orjson.loads(body)["error"]["message"]
    assert message == f"backend failed: backend {backend.url} answered 503: " + "E" * 100


async def test_unasked_101_and_garbage_are_failed_attempts(raw_backends, routers) -> None:
    upgrade = await raw_backends(
        lambda head, body: b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n"
    )
    garbage = await raw_backends(lambda head, body: b"\x00\x01 this is not HTTP\r\n\r\n")
    r = routers([upgrade.url + "/v1", garbage.url + "/v1"])
    status, body = await post(r.base_url() + CHAT, {})
    assert status == 500 and orjson.loads(body)["error"]["type"] == "backend_reset"
    assert (len(upgrade.requests), len(garbage.requests)) == (1, 1)
    assert await metric_samples(r, "rl_router_errors") == {(("kind", "reset"),): 2.0}


def test_forwarding_and_limit_defaults_are_literal() -> None:
    from router.http.forwarding import ForwardingConfig
    from router.http.limits import DEFAULT_HTTP_LIMITS, effective_connection_cap

    config = ForwardingConfig(backend_timeout_s=1.0, connect_timeout_s=1.0, no_healthy_backend_status=409)
    assert (config.max_attempts, config.retry_on_timeout, config.health_managed) == (2, True, False)
    assert DEFAULT_HTTP_LIMITS == HttpLimits(10.0, 75.0, 8192, 65536, 4096)
    assert effective_connection_cap(DEFAULT_HTTP_LIMITS, 20000) == 8192
    assert effective_connection_cap(DEFAULT_HTTP_LIMITS, 1024) == 384  # (1024 - 256) // 2
    assert effective_connection_cap(DEFAULT_HTTP_LIMITS, 100) == 1
    for bad in ({"head_timeout_s": 0}, {"keepalive_timeout_s": -1}, {"max_client_connections": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            HttpLimits(**bad)  # type: ignore[arg-type]


async def test_upstream_connections_are_kept_alive_and_reused(raw_backends, routers) -> None:
    backend = await raw_backends(lambda head, body: ok_json())
    r = routers([backend.url + "/v1"])
    # One client connection, so one worker process (each has its own upstream pool) serves all three.
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(r.base_url() + CHAT, data=b"{}") as resp:
                assert resp.status == 200
                await resp.read()
    assert (len(backend.requests), backend.connections) == (3, 1)


@pytest.mark.parametrize(("length", "retried"), [(262144, True), (262145, False)])
async def test_a_short_answer_broken_before_relaying_is_retried(
    raw_backends, engines, routers, length: int, retried: bool
) -> None:
    # up to 256 KiB with a known length is read whole before the client sees anything: still retryable
    partial = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % length + b"p" * 100
    bad = await raw_backends(lambda head, body: partial, close_after=True)
    (good,) = await engines(1)
    r = routers([bad.url + "/v1", good.api_url])
    if retried:
        status, body = await post(r.base_url() + CHAT, {})
        assert status == 200 and orjson.loads(body)["backend"] == good.name
    else:
        with pytest.raises(aiohttp.ClientPayloadError):
            await post(r.base_url() + CHAT, {})
        assert good.requests == []
    assert (await outcomes(r, lambda got: got.get(bad.url) == (0, 1))).get(bad.url) == (0, 1)


@ONE_PROCESS
async def test_a_stream_broken_midway_drops_its_affinity(engines, routers, workers: int) -> None:
    import json

    (e,) = await engines(1, mode="break_stream")
    policy = CacheAware(block_bytes=64)
    r = routers([e.api_url], policy=policy)
    body = json.dumps({"messages": [{"role": "user", "content": "s" * 300}], "stream": True}).encode()
    async with aiohttp.ClientSession() as s, s.post(r.base_url() + CHAT, data=body) as resp:
        assert resp.status == 200
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        e.release_stream.set()
        assert (await asyncio.wait_for(resp.content.read(), 5)).startswith(b"event: error")
    features = policy.prepare(RouteRequest(CHAT, body=body)).features
    assert policy.index.continuation_holders(features) == ((), 0)
    assert await metric_samples(r, "rl_router_requests") == {(("route", CHAT), ("status", "200")): 1.0}
    assert await metric_samples(r, "rl_router_errors") == {(("kind", "stream_broken"),): 1.0}


async def test_stopping_the_router_closes_its_upstream_connections(raw_backends, workers: int) -> None:
    backend = await raw_backends(lambda head, body: ok_json())
    config = RouterConfig(port=0, probe_interval_s=0, workers=workers, insecure_admin=True)
    r = GenerationRouter(config, [backend.url + "/v1"])
    r.serve_in_background()
    try:
        assert (await post(r.base_url() + CHAT, {}))[0] == 200
        await asyncio.sleep(0.1)
        assert not backend.closed.is_set()  # kept alive for the next request
    finally:
        r.stop()
    await asyncio.wait_for(backend.closed.wait(), 3)


# -- issue 17: no way in without the job's secrets (the HTTP path) -----------------------------------------
HELD = 8  # the connection cap in the lockout tests, and the connections the attacker holds


async def hold_slot(port: int, head: bytes, stop: asyncio.Event) -> asyncio.Task[None] | None:
    """Open a connection, send ``head`` and the first byte of its body, and trickle one more byte every
    0.2 s until ``stop`` or the router closes it (a write then fails); None when the router refused the
    connection at its cap."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + b"{")
        await writer.drain()
    except OSError:
        return None
    if await is_closed(reader, 0.3):  # an answer may come at once (/health); a close means refused
        writer.close()
        return None

    async def trickle() -> None:
        try:
            while not stop.is_set():
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.2)
        except OSError:
            pass
        finally:
            writer.close()

    return asyncio.create_task(trickle())


async def health_answered(port: int) -> bool:
    """A real client: one GET /health on a fresh connection, answered 200 within 1 s."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        line = await asyncio.wait_for(reader.readline(), 1.0)
        return line.startswith(b"HTTP/1.1 200")
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()


@pytest.mark.parametrize("route", ["GET /health", "POST /workers", f"POST {CHAT}"])
async def test_trickled_bodies_hold_a_connection_only_until_the_body_deadline(
    engines, routers, route: str
) -> None:
    """Issue 17: with worker processes every open route relayed its body, read whole with no deadline,
    so eight connections trickling a body to /health locked real clients out for good (one process:
    10 s, aiohttp's drain time); a proxied route read its body with no deadline in either mode. Now a
    body is read within ``body_timeout_s`` (408) and an unread one drained for at most as long: every
    trickling connection is closed by the router within twice the deadline. And since issue 38 they lock
    nobody out meanwhile: presenting no key they are closed to make room for a new connection (and those
    whose route has no check are keyed, within the keyed pool, which leaves the keyless one free)."""
    (e,) = await engines(1)
    body_timeout_s = 2.0
    limits = HttpLimits(max_client_connections=HELD, body_timeout_s=body_timeout_s)
    r = routers([e.api_url], limits=limits, admin_token="admin-key")  # /workers: refused before its body
    method, path = route.split()
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 100000000\r\n\r\n"
    ).encode()
    stop = asyncio.Event()
    held: list[asyncio.Task[None]] = []
    try:
        # Each process admits its share of the cap, and the kernel hands a connection on the shared socket
        # to whichever process accepts first. A refused connection is retried after a pause, within half
        # the body deadline (bounded in count and time).
        hold_until = time.monotonic() + body_timeout_s / 2
        for _ in range(200):
            task = await hold_slot(r.port, head, stop)
            if task is not None:
                held.append(task)
            if len(held) == HELD or time.monotonic() > hold_until:
                break
            if task is None:
                await asyncio.sleep(0.02)
        assert len(held) == HELD, f"only {len(held)} connections held"
        t0 = time.monotonic()
        assert await health_answered(r.port), "a real client was locked out"
        # Read within the deadline (408 and a close), or drained for at most the deadline: 2x, plus slack.
        _, still_open = await asyncio.wait(held, timeout=2 * body_timeout_s + 2.0)
        took = time.monotonic() - t0
    finally:
        stop.set()
        await asyncio.gather(*held, return_exceptions=True)
    assert not still_open, f"{len(still_open)} trickling connections still open after {took:.1f} s"


def reset_peak_rss(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current size


def rss_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


async def send_body(port: int, head: bytes, size: int) -> bytes:
    """Send ``head`` and ``size`` bytes of body from one 1 MiB buffer (the sender holds no copy of the
    body); returns the status line answered ('' if the router closed first)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    chunk = bytes(1 << 20)
    try:
        writer.write(head)
        sent = 0
        while sent < size:
            writer.write(chunk[: size - sent])
            sent += len(chunk)
            await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 20)
    except (OSError, TimeoutError):
        line = b""
    finally:
        writer.close()
    return line.strip()


@pytest.mark.parametrize(("route", "answer"), [("GET /health", b"200"), ("POST /workers", b"413")])
async def test_big_bodies_to_routes_that_take_none_cost_no_memory(engines, routers, route, answer) -> None:
    """Issue 17: four 60 MB bodies to /health cost a router with worker processes 500 MB (relayed whole,
    read twice), and to an admin route with the token any router as much (read whole before the handler
    looked at it). Now an open route's body is drained unread, and an admin body above 1 MiB is refused
    before a byte of it is read. Peak RSS of every router process, the test process included (a
    one-process router runs in it)."""
    (e,) = await engines(1)
    r = routers([e.api_url], admin_token="admin-key")
    method, path = route.split()
    size = 60 * 1024 * 1024
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer admin-key\r\nContent-Length: {size}\r\n\r\n"
    ).encode()
    pids = [os.getpid(), *(await asyncio.to_thread(r.worker_pids))]
    before = sum(rss_kib(p, "VmRSS") for p in pids)
    for p in pids:
        reset_peak_rss(p)
    lines = await asyncio.gather(*(send_body(r.port, head, size) for _ in range(4)))
    grew_mib = (sum(rss_kib(p, "VmHWM") for p in pids) - before) / 1024
    assert all(line == b"" or line.split()[1] == answer for line in lines), lines
    assert any(lines), lines  # at least one answer was read back
    assert grew_mib < 40, f"the router's processes grew by {grew_mib:.0f} MiB for 4 x 60 MB bodies"
    assert (await post(r.base_url() + CHAT, {}))[0] == 200


def misbehaving(shape: str) -> Callable[[bytes, bytes], bytes | list[bytes]]:
    """A backend whose first answer is followed by bytes beyond its end (``shape``); later answers are
    ``{"n": <request number>}``."""
    smuggled = ok_json(b'{"smuggled":1}')
    chunked = b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n7\r\n{"n":1}\r\n0\r\n\r\n'
    first = {
        "length": ok_json(b'{"n":1}') + smuggled,  # more than Content-Length, in the same write
        "chunked": chunked + smuggled,  # after the last chunk
        "no_body": b"HTTP/1.1 204 No Content\r\n\r\n" + smuggled,  # a 204 has no body at all
        "later": [ok_json(b'{"n":1}'), smuggled],  # 0.2 s later, while the connection is idle
    }[shape]
    count = 0

    def answer(head: bytes, body: bytes) -> bytes | list[bytes]:
        nonlocal count
        count += 1
        return first if count == 1 else ok_json(b'{"n":%d}' % count)

    return answer


@pytest.mark.parametrize("shape", ["length", "chunked", "no_body", "later"])
async def test_bytes_beyond_a_backend_answer_reach_no_client(raw_backends, routers, shape: str) -> None:
    """Issue 17: the upstream pool parsed bytes after a complete answer as a further answer: appended
    to the body the client got (a 204 was answered with them), or, arriving while the connection sat
    in the pool, read by whichever request used it next. Now they close the connection."""
    backend = await raw_backends(misbehaving(shape))
    r = routers([backend.url + "/v1"])
    # One client connection: one worker process (one upstream pool) serves both requests.
    async with aiohttp.ClientSession() as s:
        async with s.post(r.base_url() + CHAT, data=b"{}") as resp:
            first = (resp.status, await resp.read())
        await asyncio.sleep(0.5)  # "later": the extra bytes arrive while the connection is idle
        async with s.post(r.base_url() + CHAT, data=b"{}") as resp:
            second = (resp.status, await resp.read())
    assert first == ((204, b"") if shape == "no_body" else (200, b'{"n":1}'))
    assert second == (200, b'{"n":2}')
    assert backend.connections == 2  # the first connection was closed, never reused
