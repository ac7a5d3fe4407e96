"""Connections that never present a key cannot lock consumers out (issue 38, finding 4).

Another local user, with no key, held every client connection the router admits (idle keep-alive
``/health`` connections) and each consumer's next connection was closed at accept. Here that user is a
real second Unix user (``tests.support.other_user``) running a bounded flood script as itself, against a
real router on 127.0.0.1 (OS-chosen port) in front of the simulated engines, as one process and with two
worker processes (the ``workers`` fixture). The consumer's requests meanwhile must all be answered 200.

Also: a bad key closes its connection; an unauthenticated kept-alive connection is closed after the short
keyless idle deadline and after its bounded number of requests, while an authenticated one keeps the long
keep-alive. Every loop is bounded in count and time; files are written under ``tmp_path`` only.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router import GenerationRouter
from router.consumers import add_consumer, new_key
from router.http.limits import HttpLimits, keyless_pool
from router.prometheus import metric_by_label, parse_metrics
from tests.support.http_backends import (
    router_factory,
    workers_fixture,  # noqa: F401 (the fixture)
)
from tests.support.keyless_flood import start_flood
from tests.support.other_user import other_user

OWNER_KEY = "owner-key-" + "k" * 20
ADMIN_TOKEN = "admin-token-" + "t" * 20
COMPLETIONS = "/v1/completions"
CAP = 64  # the finding's router.http.max_client_connections


@pytest.fixture
def routers(workers: int) -> Iterator[Any]:
    with router_factory(
        policy="round_robin", probe_interval_s=0, api_key=OWNER_KEY, admin_token=ADMIN_TOKEN, workers=workers
    ) as make:
        yield make


@pytest.fixture
def consumer(tmp_path: Path) -> tuple[str, str]:
    """The consumers file (one consumer, C) and C's client key."""
    path = tmp_path / "consumers.json"
    key = new_key()
    add_consumer(path, "C", key)
    return str(path), key


async def generate(base: str, key: str, session: aiohttp.ClientSession | None = None) -> str:
    """One generation request: its status, or the exception's name when no answer came."""
    body = {"model": "sim", "prompt": "hello", "max_tokens": 2}
    headers = {"Authorization": f"Bearer {key}"}
    try:
        if session is not None:
            async with session.post(base + COMPLETIONS, json=body, headers=headers) as r:
                await r.read()
                return str(r.status)
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=10)
        ) as s:
            async with s.post(base + COMPLETIONS, json=body, headers=headers) as r:
                await r.read()
                return str(r.status)
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return type(exc).__name__


async def error_kinds(r: GenerationRouter) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(r.base_url() + "/metrics") as resp:
        text = await resp.text()
    return metric_by_label(parse_metrics(text, ("rl_router_errors",)), "rl_router_errors_total", "kind")


