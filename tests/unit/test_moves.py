"""router.continuation.moves: the fleet's move requests reach exactly the attempts on that engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

from launcher.fleet import HealthPolicy
from launcher.fleet.controller import FleetController
from launcher.jobdir import EngineEntry, EngineListing, JobDir, StateWriter
from router.continuation.moves import EngineWatch
from router.policies import LoadTracker, RouteRequest, make_policy
from router.state.backends import BackendSet
from router.state.metrics import RouterMetrics
from router.state.routing import LocalRouting


async def test_move_off_sets_only_that_engines_watches_once() -> None:
    ew = EngineWatch()
    a1, a2, b = ew.watch("http://a"), ew.watch("http://a"), ew.watch("http://b")
    assert ew.watching() == 3 and ew.watching("http://a") == 2
    assert ew.move_off("http://a", "drained") == 2
    assert a1.moved.is_set() and a2.moved.is_set() and not b.moved.is_set()
    assert a1.reason == a2.reason == "drained" and b.reason is None
    assert ew.move_off("http://a", "removed") == 0  # already asked: not counted twice, reason kept
    assert a1.reason == "drained" and ew.moves_total == 2
    assert ew.move_off("http://nobody", "removed") == 0


async def test_a_waiting_attempt_wakes_on_move() -> None:
    ew = EngineWatch()
    w = ew.watch("http://a")
    waiter = asyncio.create_task(w.moved.wait())
    await asyncio.sleep(0)
    ew.move_off("http://a", "quarantined")
    await asyncio.wait_for(waiter, 1.0)
    assert w.reason == "quarantined"


async def test_unwatch_forgets_and_a_later_watch_is_not_moved() -> None:
    ew = EngineWatch()
    w = ew.watch("http://a")
    ew.unwatch(w)
    ew.unwatch(w)  # twice is harmless
    assert ew.watching() == 0 and ew.move_off("http://a", "drained") == 0 and not w.moved.is_set()
    later = ew.watch("http://a")
    assert not later.moved.is_set()


async def test_version_changed_calls_back_each_attempt_on_the_engine() -> None:
    ew = EngineWatch()
    seen: list[tuple[str, str]] = []
    a, b, quiet = ew.watch("http://a"), ew.watch("http://b"), ew.watch("http://a")
    a.on_version = lambda v: seen.append(("a", v))
    b.on_version = lambda v: seen.append(("b", v))

    def broken(v: str) -> None:
        raise RuntimeError("boom")

    bad = ew.watch("http://a")
    bad.on_version = broken
    ew.version_changed("http://a", "v4")
    assert seen == [("a", "v4")] and quiet.on_version is None  # the raising callback did not stop a's


def test_the_backend_set_moves_on_the_fleets_decisions_not_on_one_failed_attempt() -> None:
    """Who calls ``move_off`` in the routing state: a push without the engine, a hold-out of a serving
    engine, a drain (``leave_moving``); not the removal that follows one attempt's transport failure in a
    health-managed router (a timeout of one request says nothing about the others on that engine)."""
    a, b, c = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"
    policy = make_policy("round_robin")
    backends = BackendSet(policy, LoadTracker())
    backends.replace([a, b, c, "http://127.0.0.1:4"])
    asked: list[tuple[str, str]] = []
    backends.move_listeners.append(lambda url, reason: asked.append((url, reason)) or 1)
    routing = LocalRouting(backends, policy, RouterMetrics(backends, policy.name), health_managed=True)
    routing.failed(RouteRequest("/v1/completions", b"{}", {}), a, "timeout")
    assert a not in backends.members and asked == []
    backends.replace([b, c, "http://127.0.0.1:4"])  # a is gone already: nothing more
    backends.replace([c, "http://127.0.0.1:4"])
    assert asked == [(b, "removed")]
    backends.hold_out_stale(c, "refit r1: not verified")
    backends.hold_out_stale(c, "still")  # already out of rotation: nothing in flight to move
    assert asked == [(b, "removed"), (c, "quarantined")]
    assert backends.leave_moving(["http://127.0.0.1:4"], "drained") == 1
    assert asked[-1] == ("http://127.0.0.1:4", "drained") and len(asked) == 3
    assert backends.serving == ()


def test_the_fleet_controller_moves_requests_off_engines_it_restarts(tmp_path: Path) -> None:
    """Before the push that drops them, the controller asks the front to move the requests in flight on
    the engines it is about to restart ("restarted"); a front that cannot be asked is logged, not fatal."""
    job = JobDir(tmp_path / "j").create()
    job.write_listing(
        EngineListing(
            node="n0",
            node_index=0,
            engines=[
                EngineEntry(index=i, url=f"http://127.0.0.1:{9000 + i}", node="n0", node_index=0)
                for i in range(2)
            ],
        )
    )
    asked: list[tuple[list[str], str]] = []

    class Front:
        def move_off(self, urls: list[str], reason: str) -> int:
            asked.append((list(urls), reason))
            return 0

    controller = FleetController(job, StateWriter(job), Front(), 1, HealthPolicy(), say=lambda _: None)  # type: ignore[arg-type]
    controller._move_off_restarting(["node0-1"])
    assert asked == [(["http://127.0.0.1:9001"], "restarted")]

    class Gone:
        def move_off(self, urls: list[str], reason: str) -> int:
            raise TimeoutError("the actor restarts")

    controller.gateway = Gone()  # type: ignore[assignment]
    controller._move_off_restarting(["node0-0"])
    (event,) = [e for e in job.read_events() if e["phase"] == "router_unreachable"]
    assert "moving requests off restarting engines" in event["detail"]
