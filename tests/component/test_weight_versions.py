"""Weight versions through the router (``router.state.versions``): the version on every sample, requests
that straddled a refit, and requests gated on a version.

``WeightVersions`` alone first, then real routers on 127.0.0.1 in front of simulated engines (vLLM's RL
routes) and the recording fake engines, each test run as one process and with two worker processes (the
``workers`` fixture): the routing state, its versions included, lives in the router's own process either
way (``GenerationRouter.backends``), so a test reaches it the same in both modes, on the router's loop.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from router import GenerationRouter
from router.state.versions import (
    ROUTER_REQUEST_ID_HEADER,
    VERSION_HEADER,
    WANT_HEADER,
    UnknownVersion,
    VersionWant,
    WeightVersions,
)
from tests.support.http_backends import (
    FakeEngine,
    engine_factory,
    router_factory,
    workers_fixture,  # noqa: F401 (the fixture)
)
from tests.support.router_metrics import metrics

TOKEN = "admin-test-token-1234"
CHAT = "/v1/chat/completions"


# -- WeightVersions alone -----------------------------------------------------------------------------------
def test_want_parse_and_str() -> None:
    assert VersionWant.parse("v3") == VersionWant("v3", False)
    assert VersionWant.parse(" >= v3 ") == VersionWant("v3", True)
    assert str(VersionWant.parse(">=v3")) == ">=v3" and str(VersionWant("v3")) == "v3"
    for bad in ("", " ", ">=", ">= "):
        with pytest.raises(ValueError, match=WANT_HEADER):
            VersionWant.parse(bad)


def test_known_check_and_satisfies_follow_the_stamp_order() -> None:
    v = WeightVersions()
    with pytest.raises(UnknownVersion, match="none yet"):
        v.check(VersionWant("v1"))
    v.stamped("a", "default")  # a joining engine's own version: known, never in the order
    v.fleet_moved_to("v1")
    v.stamped("a", "v1")
    v.stamped("b", "v1")
    v.fleet_moved_to("v2")
    v.stamped("b", "v2")
    v.announce("v3")
    assert v.known() == ["v1", "v2", "v3"]
    for ok in ("v1", ">=v2", "v3"):
        v.check(VersionWant.parse(ok))
    with pytest.raises(UnknownVersion) as err:
        v.check(VersionWant("v9"))
    assert "'v9'" in str(err.value) and "['v1', 'v2', 'v3']" in str(err.value)
    assert v.satisfies("a", VersionWant("v1")) and not v.satisfies("a", VersionWant("v2"))
    assert v.satisfies("b", VersionWant("v1", at_least=True))
    assert not v.satisfies("a", VersionWant("v2", at_least=True))
    assert not v.satisfies("c", VersionWant("v1", at_least=True))  # unknown engine: satisfies nothing
    v.fleet_moved_to("v1")  # stamped again: keeps its place, and the refit to v3 is still pending
    assert v.order == ["v1", "v2"] and v.pending == "v3"
    v.fleet_moved_to("v3")
    assert v.order == ["v1", "v2", "v3"] and v.pending is None
    v.stamped("a", "v3")
    assert v.satisfies("a", VersionWant("v2", at_least=True))
    v.stamped("a", "v1")
    assert v.excluded_for(VersionWant("v2", True), ("a", "b", "c")) == frozenset({"a", "c"})
    assert v.excluded_for(None, ("a", "b")) == frozenset()
    message = v.unsatisfied(VersionWant("v3"), ("a", "b", "c"))
    assert "'v3'" in message and "a: v1" in message and "b: v2" in message and "c: unknown" in message
    v.stamped("d", "default")
    v.check(VersionWant("default"))  # served by an engine: known though never stamped
    assert not v.satisfies("d", VersionWant("v1", at_least=True))
    v.forget("d")
    v.forget("a")
    with pytest.raises(UnknownVersion):
        v.check(VersionWant("default"))


def test_straddlers_counted_per_step_and_listed_by_id() -> None:
    v = WeightVersions()
    v.stamped("a", "v1")
    assert not v.ended("a", None, "r0")  # dispatched on no known version: never a straddler
    assert not v.ended("a", "v1", "r1")  # same version at the end
    v.stamped("a", "v2")
    assert v.ended("a", "v1", "r2")
    assert v.ended("a", "v1", None)  # counted, not listed
    assert not v.ended("gone", "v1", "r3")  # the engine left: nothing to compare with
    assert v.straddlers_since(0) == {"count": 2, "request_ids": ["r2"]}
    mark = v.step_mark()
    assert v.straddlers_since(mark) == {"count": 0, "request_ids": []}
    assert v.ended("a", "v1", "r4")
    assert v.straddlers_since(mark) == {"count": 1, "request_ids": ["r4"]}
    assert v.straddlers_since(0) == {"count": 3, "request_ids": ["r2", "r4"]}  # an earlier step's, untouched
    assert v.straddled_total == 3


async def test_wait_change_wakes_on_stamps_and_serving_changes() -> None:
    v = WeightVersions()
    for change in (lambda: v.stamped("a", "v1"), lambda: v.fleet_moved_to("v1"), v.changed):
        waiter = asyncio.create_task(v.wait_change())
        await asyncio.sleep(0)
        assert not waiter.done()
        change()
        await asyncio.wait_for(waiter, 1)
    waiter = asyncio.create_task(v.wait_change())
    v.stamped("a", "v1")  # no change: nobody woken
    await asyncio.sleep(0.01)
    assert not waiter.done()
    waiter.cancel()


# -- through the router -------------------------------------------------------------------------------------
@pytest.fixture
def routers(workers: int) -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(policy="round_robin", probe_interval_s=0, admin_token=TOKEN, workers=workers) as make:
        yield make


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., Awaitable[list[FakeEngine]]]]:
    async with engine_factory(FakeEngine, 2) as make:
        yield make


def chat(content: str = "hello", max_tokens: int = 4) -> dict[str, Any]:
    return {"model": "sim", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


async def send(
    base: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    """One chat request on a connection of its own (any worker may accept it): status, headers, body."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        async with s.post(base + CHAT, json=body or chat(), headers=headers or {}) as r:
            raw = await r.read()
            parsed = orjson.loads(raw) if raw[:1] == b"{" else {"raw": raw}
            return r.status, {k.lower(): v for k, v in r.headers.items()}, parsed


