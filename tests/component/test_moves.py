"""Who asks a request to move (issue 41, ``router.continuation.moves``): the fleet's events reach every
forwarding process's ``EngineWatch``.

A drain (the elastic shrink, through ``Gateway.move_off``: ``GenerationRouter.move_off``), an engine that
leaves the pushed serving set or is removed, an engine held out by a refit (quarantined), and a version
stamp: each must reach the tracked attempts of the router process and of its worker processes (the
parent's ``MOVE_OFF``/``VERSION`` frames over the real decision channel). Real routers on 127.0.0.1
(OS-chosen ports), every wait bounded.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from launcher.engines.base import EngineSpec
from launcher.engines.sim import SimConfig, SimEngine, SimServer
from launcher.fleet.client import FleetClient, RefitError
from router import GenerationRouter
from router.continuation.moves import EngineWatch
from router.multiprocess.decisions import DecisionService
from router.multiprocess.remote import RemoteRouting
from router.policies import make_policy
from router.policies.base import LoadTracker
from router.state.backends import BackendSet, canonical_backend_url
from router.state.metrics import RouterMetrics
from router.state.routing import LocalRouting
from tests.support.checkpoints import checkpoint, unloadable
from tests.support.http_backends import engine_in_flight, router_factory
from tests.support.refit_calls import TOKEN, chat, in_thread, send
from tests.support.sim_processes import sim_processes

A, B = "http://127.0.0.1:1", "http://127.0.0.1:2"


@pytest.fixture
def routers() -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(probe_interval_s=0, continuation_max_moves=3) as make:  # the default, named
        yield make


def test_the_fleets_events_reach_the_routers_watches(routers: Callable[..., GenerationRouter]) -> None:
    router = routers([A, B])
    watch = router.forwarder.engine_watch
    versions: list[str] = []

    def register(url: str) -> object:
        return router._call(lambda: watch.watch(url))

    drained, on_b = register(A), register(B)
    assert router.move_off([A + "/v1"], "drained") == 1  # the gateway's call; a /v1 URL is the engine's
    assert drained.moved.is_set() and drained.reason == "drained" and not on_b.moved.is_set()
    assert router.serving_backends() == [B]  # out at once: a moved request cannot land on it

    router.set_serving_backends([A, B])
    removed = register(A)
    router.set_serving_backends([B])  # the controller's push without A
    assert removed.moved.is_set() and removed.reason == "removed" and not on_b.moved.is_set()

    on_b.on_version = versions.append
    router._call(lambda: router.backends.versions.stamped(B, "v7"))  # a refit's stamp
    assert versions == ["v7"]

    router._call(lambda: router.backends.hold_out_stale(B, "refit r1 to 'v8': checksum differs"))
    assert on_b.moved.is_set() and on_b.reason == "quarantined"
    again = register(B)
    router._call(lambda: router.backends.hold_out_stale(B, "still stale"))  # already out: nothing in flight
    assert not again.moved.is_set()


async def test_the_decision_channel_carries_moves_and_versions_to_a_worker() -> None:
    """The parent's side (``DecisionService``) and a worker's (``RemoteRouting``) over a real Unix socket,
    as ``WorkerFleet.attach`` and ``serve_worker`` wire them."""
    policy = make_policy("round_robin")
    backends = BackendSet(policy, LoadTracker())
    backends.replace([A, B])
    routing = LocalRouting(backends, policy, RouterMetrics(backends, policy.name), health_managed=False)
    service = DecisionService(routing)
    backends.move_listeners.append(service.move_off)
    backends.versions.listeners.append(service.version_changed)
    loop = asyncio.get_running_loop()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "d.sock")
        server = await loop.create_unix_server(service.channel, path)
        try:
            _, remote = await loop.create_unix_connection(
                lambda: RemoteRouting(policy, lambda: None, lambda: {}), path
            )
            worker_watch = remote.engine_watch = EngineWatch()
            remote.hello(0, os.getpid())
            remote.ready()
            w = worker_watch.watch(A)
            seen: list[str] = []
            w.on_version = seen.append
            for _ in range(100):  # bounded: the channel's hello reaches the parent
                if service.channels:
                    break
                await asyncio.sleep(0.01)
            backends.versions.stamped(A, "v2")
            backends.replace([B])  # A leaves the pushed set
            await asyncio.wait_for(w.moved.wait(), 5)
            assert w.reason == "removed" and seen == ["v2"]
            remote.transport.close()
        finally:
            server.close()
            await server.wait_closed()


# -- a drained or quarantined engine's stream goes on elsewhere (router.continuation, C1's core) ------------
MAX_TOKENS = 300  # ~2 s at the simulator's default step
MOVE_AFTER = 40  # tokens the client has when the fleet acts


@pytest.fixture
def sim_engines(tmp_path: Path) -> Iterator[list[SimEngine]]:
    with sim_processes(tmp_path) as made:
        yield made


def _body() -> dict[str, Any]:
    return {
        "model": "sim",
        "prompt": "a long story begins",
        "max_tokens": MAX_TOKENS,
        "logprobs": 1,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _stream(url: str, at_tokens: Callable[[], Awaitable[None]] | None = None) -> list[dict[str, Any]]:
    """The answer's chunks (an SSE error event fails the test); ``at_tokens`` runs once MOVE_AFTER arrived."""
    chunks: list[dict[str, Any]] = []
    fired = at_tokens is None
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=_body(), timeout=aiohttp.ClientTimeout(total=60)) as r:
            assert r.status == 200, await r.text()
            buf = b""
            async for data in r.content.iter_any():
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    assert not event.startswith(b"event: error"), event
                    if event != b"data: [DONE]":
                        chunks.append(orjson.loads(event.removeprefix(b"data: ")))
                if not fired and len(_tokens(chunks)) >= MOVE_AFTER:
                    fired = True
                    await at_tokens()  # type: ignore[misc]
    assert fired
    return chunks


