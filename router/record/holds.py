"""The record's ``held_s``: how long a request was held before routing, and by what.

The routing state reports what held a request (``router.state.holds``: the pause gate's and the fair
share's seconds, answered on ``Chosen.held`` or left on a refusal), the forwarder adds them to the
request's draft (``RecordDraft.add``), and with a version wanted it times the first ``dispatch`` whole
(``RecordDraft.gated_s``). The version gate has no object of its own (it waits on the weight versions'
change event), so its share is what is left of that time once the other two are taken out, counted only
for a request gated on a version and only above ``HOLD_FLOOR_S`` (a decision's own cost, or its round
trip to the parent, is not a hold). The names are the routing state's (``PAUSE``, ``GATE``, ``SHARE``).
"""

from __future__ import annotations

from collections.abc import Mapping

from router.state.holds import GATE, PAUSE, SHARE

HOLD_FLOOR_S = 0.001


def held_breakdown(holds: Mapping[str, float], total_s: float, gated: bool) -> dict[str, float]:
    """The record's ``held_s``: the pause and fair-share waits in ``holds``, the version gate's as the
    rest of ``total_s`` (the time around ``dispatch``) when the request was ``gated`` on a version;
    rounded to 0.1 ms, zeros left out."""
    pause = holds.get(PAUSE, 0.0)
    share = holds.get(SHARE, 0.0)
    rest = total_s - pause - share if gated else 0.0
    out: dict[str, float] = {}
    for kind, value, floor in ((PAUSE, pause, 0.0), (GATE, rest, HOLD_FLOOR_S), (SHARE, share, 0.0)):
        rounded = round(value, 4)
        if rounded > 0 and value >= floor:
            out[kind] = rounded
    return out