async def admin(base: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        async with s.request(method, base + path, json=body, headers=headers) as r:
            return r.status, orjson.loads(await r.read())


async def stamp(base: str, version: str) -> None:
    status, rep = await admin(base, "POST", "/fleet/weight_version", {"version": version})
    assert status == 200 and rep["ok"], rep


async def until(check: Callable[[], Awaitable[bool]], what: str, within_s: float = 15.0) -> None:
    deadline = time.monotonic() + within_s
    while not await check():
        assert time.monotonic() < deadline, f"not within {within_s:g} s: {what}"
        await asyncio.sleep(0.02)


async def held_for_version(base: str) -> float:
    return (await metrics(base))["rl_router_version_held_requests"]


def on_loop(r: GenerationRouter, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on the router's loop (the versions belong to it), from a thread off the test's loop."""
    return asyncio.get_running_loop().run_in_executor(None, lambda: r._call(fn))


async def test_responses_carry_the_version_and_the_request_id(sims, routers) -> None:
    es = await sims(2)
    r = routers([e.url + "/v1" for e in es])
    base = r.base_url()
    status, headers, _ = await send(base)
    assert status == 200 and VERSION_HEADER not in headers  # nothing stamped or verified yet
    assert re.fullmatch(r"[0-9a-f]{16}", headers[ROUTER_REQUEST_ID_HEADER]), headers
    status, headers, _ = await send(base, headers={"X-Request-Id": "client-id-7"})
    assert status == 200 and headers[ROUTER_REQUEST_ID_HEADER] == "client-id-7"
    await stamp(base, "v1")
    for _ in range(4):  # both engines
        status, headers, _ = await send(base)
        assert status == 200 and headers[VERSION_HEADER] == "v1"
    await stamp(base, "v2")
    for _ in range(4):
        status, headers, _ = await send(base)
        assert status == 200 and headers[VERSION_HEADER] == "v2"
    assert {e.rl.weight_version for e in es} == {"v2"}
    # Streams carry them too (the headers go out before the first chunk).
    status, headers, body = await send(base, {**chat(), "stream": True}, {"X-Request-Id": "s1"})
    assert (status, headers[VERSION_HEADER], headers[ROUTER_REQUEST_ID_HEADER]) == (200, "v2", "s1")
    assert headers["content-type"].startswith("text/event-stream") and b"[DONE]" in body["raw"]


async def test_nothing_is_added_upstream_and_the_want_header_is_forwarded(engines, routers) -> None:
    es = await engines(2)
    r = routers([e.api_url for e in es])
    base = r.base_url()
    urls = [e.url for e in es]

    def seed() -> None:
        v = r.backends.versions
        for u in urls:
            v.stamped(u, "v1")
        v.fleet_moved_to("v1")

    await on_loop(r, seed)
    status, headers, body = await send(base, headers={WANT_HEADER: ">=v1"})
    assert status == 200 and headers[VERSION_HEADER] == "v1"
    sent = {k.lower(): v for k, v in next(e for e in es if e.name == body["backend"]).requests[-1][2].items()}
    assert sent[WANT_HEADER] == ">=v1"  # a pure proxy: forwarded unchanged
    assert ROUTER_REQUEST_ID_HEADER not in sent and "x-request-id" not in sent
    status, _, body = await send(base, headers={"X-Request-Id": "given"})
    sent = {k.lower(): v for k, v in next(e for e in es if e.name == body["backend"]).requests[-1][2].items()}
    assert sent["x-request-id"] == "given" and ROUTER_REQUEST_ID_HEADER not in sent


async def test_gated_requests_go_only_to_engines_that_satisfy_them_retry_included(engines, routers) -> None:
    es = await engines(2)
    old, new = es
    r = routers([e.api_url for e in es])
    base = r.base_url()

    def seed() -> None:
        v = r.backends.versions
        v.fleet_moved_to("v1")
        v.fleet_moved_to("v2")
        v.stamped(old.url, "v1")
        v.stamped(new.url, "v2")

    await on_loop(r, seed)
    for want, where in (("v2", {"e1"}), (">=v2", {"e1"}), ("v1", {"e0"}), (">=v1", {"e0", "e1"})):
        seen = set()
        for _ in range(6):
            status, headers, body = await send(base, headers={WANT_HEADER: want})
            assert status == 200, body
            seen.add(body["backend"])
            assert headers[VERSION_HEADER] == ("v1" if body["backend"] == "e0" else "v2")
        assert seen == where, (want, seen)
    # The only engine on v2 fails: the retry may not fall back on the v1 engine.
    new.mode = "status"
    new.status = 500
    before = len(old.requests)
    status, _, body = await send(base, headers={WANT_HEADER: "v2"})
    assert status == 500 and body["error"]["type"] == "backend_status", body
    assert len(old.requests) == before


async def test_bad_and_unknown_versions_are_400_at_once(sims, routers) -> None:
    es = await sims(2)
    r = routers([e.url + "/v1" for e in es])
    base = r.base_url()
    status, _, body = await send(base, headers={WANT_HEADER: ">="})
    assert status == 400 and WANT_HEADER in body["error"]["message"], body
    status, _, body = await send(base, headers={WANT_HEADER: "v1"})  # nothing stamped yet
    assert status == 400 and body["error"]["type"] == "unknown_weight_version", body
    await stamp(base, "v1")
    await stamp(base, "v2")
    t0 = time.monotonic()
    status, _, body = await send(base, headers={WANT_HEADER: ">=v9"})
    assert time.monotonic() - t0 < 2
    assert status == 400 and body["error"]["type"] == "unknown_weight_version", body
    assert "'v9'" in body["error"]["message"] and "['v1', 'v2']" in body["error"]["message"]
    # The want is on generation routes only: elsewhere it is just a header.
    async with aiohttp.ClientSession() as s, s.get(base + "/v1/models", headers={WANT_HEADER: "v9"}) as resp:
        assert resp.status == 200
    m = await metrics(base)
    assert m['rl_router_errors_total{kind="unknown_weight_version"}'] == 2
    assert sum(e.stats.e2e.count for e in es) == 0


async def test_a_request_held_for_a_version_is_served_once_the_fleet_has_it(sims, routers) -> None:
    es = await sims(2)
    r = routers([e.url + "/v1" for e in es])
    base = r.base_url()
    await stamp(base, "v1")
    await on_loop(r, lambda: r.backends.versions.announce("v2"))  # a refit towards v2 began
    held = asyncio.create_task(send(base, headers={WANT_HEADER: ">=v2", "X-Request-Id": "wants-v2"}))
    await until(lambda: _eq(held_for_version(base), 1), "one request held for v2")
    assert not held.done() and sum(e.stats.e2e.count for e in es) == 0
    await stamp(base, "v2")
    status, headers, body = await asyncio.wait_for(held, 10)
    assert status == 200 and headers[VERSION_HEADER] == "v2", body
    assert headers[ROUTER_REQUEST_ID_HEADER] == "wants-v2"
    assert (await metrics(base))["rl_router_version_held_requests"] == 0


async def test_a_version_hold_goes_through_the_pause_gate_again(sims, routers) -> None:
    es = await sims(2)
    r = routers([e.url + "/v1" for e in es])
    base = r.base_url()
    await stamp(base, "v1")
    await on_loop(r, lambda: r.backends.versions.announce("v2"))
    held = asyncio.create_task(send(base, headers={WANT_HEADER: "v2"}))
    await until(lambda: _eq(held_for_version(base), 1), "one request held for v2")
    assert (await admin(base, "POST", "/fleet/pause?mode=keep"))[0] == 200
    await stamp(base, "v2")  # stamped while paused: the request now waits at the gate, not on an engine
    await until(lambda: _eq(_metric(base, "rl_router_held_requests"), 1), "the request held at the gate")
    assert not held.done() and sum(e.stats.e2e.count for e in es) == 0
    assert (await admin(base, "POST", "/fleet/resume"))[0] == 200
    status, headers, body = await asyncio.wait_for(held, 10)
    assert status == 200 and headers[VERSION_HEADER] == "v2", body


async def test_a_version_hold_is_bounded_like_a_pause(sims, routers) -> None:
    es = await sims(2)
    # The version gate's own time bound (version_max_wait_s), far shorter than a pause's.
    r = routers([e.url + "/v1" for e in es], pause_max_wait_s=600.0, pause_max_held=1, version_max_wait_s=1.0)
    base = r.base_url()
    await stamp(base, "v1")
    await stamp(base, "v2")  # v1 is known, but no engine serves it any more: answered at once, never held
    status, _, body = await send(base, headers={WANT_HEADER: "v1"})
    assert status == 400 and body["error"]["type"] == "unknown_weight_version", body
    assert "no longer served" in body["error"]["message"] and "'v2'" in body["error"]["message"]
    await on_loop(r, lambda: r.backends.versions.announce("v3"))  # a refit to v3 is coming: held for it
    first = asyncio.create_task(send(base, headers={WANT_HEADER: "v3"}))
    await until(lambda: _eq(held_for_version(base), 1), "one request held for v3")
    status, _, body = await send(base, headers={WANT_HEADER: "v3"})  # over the count bound
    assert status == 409 and body["error"]["type"] == "weight_version_unavailable", body
    assert "at most 1 held" in body["error"]["message"]
    t0 = time.monotonic()
    status, _, body = await asyncio.wait_for(first, 10)  # over the time bound
    assert status == 409 and time.monotonic() - t0 < 5, body
    message = body["error"]["message"]
    assert "'v3'" in message and "v2" in message and "waited 1" in message, message
    m = await metrics(base)
    assert m["rl_router_version_refused_total"] == 2 and m["rl_router_version_held_requests"] == 0
    assert m['rl_router_errors_total{kind="version_bound"}'] == 2
    assert sum(e.stats.e2e.count for e in es) == 0
    assert (await send(base, headers={WANT_HEADER: ">=v1"}))[0] == 200


async def test_a_client_that_leaves_is_no_longer_held_for_a_version(sims, routers) -> None:
    es = await sims(1)
    r = routers([e.url + "/v1" for e in es])
    base = r.base_url()
    await stamp(base, "v1")
    await on_loop(r, lambda: r.backends.versions.announce("v2"))
    task = asyncio.create_task(send(base, headers={WANT_HEADER: "v2"}))
    await until(lambda: _eq(held_for_version(base), 1), "one request held for v2")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: _eq(held_for_version(base), 0), "the request no longer held")
    gone = 'rl_router_requests_total{route="/v1/chat/completions",status="499"}'
    await until(lambda: _eq(_metric(base, gone), 1), "the client's 499 counted")
    await stamp(base, "v2")
    assert sum(r.in_flight().values()) == 0 and es[0].stats.e2e.count == 0


async def test_a_request_frozen_by_a_keep_pause_across_a_stamp_is_a_straddler(sims, routers) -> None:
    # Slow steps: a 100-token answer takes ~1 s, long enough to pause, stamp and resume under it.
    es = await sims(1, step_base_s=0.2)
    r = routers([e.url + "/v1" for e in es])
    base = r.base_url()
    await stamp(base, "v1")
    assert (await admin(base, "POST", "/fleet/step/begin"))[0] == 200
    slow = asyncio.create_task(send(base, chat("slow", 100), {"X-Request-Id": "straddler-1"}))
    await until(lambda: _in_flight(r, 1), "the slow request in flight")
    assert (await admin(base, "POST", "/fleet/pause?mode=keep"))[0] == 200
    await stamp(base, "v2")
    assert (await admin(base, "POST", "/fleet/resume"))[0] == 200
    status, headers, body = await asyncio.wait_for(slow, 30)
    assert status == 200 and body["usage"]["completion_tokens"] == 100, body
    assert headers[VERSION_HEADER] == "v1"  # the version it was dispatched on
    status, _, _ = await send(base, headers={"X-Request-Id": "not-a-straddler"})
    assert status == 200

    async def listed() -> bool:
        _, step = await admin(base, "GET", "/fleet/step")
        return step["straddled"] == {"count": 1, "request_ids": ["straddler-1"]}

    await until(listed, "the straddler listed by its id")
    assert (await metrics(base))["rl_router_straddled_requests_total"] == 1
    assert (await admin(base, "POST", "/fleet/step/begin"))[0] == 200
    _, step = await admin(base, "GET", "/fleet/step")
    assert step["straddled"] == {"count": 0, "request_ids": []}


async def _eq(value: Awaitable[float], expected: float) -> bool:
    return await value == expected


async def _metric(base: str, name: str) -> float:
    return (await metrics(base)).get(name, 0.0)


async def _in_flight(r: GenerationRouter, n: int) -> bool:
    return sum((await on_loop(r, r.backends.load.snapshot)).values()) == n
