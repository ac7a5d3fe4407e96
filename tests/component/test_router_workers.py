"""The router with worker processes (``RouterConfig.workers > 1``): real routers on 127.0.0.1.

What must hold with N processes is what holds with one: one port, one routing state (affinity and the
load bound across workers), the admin API acting on that state, metrics summed, the status contract, and
a client that goes away cancelling its request. Which worker accepts a connection is the kernel's choice,
so tests that need two workers to take part send bounded rounds of requests until both have (and fail if
they never do), never sleep for a fixed time.
"""

from __future__ import annotations

import asyncio
import gzip
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from router import GenerationRouter, RouterConfig
from router.http.limits import HttpLimits
from tests.support.http_backends import FakeEngine, dead_url, engine_factory, router_factory
from tests.support.router_metrics import metrics

CHAT = "/v1/chat/completions"
ROUNDS = 30  # bounded: rounds of concurrent requests until both workers have answered some


class SlowEngine(FakeEngine):
    """Answers after a short pause, so that concurrent requests overlap and both workers accept."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.mode == "ok":
            await asyncio.sleep(0.02)
        return await super().handle(request)


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., Awaitable[list[FakeEngine]]]]:
    async with engine_factory(SlowEngine, 2) as make:
        yield make


@pytest.fixture
def routers() -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(probe_interval_s=0, workers=2) as make:
        yield make


async def in_thread(fn: Callable[[], object]) -> object:
    return await asyncio.get_running_loop().run_in_executor(None, fn)


async def post(url: str, body: bytes | dict[str, object], **kwargs: object) -> tuple[int, dict[str, object]]:
    """One request on a connection of its own (a fresh connection may be accepted by any worker)."""
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        async with s.post(url, data=data, **kwargs) as r:  # type: ignore[arg-type]
            raw = await r.read()
            return r.status, (orjson.loads(raw) if raw[:1] == b"{" else {"raw": raw})


def per_worker(m: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in m.items() if k.startswith("rl_router_worker_requests{")}


def chat(session: int, turns: int) -> dict[str, object]:
    """A Gym-shaped body: the whole conversation resent, growing by one exchange per turn."""
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a coding agent. " * 40},
        {"role": "user", "content": f"task {session}: " + "fix the failing test " * 30},
    ]
    for t in range(turns):
        messages.append({"role": "assistant", "content": f"turn {t} of session {session} " * 20})
        messages.append({"role": "user", "content": f"tool output {t} " * 25})
    return {"model": "m", "messages": messages, "logprobs": True}


async def until_both_workers(base: str, send: Callable[[int], Awaitable[None]], per_round: int = 8) -> int:
    """Send rounds of ``per_round`` concurrent requests until both workers have answered one; returns
    how many were sent."""
    sent = 0
    for _ in range(ROUNDS):
        await asyncio.gather(*(send(sent + i) for i in range(per_round)))
        sent += per_round
        if all(v > 0 for v in per_worker(await metrics(base)).values()):
            return sent
    pytest.fail(f"after {sent} requests on fresh connections one worker had still answered none")


async def test_one_port_requests_spread_and_metrics_summed(engines, routers) -> None:
    es = await engines(2)
    r = routers([e.api_url for e in es], policy="round_robin")
    base = r.base_url()
    pids = await in_thread(r.worker_pids)
    assert len(pids) == 2 and all(pids) and os.getpid() not in pids  # type: ignore[arg-type]

    async def send(i: int) -> None:
        status, body = await post(base + CHAT, {"messages": [{"role": "user", "content": f"q{i}"}]})
        assert status == 200 and body["backend"] in ("e0", "e1")

    sent = await until_both_workers(base, send)
    m = await metrics(base)
    # One router, one set of numbers: the workers' counts summed, the state's own gauges once.
    assert m['rl_router_requests_total{route="/v1/chat/completions",status="200"}'] == sent
    assert sum(per_worker(m).values()) == sent
    assert m["rl_router_workers"] == 2
    assert m['rl_router_policy_decisions_total{policy="round_robin"}'] == sent
    assert len(es[0].requests) + len(es[1].requests) == sent


async def test_affinity_across_workers_is_that_of_one_process(engines, routers) -> None:
    es = await engines(4)
    r = routers([e.api_url for e in es], policy="cache_aware")
    base = r.base_url()
    served_by: set[str] = set()
    backends: list[str] = []
    for turn in range(ROUNDS * 2):
        before = per_worker(await metrics(base))
        status, body = await post(base + CHAT, chat(session=7, turns=turn))
        assert status == 200
        backends.append(str(body["backend"]))
        after = per_worker(await metrics(base))
        served_by.update(k for k in after if after[k] != before.get(k, 0))
        if len(served_by) == 2 and turn >= 3:
            break
    assert len(served_by) == 2, "every turn was accepted by the same worker"
    # Every turn of the session went where its first turn went, whichever worker parsed it.
    assert backends == [backends[0]] * len(backends)


async def test_load_bound_counts_every_workers_requests(engines, routers) -> None:
    es = await engines(2, mode="hang")
    options = {"load_factor": 1.0, "load_slack": 1, "byte_load_factor": 0}
    r = routers([e.api_url for e in es], policy="cache_aware", policy_options=options)
    base = r.base_url()
    body = chat(session=1, turns=2)
    tasks: list[asyncio.Task[object]] = []
    for n in range(1, 5):  # identical requests (a GRPO group), each on its own connection, one at a time
        tasks.append(asyncio.create_task(post(base + CHAT, body)))
        deadline = time.monotonic() + 30
        while len(es[0].requests) + len(es[1].requests) < n:
            assert time.monotonic() < deadline, "request never reached a backend"
            await asyncio.sleep(0.01)
    # The cap is ceil(1.0 * (total + 1) / 2) + 1: the holder takes the 1st, 2nd and 3rd; at 3 in flight
    # of 3 the cap is 3 and the 4th goes elsewhere. Per-worker counts would have let the holder take 4.
    assert sorted((await in_thread(r.in_flight)).values()) == [1, 3]  # type: ignore[attr-defined]
    # The clients give up: every upstream request is cancelled, every slot released, nothing retried.
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    deadline = time.monotonic() + 30
    while sum((await in_thread(r.in_flight)).values()) > 0:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "slots of cancelled requests were not released"
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)  # a wrongly retried request would reach an engine now
    assert len(es[0].requests) + len(es[1].requests) == 4


async def test_admin_changes_reach_every_worker(engines, routers) -> None:
    a, b = await engines(2)
    r = routers([a.api_url], policy="least_outstanding")
    base = r.base_url()
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/workers", json={"url": b.url}) as resp:
            assert resp.status == 200
        async with s.delete(base + "/workers/" + a.url) as resp:
            assert resp.status == 200
        async with s.get(base + "/workers") as resp:
            assert (await resp.json())["urls"] == [b.url]

    async def send(i: int) -> None:
        status, body = await post(base + CHAT, {"messages": [{"role": "user", "content": f"q{i}"}]})
        assert (status, body["backend"]) == (200, b.name)

    await until_both_workers(base, send)
    assert await in_thread(r.serving_backends) == [b.url]


async def test_status_contract_with_workers(engines, routers) -> None:
    (live,) = await engines(1)
    (failing,) = await engines(1, mode="status", status=503)
    body = {"messages": [{"role": "user", "content": "x"}]}
    # a refused backend and a live one: the retry goes to the live one
    r = routers([dead_url(), live.api_url], policy="round_robin")
    for _ in range(4):
        status, answer = await post(r.base_url() + CHAT, body)
        assert (status, answer["backend"]) == (200, live.name)
    # a 503 backend alone: retried (nowhere else), answered 500, never 503
    r = routers([failing.api_url], policy="round_robin")
    status, answer = await post(r.base_url() + CHAT, body)
    assert status == 500 and answer["error"]["type"] == "backend_status"  # type: ignore[index]
    # no backend at all: the configured no-healthy status
    r = routers([], policy="round_robin", no_healthy_backend_status=409)
    status, _ = await post(r.base_url() + CHAT, body)
    assert status == 409


async def test_admin_needs_the_token_through_a_worker(engines, routers) -> None:
    (e,) = await engines(1)
    r = routers([e.api_url], api_key="client-key", admin_token="admin-key")
    base = r.base_url()
    status, _ = await post(base + CHAT, {"messages": []}, headers={"Authorization": "Bearer client-key"})
    assert status == 200
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/workers", headers={"Authorization": "Bearer client-key"}) as resp:
            assert resp.status == 401
        async with s.get(base + "/workers", headers={"Authorization": "Bearer admin-key"}) as resp:
            assert resp.status == 200


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


async def test_killed_worker_is_replaced_and_the_port_keeps_answering(engines, routers) -> None:
    es = await engines(2)
    r = routers([e.api_url for e in es], policy="least_outstanding")
    base = r.base_url()
    old = await in_thread(r.worker_pids)
    os.kill(old[0], signal.SIGKILL)  # type: ignore[index]
    deadline = time.monotonic() + 30
    while not _dead(old[0]):  # type: ignore[index]
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    # The port is the parent's: with one worker dead (and while its replacement starts) it answers.
    answered = 0
    while True:
        status, _ = await post(base + CHAT, {"messages": [{"role": "user", "content": "x"}]})
        assert status == 200
        answered += 1
        pids = await in_thread(r.worker_pids)
        replaced = pids[0] not in (0, old[0]) and pids[1] == old[1]  # type: ignore[index]
        if replaced and (await metrics(base))["rl_router_workers"] == 2:
            break
        assert time.monotonic() < deadline + 60, "the dead worker was not replaced"
    assert r.base_url() == base
    m = await metrics(base)
    assert m["rl_router_worker_restarts_total"] == 1
    assert m["rl_router_workers"] == 2


def test_parent_stop_ends_every_worker(routers) -> None:
    r = routers([])
    pids = r.worker_pids()
    r.stop()
    assert all(_dead(p) for p in pids)


def test_workers_that_do_not_start_leave_nothing_behind(monkeypatch) -> None:
    from router.multiprocess.workers import WorkerFleet

    monkeypatch.setattr(WorkerFleet, "start_timeout_s", 0.001)
    config = RouterConfig(host="127.0.0.1", port=0, workers=2, probe_interval_s=0, insecure_admin=True)
    r = GenerationRouter(config)
    fleet = r.workers
    assert fleet is not None
    with pytest.raises(RuntimeError, match="of 2 router worker processes started"):
        r.serve_in_background()
    procs = [p for p in fleet._procs if p is not None]
    assert len(procs) == 2 and all(p.poll() is not None for p in procs)
    assert fleet._dir is not None and not os.path.exists(fleet._dir)


# -- the refit window with workers: one pause gate, held in the parent ----------------------------------
TOKEN = "admin-key"


def sim_chat(content: str) -> dict[str, Any]:
    return {"model": "sim", "messages": [{"role": "user", "content": content}], "max_tokens": 4}


async def admin(base: str, method: str, path: str, token: str | None = TOKEN) -> tuple[int, dict[str, Any]]:
    """One admin call on a connection of its own (so any worker may relay it)."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        async with s.request(method, base + path, headers=headers) as r:
            raw = await r.read()
            return r.status, (orjson.loads(raw) if raw[:1] == b"{" else {"raw": raw})


