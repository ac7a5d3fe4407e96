"""How long a request was held before routing, and by what: the record's ``held_s``.

A generation request's ``dispatch`` may wait at three places in the routing state (the pause gate, the
version gate, a fair-share slot), and only the routing state knows which; with worker processes it is in
another process. Rather than teach every routing method to return timings, the two waits that have an
object of their own are timed by that object: ``TimedPauseGate.pass_through`` and ``TimedFairShare.enter``
add their seconds to what ``HOLDS`` holds when the waiting task has one (anything with ``add(kind, s)``:
the request's ``RecordDraft``, or a ``Holds``). A request being recorded sets its draft there for its
handling (``router.http.forwarding``); the parent of worker processes sets a ``Holds`` in the task that
holds a worker's request and sends the two figures back with the decision
(``router.multiprocess.decisions``). The version gate has no such object (it waits on the weight
versions' change event), so its share is what is left of the time measured around ``dispatch`` once the
other two are taken out, counted only for a request gated on a version and only above ``HOLD_FLOOR_S``
(a decision's own cost, or its round trip to the parent, is not a hold).

A contextvar, not an argument: the hold runs inside the routing state's own methods, several calls deep,
and the task that runs them is the request's (one process) or the parent's holding task (workers); a
contextvar reaches both without a parameter on every method of ``RoutingState``. Outside a recorded
request it is unset and the timing costs two clock reads.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from typing import Protocol

from router.state.fair_share import FairShare
from router.state.pause_gate import PauseGate


class HoldSink(Protocol):
    def add(self, kind: str, seconds: float) -> None: ...


class Holds(dict[str, float]):
    """``{"pause": s, "share": s}``: what held one request (the parent's side of a worker's request)."""

    def add(self, kind: str, seconds: float) -> None:
        self[kind] = self.get(kind, 0.0) + seconds


HOLDS: ContextVar[HoldSink | None] = ContextVar("rl_router_holds", default=None)
"""Where the waits of the request the current task routes are added, when it is recorded."""
HOLD_FLOOR_S = 0.001


def add_hold(kind: str, seconds: float) -> None:
    sink = HOLDS.get()
    if sink is not None and seconds > 0:
        sink.add(kind, seconds)


class TimedPauseGate(PauseGate):
    """The pause gate, with each hold timed into ``HOLDS`` (``pause``)."""

    async def pass_through(self) -> None:
        t0 = time.perf_counter()
        try:
            await super().pass_through()
        finally:
            add_hold("pause", time.perf_counter() - t0)


class TimedFairShare(FairShare):
    """The fair share, with each wait for a slot timed into ``HOLDS`` (``share``)."""

    async def enter(self, name: str, weight: float) -> None:
        t0 = time.perf_counter()
        try:
            await super().enter(name, weight)
        finally:
            add_hold("share", time.perf_counter() - t0)


def held_breakdown(holds: dict[str, float], total_s: float, gated: bool) -> dict[str, float]:
    """The record's ``held_s``: the pause and fair-share waits timed into ``holds``, the version gate's
    as the rest of ``total_s`` (the time around ``dispatch``) when the request was ``gated`` on a
    version; rounded to 0.1 ms, zeros left out."""
    pause = holds.get("pause", 0.0)
    share = holds.get("share", 0.0)
    rest = total_s - pause - share if gated else 0.0
    out: dict[str, float] = {}
    for kind, value, floor in (("pause", pause, 0.0), ("gate", rest, HOLD_FLOOR_S), ("share", share, 0.0)):
        rounded = round(value, 4)
        if rounded > 0 and value >= floor:
            out[kind] = rounded
    return out
