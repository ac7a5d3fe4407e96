"""The router with worker processes (``RouterConfig.workers > 1``): real routers on 127.0.0.1.

What must hold with N processes is what holds with one: one port, one routing state (affinity and the
load bound across workers), the admin API acting on that state, metrics summed, the status contract, and
a client that goes away cancelling its request. Which worker accepts a connection is the kernel's choice,
so tests that need two workers to take part send bounded rounds of requests until both have (and fail if
they never do), never sleep for a fixed time.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import aiohttp
import orjson
import pytest
from aiohttp import web

from router import GenerationRouter, RouterConfig
from tests.http_backends import FakeEngine, dead_url, engine_factory

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
    made: list[GenerationRouter] = []

    def make(backends: list[str], **kwargs: object) -> GenerationRouter:
        kwargs.setdefault("probe_interval_s", 0)
        kwargs.setdefault("workers", 2)
        r = GenerationRouter(RouterConfig(host="127.0.0.1", port=0, **kwargs), backends)  # type: ignore[arg-type]
        r.serve_in_background()
        made.append(r)
        return r

    yield make
    for r in made:
        r.stop()


async def in_thread(fn: Callable[[], object]) -> object:
    return await asyncio.get_running_loop().run_in_executor(None, fn)


async def post(url: str, body: bytes | dict[str, object], **kwargs: object) -> tuple[int, dict[str, object]]:
    """One request on a connection of its own (a fresh connection may be accepted by any worker)."""
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        async with s.post(url, data=data, **kwargs) as r:  # type: ignore[arg-type]
            raw = await r.read()
            return r.status, (orjson.loads(raw) if raw[:1] == b"{" else {"raw": raw})


async def metrics(base: str) -> dict[str, float]:
    """``{'name{labels}': value}`` from the router's /metrics."""
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/metrics") as r:
            assert r.status == 200
            text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


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
    from router.workers import WorkerFleet

    monkeypatch.setattr(WorkerFleet, "start_timeout_s", 0.001)
    r = GenerationRouter(RouterConfig(host="127.0.0.1", port=0, workers=2, probe_interval_s=0))
    fleet = r.workers
    assert fleet is not None
    with pytest.raises(RuntimeError, match="of 2 router worker processes started"):
        r.serve_in_background()
    procs = [p for p in fleet._procs if p is not None]
    assert len(procs) == 2 and all(p.poll() is not None for p in procs)
    assert fleet._dir is not None and not os.path.exists(fleet._dir)
