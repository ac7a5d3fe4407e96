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
from collections.abc import Callable, Iterator

import pytest

from router import GenerationRouter
from router.continuation.moves import EngineWatch
from router.multiprocess.decisions import DecisionService
from router.multiprocess.remote import RemoteRouting
from router.policies import make_policy
from router.policies.base import LoadTracker
from router.state.backends import BackendSet
from router.state.metrics import RouterMetrics
from router.state.routing import LocalRouting
from tests.support.http_backends import router_factory

A, B = "http://127.0.0.1:1", "http://127.0.0.1:2"


@pytest.fixture
def routers() -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(probe_interval_s=0) as make:
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