def _tokens(chunks: list[dict[str, Any]]) -> list[int]:
    return [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or ()]


def _logprobs(chunks: list[dict[str, Any]]) -> list[float]:
    return [
        lp
        for c in chunks
        for ch in c["choices"]
        for lp in (ch.get("logprobs") or {}).get("token_logprobs", ())
    ]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("how", ["drained", "quarantined"])
async def test_a_drained_or_quarantined_engines_stream_goes_on_elsewhere(
    how: str,
    workers: int,
    tmp_path: Path,
    sim_engines: list[SimEngine],
    routers: Callable[..., GenerationRouter],
) -> None:
    """The elastic drain's call (``Gateway.move_off`` -> ``GenerationRouter.move_off``, then the push
    without the node) and a refit's hold-out (``hold_out_stale``) move the stream at once, in the router
    process and in its worker processes; the client's answer is the uninterrupted one, the engine lives on,
    and the record shows the move with its reason."""
    record = tmp_path / "record"
    router = routers([e.url for e in sim_engines], workers=workers, record_dir=str(record))
    url = router.base_url() + "/v1/completions"
    whole = await _stream(url)
    assert len(_tokens(whole)) == MAX_TOKENS
    acted: list[str] = []
    loop = asyncio.get_running_loop()

    async def act() -> None:
        engine = await engine_in_flight(router)
        acted.append(engine)
        if how == "drained":
            await loop.run_in_executor(None, router.move_off, [engine], "drained")
            stay = [e.url for e in sim_engines if canonical_backend_url(e.url) != engine]
            await loop.run_in_executor(None, router.set_serving_backends, stay)
        else:
            why = "refit r1 to 'v2': checksum differs"
            await loop.run_in_executor(
                None, router._call, lambda: router.backends.hold_out_stale(engine, why)
            )

    t0 = time.perf_counter()
    cut = await _stream(url, act)
    assert time.perf_counter() - t0 < 30
    assert _tokens(cut) == _tokens(whole) and _logprobs(cut) == _logprobs(whole)
    assert all(e.is_alive() for e in sim_engines)
    router.stop()
    lines = [
        orjson.loads(ln) for f in sorted(record.glob("requests*.jsonl")) for ln in f.read_bytes().splitlines()
    ]
    moved = [ln for ln in lines if ln.get("moves")]
    assert len(lines) == 2 and len(moved) == 1
    (move,) = moved[0]["moves"]
    assert move["from"] == acted[0] and move["to"] != acted[0] and move["reason"] == how
    assert MOVE_AFTER <= move["at_token"] < MAX_TOKENS