async def test_another_users_idle_keyless_connections_leave_consumers_served(
    sims, routers, consumer, workers: int
) -> None:
    """The finding's attack: the other user holds as many idle keep-alive /health connections as it can
    (up to 2 x the cap, 10 s), and the consumer sends a generation request every 0.25 s, each on a new
    connection, plus one on a kept-alive session: every one is answered 200."""
    probe = other_user()
    path, key = consumer
    es = await sims(2)
    r = routers([e.url + "/v1" for e in es], consumers_file=path, http={"max_client_connections": CAP})
    base = r.base_url()
    assert await generate(base, key) == "200"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as kept:
        assert await generate(base, key, kept) == "200"  # a consumer's kept-alive connection, made first
        flood = await start_flood(probe, r.port, 2 * CAP, 10)
        try:
            assert flood.stdout is not None
            first = json.loads(await asyncio.wait_for(flood.stdout.readline(), 30))
            print(f"\nflood (workers={workers}): {first}")
            statuses: list[str] = []
            t0 = time.monotonic()
            while time.monotonic() - t0 < 6 and len(statuses) < 24:
                statuses.append(await generate(base, key))
                statuses.append(await generate(base, key, kept))
                await asyncio.sleep(0.25)
            out, err = await asyncio.wait_for(flood.communicate(), 30)
        finally:
            if flood.returncode is None:
                flood.kill()
                await flood.wait()
    rounds = [first] + [json.loads(line) for line in out.decode().splitlines() if line.strip()]
    print("flood rounds:", rounds)
    counts = {s: statuses.count(s) for s in set(statuses)}
    print(f"consumer requests during the flood: {counts}")
    kinds = await error_kinds(r)
    print(f"router errors by kind: {kinds}")
    assert flood.returncode == 0, err.decode()[-2000:]
    assert max(x["held"] for x in rounds) > 0, rounds  # the flood did get connections
    assert counts == {"200": len(statuses)}, counts
    # What the keyless user keeps alive is the keyless pool of each process (4 of 64; 4 of each worker's 32).
    pool = keyless_pool(-(-CAP // workers), HttpLimits().keyless_share) * workers
    assert all(x["held"] <= pool for x in rounds), (pool, rounds)


async def exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> tuple[bytes, bytes]:
    """Send one raw request on a kept-alive connection; its answer's head and body."""
    writer.write(request)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await asyncio.wait_for(reader.readexactly(length), 10)


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Whether the router closes the connection within ``seconds`` (EOF or a reset)."""
    try:
        return await asyncio.wait_for(reader.read(1), seconds) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


def raw(method: str, path: str, key: str | None = None, body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: x"]
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    if body:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


GENERATE = b'{"model": "sim", "prompt": "hi", "max_tokens": 2}'


async def test_a_bad_key_closes_its_connection(sims, routers, consumer, workers: int) -> None:
    """A wrong key (and a missing one) on a client route: 401, ``Connection: close``, and the router
    closes the connection; the consumer's own key keeps its connection alive."""
    path, key = consumer
    es = await sims(1)
    r = routers([e.url + "/v1" for e in es], consumers_file=path)
    for sent in ("not-a-key", None):
        reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
        head, _ = await exchange(reader, writer, raw("POST", COMPLETIONS, sent, GENERATE))
        status_line = head.split(b"\r\n")[0].decode()
        print(f"key {sent!r}: {status_line}, closed: ", end="")
        assert head.startswith(b"HTTP/1.1 401")
        assert b"connection: close" in head.lower()
        closed = await closed_within(reader, 2)
        print(closed)
        assert closed
        writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
    for _ in range(2):
        head, _ = await exchange(reader, writer, raw("POST", COMPLETIONS, key, GENERATE))
        assert head.startswith(b"HTTP/1.1 200") and b"connection: close" not in head.lower()
    assert not await closed_within(reader, 0.5)
    writer.close()


async def test_keyless_connections_have_a_short_idle_deadline_and_few_requests(
    sims, routers, consumer, workers: int
) -> None:
    """``/health`` without a key: closed after ``keyless_idle_timeout_s`` idle and answered
    ``Connection: close`` at its ``keyless_max_requests``-th request; a connection whose request presented
    the consumer's key keeps the full keep-alive (here 30 s) past the keyless deadline."""
    path, key = consumer
    es = await sims(1)
    limits = {"keyless_idle_timeout_s": 0.5, "keyless_max_requests": 3, "keepalive_timeout_s": 30.0}
    r = routers([e.url + "/v1" for e in es], consumers_file=path, http=limits)
    reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
    await exchange(reader, writer, raw("GET", "/health"))
    t0 = time.monotonic()
    assert await closed_within(reader, 3)
    idle_closed_s = time.monotonic() - t0
    print(f"\nkeyless connection closed after {idle_closed_s:.2f} s idle")
    assert 0.3 < idle_closed_s < 2.0
    writer.close()

    reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
    heads = [(await exchange(reader, writer, raw("GET", "/health")))[0] for _ in range(3)]
    assert [b"connection: close" in h.lower() for h in heads] == [False, False, True]
    assert await closed_within(reader, 2)
    writer.close()

    reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
    await exchange(reader, writer, raw("GET", "/health"))  # keyless first, then a key on the same connection
    head, _ = await exchange(reader, writer, raw("POST", COMPLETIONS, key, GENERATE))
    assert head.startswith(b"HTTP/1.1 200")
    for _ in range(5):  # a keyed connection: /health on it counts no keyless request
        await exchange(reader, writer, raw("GET", "/health"))
    assert not await closed_within(reader, 1.5)  # three times the keyless deadline
    writer.close()


async def test_silent_connections_at_the_cap_make_room_for_a_consumer(
    sims, routers, consumer, workers: int
) -> None:
    """The whole cap held by connections that never send a byte: a consumer's new connection closes the
    oldest of them and is answered 200 (``keyless_evicted``); before, it was closed at accept."""
    path, key = consumer
    es = await sims(1)
    r = routers(
        [e.url + "/v1" for e in es],
        consumers_file=path,
        http={
            "max_client_connections": 32,
            "head_timeout_s": 30.0,
        },  # silent for < 3 s: keyless_idle_timeout_s
    )
    conns = [await asyncio.open_connection("127.0.0.1", r.port) for _ in range(40)]
    await asyncio.sleep(0.3)
    statuses = [await generate(r.base_url(), key) for _ in range(5)]
    kinds = await error_kinds(r)
    print(f"\nconsumer behind 40 silent connections (cap 32): {statuses}; errors {kinds}")
    assert statuses == ["200"] * 5
    # 8 past the cap at once; in one process, the consumer's first connection closed one more (with two
    # workers the kernel may hand it to a worker whose share is not full).
    assert kinds.get("keyless_evicted", 0) >= (9 if workers == 1 else 8) and "connection_cap" not in kinds
    for _, writer in conns:
        writer.close()


def test_keyless_pool_defaults_and_edges_are_literal() -> None:
    """5 % of each process's cap, at least 4, at most half (a cap of 1 keeps its one connection for a key)."""
    limits = HttpLimits()
    assert (limits.keyless_share, limits.keyless_idle_timeout_s, limits.keyless_max_requests) == (
        0.05,
        3.0,
        100,
    )
    sizes = {cap: keyless_pool(cap, limits.keyless_share) for cap in (1, 2, 8, 32, 64, 100, 4096, 8192)}
    assert sizes == {1: 0, 2: 1, 8: 4, 32: 4, 64: 4, 100: 5, 4096: 205, 8192: 410}
    for bad in ({"keyless_share": 0.6}, {"keyless_idle_timeout_s": 0}, {"keyless_max_requests": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            HttpLimits(**bad)  # type: ignore[arg-type]
