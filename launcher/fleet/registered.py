"""Engines the trainer registered (``generation.owner: trainer``), judged in the fleet's terms.

Such engines are the trainer's own processes, registered with the router under the job's capability
(``router.http.capability``). No fleet controller runs for them: nothing of rl-launch's may restart a
process it did not start. The router judges them itself, as every standalone router does
(``router.state.probing``): each is probed every second, taken out of rotation after a few failures in a
row (probes or proxied attempts; ``RouterConfig.probe_failures_to_eject``, 3), probed on while out, and
readmitted after a few passing probes (``probe_successes_to_readmit``, 2). The driver's
gateway watcher writes the router's view of its members to the job state every 2 s (``state.json
["gateway"]``, each member with whether it serves).

Before, ``rl-launch status`` showed these engines from their listings alone: a SIGKILLed one stayed
"HEALTHY?" (listed, not judged) and ``in_gateway`` (a member) while the router had taken it out. Here each
row is judged from the router's view: ``HEALTHY`` while the router routes to it, ``HELD_OUT`` while it
holds it out (the reason says that rl-launch will not restart it, and how it comes back), ``UNREGISTERED``
once it is no longer a member (``DELETE /workers``); and the row is in rotation only while it serves.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.fleet.health import EngineState
from launcher.jobdir import GatewaySnapshot
from router.state.backends import canonical_backend_url

HELD_OUT = "HELD_OUT"
"""A registered engine the router holds out: it failed its health probes (or its requests) and gets no
request until it passes again."""
UNREGISTERED = "UNREGISTERED"
"""A URL once registered that the router no longer lists (removed with ``DELETE /workers``)."""

SILENT = frozenset({HELD_OUT, UNREGISTERED})
"""States whose engine is expected not to answer (the router saw it fail, or it left)."""

HELD_OUT_REASON = (
    "held out by the router: it failed its health probes or requests; probed on, it is readmitted once "
    "it passes them again. rl-launch does not restart it: the trainer owns the process"
)
"""The reason when the router's view gives none (the builtin gateway's names its thresholds)."""
UNREGISTERED_REASON = "no longer registered with the router (removed with DELETE /workers)"


@dataclass(frozen=True)
class RegisteredVerdict:
    """One registered engine as the router sees it now: its state, why, and whether it is routed to."""

    state: str
    reason: str
    in_rotation: bool


def judge_registered(url: str, gateway: GatewaySnapshot | None) -> RegisteredVerdict | None:
    """The state of the registered engine at ``url`` from the router's view of its members; None when
    there is no live view to judge by (none written yet, the router unreachable this tick, the job over):
    the row then says what it said before, not a guess."""
    if gateway is None or not gateway.reachable or gateway.final:
        return None
    key = canonical_backend_url(url)
    member = next((m for m in gateway.members if canonical_backend_url(m.url) == key), None)
    if member is None:
        return RegisteredVerdict(UNREGISTERED, UNREGISTERED_REASON, False)
    if member.healthy is False:
        return RegisteredVerdict(HELD_OUT, member.detail or HELD_OUT_REASON, False)
    return RegisteredVerdict(str(EngineState.HEALTHY), "", True)