async def metrics_text(base: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        assert r.status == 200
        return await r.text()


async def until_held(base: str, n: int, within_s: float = 15.0) -> None:
    """Wait (bounded) until the router's one gate holds exactly ``n`` requests."""
    deadline = time.monotonic() + within_s
    while (held := (await metrics(base))["rl_router_held_requests"]) != n:
        assert time.monotonic() < deadline, f"the router holds {held} requests, expected {n}"
        await asyncio.sleep(0.02)


async def test_pause_holds_requests_at_every_worker_and_resume_releases_them(sims, routers) -> None:
    engines = await sims(2)
    r = routers([e.url + "/v1" for e in engines], admin_token=TOKEN, policy="round_robin")
    base = r.base_url()
    start = per_worker(await metrics(base))
    cycles = sent = 0
    # Which worker accepts a fresh connection is the kernel's choice: bounded pause cycles until requests
    # held by the parent's gate were accepted by both workers.
    for cycle in range(5):
        cycles += 1
        status, rep = await admin(base, "POST", "/fleet/pause?mode=keep")
        assert status == 200 and rep["ok"], rep
        assert r.gate.paused and all(e.scheduler.gen_paused for e in engines)
        tasks = [asyncio.create_task(post(base + CHAT, sim_chat(f"c{cycle} r{i}"))) for i in range(8)]
        await until_held(base, 8)  # every one counted by the parent's one gate, none reached an engine
        assert not any(t.done() for t in tasks)
        status, rep = await admin(base, "POST", "/fleet/resume")
        assert status == 200 and rep["result"]["released"] == 8, rep
        for st, body in await asyncio.gather(*tasks):
            assert st == 200 and body["usage"]["completion_tokens"] == 4, body
        sent += 8
        now = per_worker(await metrics(base))
        if len(now) == 2 and all(now[k] > start.get(k, 0) for k in now):
            break
    else:
        pytest.fail(f"after {sent} held requests on fresh connections one worker had still accepted none")
    text = await metrics_text(base)
    # The gate's numbers are the router's: reported once (by the parent), not once per worker.
    for name in ("rl_router_held_requests ", "rl_router_held_total ", "rl_router_fleet_paused "):
        assert sum(line.startswith(name) for line in text.splitlines()) == 1, name
    m = await metrics(base)
    assert (m["rl_router_held_total"], m["rl_router_pauses_total"]) == (sent, cycles)
    assert (m["rl_router_held_refused_total"], m["rl_router_fleet_paused"]) == (0, 0)
    assert sum(r.in_flight().values()) == 0


async def test_pause_bounds_refuse_once_for_the_whole_router(sims, routers) -> None:
    (engine,) = await sims(1)
    r = routers([engine.url + "/v1"], admin_token=TOKEN, pause_max_held=2, pause_max_wait_s=1.5)
    base = r.base_url()
    assert (await admin(base, "POST", "/fleet/pause?mode=keep"))[0] == 200
    held = [asyncio.create_task(post(base + CHAT, sim_chat(f"held {i}"))) for i in range(2)]
    await until_held(base, 2)
    # Over the count bound, whichever worker accepts them: the bound is the router's (2), not 2 per worker.
    for st, body in await asyncio.gather(*(post(base + CHAT, sim_chat(f"over {i}")) for i in range(4))):
        assert st == 409 and body["error"]["type"] == "no_healthy_backend", body
        assert "at most 2 held, each at most 1.5 s" in body["error"]["message"]
    for st, body in await asyncio.gather(*held):  # over the time bound
        assert st == 409 and body["error"]["type"] == "no_healthy_backend", body
    m = await metrics(base)
    assert m["rl_router_held_refused_total"] == 6  # counted once, by the one gate
    assert m['rl_router_errors_total{kind="pause_bound"}'] == 6  # each worker counted its own answers
    assert m["rl_router_held_total"] == 2
    assert m['rl_router_requests_total{route="/v1/chat/completions",status="409"}'] == 6
    status, rep = await admin(base, "POST", "/fleet/resume")
    assert status == 200 and rep["result"]["released"] == 0
    assert (await post(base + CHAT, sim_chat("after")))[0] == 200
    assert engine.stats.e2e.count == 1  # only the request after resume reached the engine


async def test_a_held_request_whose_client_leaves_is_withdrawn(sims, routers) -> None:
    (engine,) = await sims(1)
    r = routers([engine.url + "/v1"], admin_token=TOKEN)
    base = r.base_url()
    assert (await admin(base, "POST", "/fleet/pause?mode=keep"))[0] == 200
    task = asyncio.create_task(post(base + CHAT, sim_chat("leaves")))
    await until_held(base, 1)
    task.cancel()  # the client closes its connection while held
    with pytest.raises(asyncio.CancelledError):
        await task
    await until_held(base, 0)  # no longer counted against max_held, as in one process
    status, rep = await admin(base, "POST", "/fleet/resume")
    assert status == 200 and rep["result"]["released"] == 0
    deadline = time.monotonic() + 10
    gone = 'rl_router_requests_total{route="/v1/chat/completions",status="499"}'
    while (await metrics(base)).get(gone) != 1:
        assert time.monotonic() < deadline, "the withdrawn request was not counted as the client's 499"
        await asyncio.sleep(0.05)
    assert sum(r.in_flight().values()) == 0  # it was never routed: nothing counted in flight
    assert (await post(base + CHAT, sim_chat("after")))[0] == 200
    assert engine.stats.e2e.count == 1  # the withdrawn request never reached the engine


async def test_fleet_routes_through_a_worker_need_the_admin_token(sims, routers) -> None:
    (engine,) = await sims(1)
    r = routers([engine.url + "/v1"], api_key="client-key", admin_token=TOKEN)
    base = r.base_url()
    for _ in range(4):  # fresh connections: whichever worker relays, the token is required
        for token in (None, "client-key", "wrong-key"):
            status, _ = await admin(base, "POST", "/fleet/pause?mode=keep", token)
            assert status == 401
            assert (await admin(base, "GET", "/fleet/stale", token))[0] == 401
    assert not r.gate.paused and not engine.scheduler.gen_paused
    status, rep = await admin(base, "POST", "/fleet/pause?mode=keep")
    assert status == 200 and rep["ok"], rep
    assert r.gate.paused and engine.scheduler.gen_paused  # the parent's gate, and the engine behind it
    status, rep = await admin(base, "GET", "/fleet/is_paused")
    assert status == 200 and rep["result"]["router_paused"] and rep["result"]["paused"], rep
    status, rep = await admin(base, "POST", "/fleet/resume")
    assert status == 200 and rep["ok"] and not r.gate.paused and not engine.scheduler.gen_paused


# -- HTTP limits in the workers: main's code, the single process's answers --------------------------------
@pytest.mark.parametrize("workers", [1, 2])
async def test_http_limits_hold_in_every_worker_as_in_one_process(engines, routers, workers: int) -> None:
    (e,) = await engines(1)
    limits = HttpLimits(head_timeout_s=0.4, keepalive_timeout_s=1.5)
    r = routers([e.api_url], workers=workers, max_request_bytes=1024, http=limits)
    base = r.base_url()
    # A head begun and never finished: closed at the head deadline, on every connection.
    conns = []
    for _ in range(6):
        reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        conns.append((reader, writer))
    t0 = time.monotonic()
    for reader, _ in conns:
        assert await asyncio.wait_for(reader.read(65536), 5) == b""
    assert time.monotonic() - t0 < 3
    for _, writer in conns:
        writer.close()
    # A body over max_request_bytes: 413.
    assert (await post(base + CHAT, b"x" * 4096))[0] == 413
    # Expect: 100-continue answered by the router, the body then forwarded without it.
    reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
    body = b'{"messages": []}'
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 100 Continue")
    writer.write(body)
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200")
    writer.close()
    assert "Expect" not in e.requests[-1][2]
    # A gzip body forwarded as sent, never inflated in the router.
    bomb = gzip.compress(b"0" * 100_000)
    status, _ = await post(base + CHAT, bomb, headers={"Content-Encoding": "gzip"})
    assert status == 200
    forwarded = e.requests[-1][2]
    assert forwarded["Content-Encoding"] == "gzip" and forwarded["Content-Length"] == str(len(bomb))
    # An idle kept-alive connection is closed after the keep-alive timeout.
    reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    await reader.readexactly(length)
    t0 = time.monotonic()
    assert await asyncio.wait_for(reader.read(65536), 5) == b""
    assert 1.0 < time.monotonic() - t0 < 4
    writer.close()
    m = await metrics(base)
    assert m['rl_router_errors_total{kind="head_timeout"}'] == 6
    assert m['rl_router_requests_total{route="/v1/chat/completions",status="413"}'] == 1