async def test_without_continuation_a_drain_leaves_the_stream_where_it_is(
    sim_engines: list[SimEngine], routers: Callable[..., GenerationRouter]
) -> None:
    """``continuation_max_moves: 0``: nothing is moved (the drain waits for it, as before issue 41)."""
    router = routers([e.url for e in sim_engines], continuation_max_moves=0)
    url = router.base_url() + "/v1/completions"
    loop = asyncio.get_running_loop()
    asked: list[int] = []

    async def act() -> None:
        engine = await engine_in_flight(router)
        asked.append(await loop.run_in_executor(None, router.move_off, [engine], "drained"))

    cut = await _stream(url, act)
    assert asked == [0] and len(_tokens(cut)) == MAX_TOKENS


async def test_a_node_drained_whole_moves_its_request_once_to_an_engine_that_stays(
    tmp_path: Path, routers: Callable[..., GenerationRouter]
) -> None:
    """A node's engines drain together: the moved request must not land on the sibling drained with it
    (before: it could, and was moved a second time at the push, 'removed'; seen in the local elastic
    test). ``move_off`` takes the engines out of the serving set in the same step."""
    made: list[SimEngine] = []
    try:
        for i in range(3):
            spec = EngineSpec(model="sim", log_path=str(tmp_path / f"sim{i}.log"), startup_timeout_s=60)
            made.append(SimEngine(spec))
            made[-1].start_and_wait()
        record = tmp_path / "record"
        router = routers([e.url for e in made], workers=2, record_dir=str(record))
        urls = [canonical_backend_url(e.url) for e in made]
        loop = asyncio.get_running_loop()
        node: list[str] = []

        async def drain_node() -> None:
            engine = await engine_in_flight(router)
            node.extend([engine, next(u for u in urls if u != engine)])  # it and a sibling, drained together
            await loop.run_in_executor(None, router.move_off, node, "drained")
            assert set(await loop.run_in_executor(None, router.serving_backends)) == set(urls) - set(node)

        cut = await _stream(router.base_url() + "/v1/completions", drain_node)
        assert len(_tokens(cut)) == MAX_TOKENS
        router.stop()
        files = sorted(record.glob("requests*.jsonl"))
        (line,) = [orjson.loads(ln) for f in files for ln in f.read_bytes().splitlines()]
        (move,) = line["moves"]
        assert move["from"] == node[0] and move["to"] not in node and move["reason"] == "drained"
    finally:
        for engine in made:
            engine.stop(grace_s=5)


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_request_drained_before_its_first_token_is_sent_again_not_retried(
    workers: int, tmp_path: Path
) -> None:
    """A drain that catches a request before its first token (in its prefill) has nothing to continue:
    the request is sent again from its start, as a move at token 0. It is not a retry: with no retry
    allowed (``max_attempts: 1``) it still ends whole (before: 500, "backend failed: drained"), the
    retries counter stays at 0, the move is counted by its reason, and the record shows it."""
    # The simulator's prompt is 5 tokens here: 2 s of prefill on each engine, the drain comes first.
    engines = [SimServer(SimConfig(prefill_token_s=0.4), index=i) for i in range(2)]
    for e in engines:
        await e.start()
    record = tmp_path / "record"
    try:
        with router_factory(probe_interval_s=0, max_attempts=1) as make:
            router = make([e.url for e in engines], workers=workers, record_dir=str(record))
            loop = asyncio.get_running_loop()
            answer = asyncio.ensure_future(_stream(router.base_url() + "/v1/completions"))
            engine = await engine_in_flight(router)
            assert await loop.run_in_executor(None, router.move_off, [engine], "drained") in (0, 1)
            chunks = await asyncio.wait_for(answer, 30)
            assert len(_tokens(chunks)) == MAX_TOKENS
            async with aiohttp.ClientSession() as http, http.get(router.base_url() + "/metrics") as r:
                metrics = await r.text()
            router.stop()
    finally:
        for e in engines:
            await e.stop()
    assert "rl_router_retries_total 0.0" in metrics
    assert 'rl_router_moves_total{reason="drained"} 1.0' in metrics
    (line,) = [
        orjson.loads(ln) for f in sorted(record.glob("requests*.jsonl")) for ln in f.read_bytes().splitlines()
    ]
    assert [a["outcome"] for a in line["attempts"]] == ["drained", "ok"], line["attempts"]
    (move,) = line["moves"]
    assert move == {"from": engine, "to": line["attempts"][1]["engine"], "at_token": 0, "reason": "drained"}
    assert move["to"] != engine


