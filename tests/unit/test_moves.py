"""router.continuation.moves: the fleet's move requests reach exactly the attempts on that engine."""

from __future__ import annotations

import asyncio

from router.continuation.moves import EngineWatch


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
