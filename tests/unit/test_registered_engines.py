"""Engines the trainer registered, judged for the dashboard from the router's view of its members
(``launcher.fleet.registered``, ``launcher.status.registered_rows``): a member the router holds out is
HELD_OUT and out of the gateway, never "HEALTHY?"; no live view leaves the rows as listed."""

from __future__ import annotations

from launcher.fleet.registered import HELD_OUT, HELD_OUT_REASON, UNREGISTERED, judge_registered
from launcher.jobdir import GatewaySnapshot
from launcher.jobdir.records import GatewayMemberRecord
from launcher.status.registered_rows import judge_registered_rows

A, B, C = "http://127.0.0.1:8001", "http://127.0.0.1:8002", "http://127.0.0.1:8003"


def view(*members: tuple[str, bool, str], reachable: bool = True, final: bool = False) -> GatewaySnapshot:
    return GatewaySnapshot(
        kind="builtin",
        base_url="http://127.0.0.1:9000",
        reachable=reachable,
        final=final,
        members=[GatewayMemberRecord(u, ok, why) for u, ok, why in members],
    )


def test_the_routers_verdict_names_each_registered_engines_state() -> None:
    why = "held out by the router: 3 failed probes"
    gateway = view((A, True, ""), (B, False, why), (C + "/v1", False, ""))
    healthy = judge_registered(A + "/v1", gateway)
    assert healthy is not None and (healthy.state, healthy.in_rotation) == ("HEALTHY", True)
    held = judge_registered(B, gateway)
    assert held is not None and (held.state, held.in_rotation) == (HELD_OUT, False)
    assert held.reason == why
    plain = judge_registered(C, gateway)  # the router named no reason: the generic one
    assert plain is not None and plain.reason == HELD_OUT_REASON and "does not restart" in plain.reason
    gone = judge_registered("http://127.0.0.1:8004", gateway)
    assert gone is not None and (gone.state, gone.in_rotation) == (UNREGISTERED, False)


def test_no_live_view_judges_nothing() -> None:
    for gateway in (None, view((A, False, ""), reachable=False), view((A, False, ""), final=True)):
        assert judge_registered(A, gateway) is None


def test_rows_take_the_verdict_in_place() -> None:
    rows = [
        {"id": "node0-0", "url": A, "state": "HEALTHY?", "last_reason": ""},
        {"id": "node0-1", "url": B, "state": "HEALTHY?", "last_reason": ""},
    ]
    judged = judge_registered_rows(rows, view((A, True, ""), (B, False, "")))
    assert [(r["state"], routed) for r, routed in judged] == [("HEALTHY", True), (HELD_OUT, False)]
    assert rows[1]["state"] == HELD_OUT and "trainer owns" in rows[1]["last_reason"]
    unjudged = [{"url": A, "state": "HEALTHY?", "last_reason": ""}]
    assert judge_registered_rows(unjudged, view((A, False, ""), reachable=False)) == []
    assert unjudged[0]["state"] == "HEALTHY?"