@pytest.mark.parametrize("max_moves", [0, 3])
async def test_a_quarantined_canarys_frozen_requests_go_on_elsewhere(max_moves: int, tmp_path: Path) -> None:
    """A refit whose canary fails in the loader (``router.fleet.refit``): the requests frozen on it by the
    pause were aborted there (finish_reason "abort", a partial answer: ``continuation_max_moves: 0``,
    as before); now the hold-out moves them and they end whole on the engines that stay."""
    # The canary is the engine with the fewest in flight: with 2 engines, as many as the other; speed 1,
    # so the requests still run when the refit pauses them.
    engines = [SimServer(SimConfig(), index=i) for i in range(2)]
    for e in engines:
        await e.start()
    try:
        await _refit_with_a_failing_canary(engines, max_moves, tmp_path)
    finally:
        for e in engines:
            await e.stop()


async def _refit_with_a_failing_canary(engines: list[SimServer], max_moves: int, tmp_path: Path) -> None:
    with router_factory(policy="round_robin", probe_interval_s=0, admin_token=TOKEN) as make:
        router = make([e.url for e in engines], continuation_max_moves=max_moves)
        url = router.base_url()
        client = FleetClient(url, TOKEN)
        assert (await in_thread(client.load_weights, checkpoint(tmp_path, "good", b"g"), "step-1"))["ok"]

        rollouts = asyncio.gather(*(send(url, chat(300, f"rollout {i}")) for i in range(10)))
        await asyncio.sleep(0.3)  # 5 on each engine, part of each answer made
        with pytest.raises(RefitError, match="did not move") as err:
            await in_thread(client.load_weights, unloadable(tmp_path, "bad"), "step-2")
        assert list(err.value.txn["quarantined"]) == [err.value.txn["canary"]]
        results = await asyncio.wait_for(rollouts, 60)
    assert [s for s, _ in results] == [200] * 10
    finish = [b["choices"][0]["finish_reason"] for _, b in results]
    moved = router.forwarder.engine_watch.moves_total
    print(f"\n[quarantine, continuation_max_moves {max_moves}] finish reasons {finish}, moved {moved}")
    if max_moves:
        assert finish == ["length"] * 10 and moved > 0
        assert all(len(b["choices"][0]["message"]["content"]) == 4 * 300 for _, b in results)
    else:
        assert "abort" in finish and moved == 0


async def test_a_stamp_reaches_a_worker_processes_stream_as_a_new_span(
    sim_engines: list[SimEngine], routers: Callable[..., GenerationRouter]
) -> None:
    """A version stamped while a stream runs in a worker process (the parent's ``VERSION`` frame): the
    answer's spans change version there, as in a one-process router."""
    token = "admin-token-" + "d" * 24
    router = routers([e.url for e in sim_engines], workers=2, admin_token=token)
    base = router.base_url()

    async def stamp(version: str) -> None:
        async with aiohttp.ClientSession() as http:
            headers = {"Authorization": f"Bearer {token}"}
            async with http.post(
                base + "/fleet/weight_version", json={"version": version}, headers=headers
            ) as r:
                assert r.status == 200, await r.text()

    await stamp("v1")
    chunks = await _stream(base + "/v1/completions", lambda: stamp("v2"))
    assert len(_tokens(chunks)) == MAX_TOKENS
    (v1, v2) = chunks[-1]["weight_versions"]
    assert v1[0] == "v1" and v2[0] == "v2" and v1[1] == 0 and v2[2] == MAX_TOKENS - 1
    assert v1[2] + 1 == v2[1] and MOVE_AFTER <= v2[1] < MAX_TOKENS
