"""What held one request before it was routed, as the routing state reports it: ``Holds``.

A generation request's ``dispatch`` may wait at the pause gate, for an engine with its weight version,
and for a fair-share slot. Only the routing state knows which, and with worker processes it is in another
process, so the figures travel with the answer: the gate and the fair share add the seconds they held a
request to the ``Holds`` that ``dispatch`` hands them, and ``dispatch`` returns them on its answer
(``router.state.routing.Chosen.held``); a dispatch that raises (a refusal past a bound, a client gone)
leaves them on the exception (``holds_of``). With workers, the parent's figures ride the decision frame
back (``router.multiprocess.wire``). Explicit, not a contextvar: the answer carries what it measured
whichever task or process ran the wait (Ray Serve's request router warns against a contextvar for
per-request attribution for the same reason).

This module owns the names of the holds: the request record (``router.record.holds``) reports them under
the same names.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

PAUSE = "pause"
"""Held at the pause gate (a fleet pause for a weight update)."""
GATE = "gate"
"""Held for an engine with the request's weight version (timed around ``dispatch`` by its caller: the
version gate waits on the versions' change event, not in an object of its own)."""
SHARE = "share"
"""Held for a fair-share slot (the fleet at its capacity)."""

NO_HOLDS: Mapping[str, float] = MappingProxyType({})
"""The answer of a dispatch that waited nowhere (shared and read-only: the common case allocates nothing)."""


class Holds(dict[str, float]):
    """``{kind: seconds}``: what held one request, summed per kind (``PAUSE``, ``SHARE``)."""

    def add(self, kind: str, seconds: float) -> None:
        if seconds > 0:
            self[kind] = self.get(kind, 0.0) + seconds


def leave_on(exc: BaseException, held: Holds) -> None:
    """``dispatch`` raised ``exc`` after ``held``: leave the figures on it for the caller (``holds_of``)."""
    if held:
        exc.held = held  # type: ignore[attr-defined]


def holds_of(exc: BaseException) -> Mapping[str, float]:
    """What held a request whose ``dispatch`` raised ``exc`` (``NO_HOLDS`` when it waited nowhere)."""
    held = getattr(exc, "held", None)
    return held if isinstance(held, Holds) else NO_HOLDS
