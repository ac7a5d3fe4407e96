"""The fleet-health state machine: every transition, the windowed rule, the restart budgets.

Pure and deterministic: a fake clock, no I/O. Engines ``e0..eN`` listen on ``http://10.0.0.1:800i``
(advertised with ``/v1``, as the engine host publishes them).
"""

from __future__ import annotations

import json

import pytest

from launcher.fleet import (
    EngineRecord,
    EngineState,
    FleetHealth,
    HealthPolicy,
    ProbeResult,
    TickInput,
    TickResult,
    Verdict,
    judge_tick,
    judge_window,
)
from tests.support.fleet_health import Clock, front_tick, make, url

H, S, D = EngineState.HEALTHY, EngineState.SUSPECT, EngineState.DEAD
RS, RC, RT = EngineState.RESTARTING, EngineState.RECOVERING, EngineState.RETIRED
FAIL = ProbeResult(False, "timeout after 2 s")


def tick(
    fleet: FleetHealth,
    clock: Clock,
    probes: dict[str, ProbeResult | bool] | None = None,
    outcomes: dict[str, tuple[int, int]] | None = None,
    all_ok: bool = True,
) -> TickResult:
    """One tick, 1 s later. ``all_ok``: every probe target not named in ``probes`` passes its probe."""
    clock.t += 1.0
    given = dict(probes or {})
    if all_ok:
        for u in fleet.probe_targets().values():
            given.setdefault(u, True)
    return fleet.observe(TickInput(probes=given, outcomes=outcomes or {}))


def transitions(result: TickResult) -> list[tuple[str, str, str]]:
    return [(e["engine_id"], e["from_state"], e["to_state"]) for e in result.events]


def kill(fleet: FleetHealth, clock: Clock, engine: str) -> TickResult:
    """Fail ``engine``'s probe until it leaves the serving states; the last tick's result."""
    for _ in range(10):
        r = tick(fleet, clock, {fleet.engine(engine).url: FAIL})
        if fleet.state(engine) not in (H, S):
            return r
    raise AssertionError(f"{engine} never left serving: {fleet.state(engine)}")


# -- the windowed rule ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("s", "f", "verdict"),
    [
        (3000, 3, Verdict.PASS),  # a bad shard among heavy traffic
        (0, 3, Verdict.FAIL),  # three failures, nothing served
        (3, 3, Verdict.FAIL),  # at the fraction threshold
        (4, 3, Verdict.PASS),  # under it
        (0, 2, Verdict.NONE),  # too few to condemn, too failing to vouch
        (0, 0, Verdict.NONE),  # no traffic
        (1, 0, Verdict.PASS),
    ],
)
def test_window_verdict(s: int, f: int, verdict: Verdict) -> None:
    assert judge_window(s, f, HealthPolicy()) is verdict


def test_window_thresholds_are_configurable() -> None:
    strict = HealthPolicy(window_min_failures=1, window_failure_fraction=0.0005)
    assert judge_window(3000, 3, strict) is Verdict.FAIL
    assert judge_window(0, 2, HealthPolicy(window_min_failures=2)) is Verdict.FAIL


def test_tick_fails_if_either_source_fails_and_passes_only_on_evidence() -> None:
    p = HealthPolicy()
    assert judge_tick(FAIL, (3000, 0), p).verdict is Verdict.FAIL  # probe alone condemns the tick
    wedged = judge_tick(ProbeResult(True), (0, 5), p)  # passes probes, fails every request
    assert wedged.verdict is Verdict.FAIL and "5 failure(s)" in wedged.reason
    assert judge_tick(ProbeResult(True), None, p).verdict is Verdict.PASS
    assert judge_tick(None, (10, 0), p).verdict is Verdict.PASS
    assert judge_tick(None, (0, 0), p).verdict is Verdict.NONE
    assert judge_tick(None, None, p).verdict is Verdict.NONE
    assert "timeout after 2 s" in judge_tick(FAIL, None, p).reason


def test_few_failures_among_thousands_of_successes_stay_healthy() -> None:
    fleet, clock = make(2)
    for _ in range(20):
        r = tick(fleet, clock, outcomes={url(0): (3000, 3), url(1): (2900, 0)})
        assert r.events == []
    assert fleet.state("e0") is H and r.serving_urls == [url(0), url(1)]


def test_three_failures_and_no_success_go_suspect_then_dead_over_ticks() -> None:
    fleet, clock = make(2)
    seen = []
    for _ in range(3):
        r = tick(fleet, clock, outcomes={url(0): (0, 3)}, all_ok=False)
        seen.append(fleet.state("e0"))
    assert seen == [S, S, RS]
    assert transitions(r) == [("e0", "SUSPECT", "DEAD"), ("e0", "DEAD", "RESTARTING")]
    assert r.to_restart == ["e0"] and r.serving_urls == [url(1)]


def test_wedged_engine_passing_probes_but_failing_requests_goes_dead() -> None:
    fleet, clock = make(2)
    r = tick(fleet, clock, outcomes={url(0): (0, 7), url(1): (50, 0)})
    assert fleet.state("e0") is S
    assert r.serving_urls == [url(0), url(1)]  # still served: only traffic can confirm a request-level fault
    tick(fleet, clock, outcomes={url(0): (0, 6)})
    r = tick(fleet, clock, outcomes={url(0): (1, 9)})
    assert fleet.state("e0") is RS and r.to_restart == ["e0"]
    dead = next(e for e in r.events if e["to_state"] == "DEAD")
    assert "router saw 9 failure(s)" in dead["reason"] and "3 failing ticks" in dead["reason"]


def test_quiet_tick_is_no_evidence() -> None:
    fleet, clock = make(1)
    tick(fleet, clock, {url(0): FAIL})
    before = fleet.engine("e0")
    r = tick(fleet, clock, all_ok=False)  # no probe, no traffic
    after = fleet.engine("e0")
    assert r.events == [] and after.state is S
    assert (after.strikes, after.consecutive_failures, after.consecutive_successes) == (
        before.strikes,
        before.consecutive_failures,
        before.consecutive_successes,
    )


# -- HEALTHY <-> SUSPECT -> DEAD ----------------------------------------------------------------------
def test_one_failure_makes_suspect_and_a_failed_probe_holds_it_out() -> None:
    fleet, clock = make(3)
    r = tick(fleet, clock, {url(1): FAIL})
    assert transitions(r) == [("e1", "HEALTHY", "SUSPECT")]
    assert r.events[0]["level"] == "warning" and "timeout after 2 s" in r.events[0]["reason"]
    assert r.serving_urls == [url(0), url(2)]  # cannot answer /health: would hang requests
    assert fleet.engine("e1").last_reason.startswith("health probe failed")


def test_suspect_needs_two_passing_ticks_to_be_healthy_again() -> None:
    fleet, clock = make(2)
    tick(fleet, clock, {url(0): FAIL})
    r = tick(fleet, clock)
    assert fleet.state("e0") is S and r.events == []
    assert r.serving_urls == [url(0), url(1)]  # back in rotation once its probe passes
    r = tick(fleet, clock)
    assert transitions(r) == [("e0", "SUSPECT", "HEALTHY")]
    assert fleet.engine("e0").strikes == 0


def test_recovered_engine_starts_its_strikes_afresh() -> None:
    fleet, clock = make(1)
    for probe in (FAIL, FAIL, True, True, FAIL, FAIL):
        tick(fleet, clock, {url(0): probe})
    assert fleet.state("e0") is S and fleet.engine("e0").strikes == 2


def test_flapping_suspect_still_dies() -> None:
    """A lone pass does not reset the strikes: pass/fail flapping ends in DEAD, not in SUSPECT forever."""
    fleet, clock = make(2)
    for probe in (FAIL, True, FAIL, True):
        tick(fleet, clock, {url(0): probe})
        assert fleet.state("e0") is S
    r = tick(fleet, clock, {url(0): FAIL})
    assert ("e0", "SUSPECT", "DEAD") in transitions(r)


def test_suspect_after_is_configurable() -> None:
    fleet, clock = make(2, suspect_after=2, dead_after=4)
    tick(fleet, clock, {url(0): FAIL})
    assert fleet.state("e0") is H
    tick(fleet, clock)  # a pass while HEALTHY clears it
    tick(fleet, clock, {url(0): FAIL})
    assert fleet.state("e0") is H
    tick(fleet, clock, {url(0): FAIL})
    assert fleet.state("e0") is S
    tick(fleet, clock, {url(0): FAIL})
    assert fleet.state("e0") is S
    tick(fleet, clock, {url(0): FAIL})
    assert fleet.state("e0") is RS


def test_hold_out_never_empties_the_serving_set() -> None:
    fleet, clock = make(2)
    r = tick(fleet, clock, {url(0): FAIL, url(1): FAIL})
    assert fleet.state("e0") is S and fleet.state("e1") is S
    assert r.serving_urls == [url(0), url(1)]  # e.g. a driver too busy to probe in time


def test_hold_out_can_be_switched_off() -> None:
    fleet, clock = make(2, hold_out_failed_probe=False)
    r = tick(fleet, clock, {url(0): FAIL})
    assert fleet.state("e0") is S and r.serving_urls == [url(0), url(1)]


def test_mark_dead_condemns_at_once() -> None:
    fleet, clock = make(2)
    assert fleet.mark_dead("e1", "engine process exited with -9")
    assert fleet.state("e1") is D
    assert fleet.serving_urls() == [url(0)]
    r = tick(fleet, clock)
    assert transitions(r) == [("e1", "HEALTHY", "DEAD"), ("e1", "DEAD", "RESTARTING")]
    assert r.to_restart == ["e1"] and "exited with -9" in r.events[1]["reason"]
    assert not fleet.mark_dead("e1", "exited again")  # RESTARTING: that is restart_failed's business
    assert fleet.state("e1") is RS


# -- restarts: new URL, readmission only after checks ---------------------------------------------------
def test_restart_comes_back_on_a_new_url_and_is_readmitted_only_after_two_probes() -> None:
    fleet, clock = make(2)
    r = kill(fleet, clock, "e0")
    assert r.to_restart == ["e0"] and fleet.engine("e0").restarts == 1
    assert fleet.probe_targets() == {"e1": url(1)}
    r = tick(fleet, clock)
    assert r.to_restart == [] and fleet.state("e0") is RS  # asked once, not every tick

    fleet.restarted("e0", "http://10.0.0.1:9100/v1")
    rec = fleet.engine("e0")
    assert (rec.id, rec.node, rec.url, rec.state) == ("e0", "node0", "http://10.0.0.1:9100", RC)
    assert rec.previous_urls == [url(0)]
    assert fleet.probe_targets() == {"e0": "http://10.0.0.1:9100", "e1": url(1)}

    r = tick(fleet, clock, outcomes={"http://10.0.0.1:9100": (0, 50)})  # router outcomes are ignored
    assert transitions(r) == [("e0", "RESTARTING", "RECOVERING")]
    assert r.serving_urls == [url(1)] and fleet.state("e0") is RC  # one pass: not yet
    r = tick(fleet, clock, {url(0): FAIL})  # a stale probe of the old port counts for nobody
    assert transitions(r) == [("e0", "RECOVERING", "HEALTHY")]
    assert r.serving_urls == ["http://10.0.0.1:9100", url(1)]
    assert "readmitted on http://10.0.0.1:9100" in r.events[0]["reason"]


def test_recovering_failed_probes_reset_the_count_then_kill_it() -> None:
    fleet, clock = make(2)
    kill(fleet, clock, "e0")
    fleet.restarted("e0", url(10))
    tick(fleet, clock)
    tick(fleet, clock, {url(10): FAIL})
    tick(fleet, clock)
    assert fleet.state("e0") is RC  # pass, fail, pass: never two in a row
    tick(fleet, clock, {url(10): FAIL})
    r = tick(fleet, clock, {url(10): FAIL})
    assert ("e0", "RECOVERING", "DEAD") in transitions(r) and r.to_restart == ["e0"]
    assert fleet.engine("e0").restarts == 2


def test_recovering_times_out() -> None:
    fleet, clock = make(2, recovery_timeout_s=30)
    kill(fleet, clock, "e0")
    fleet.restarted("e0", url(10))
    r = tick(fleet, clock, all_ok=False)
    assert fleet.state("e0") is RC and r.events[0]["to_state"] == "RECOVERING"
    clock.t += 30
    r = tick(fleet, clock, all_ok=False)
    assert transitions(r) == [("e0", "RECOVERING", "DEAD"), ("e0", "DEAD", "RESTARTING")]
    assert "not readmitted within 30 s" in r.events[0]["reason"]


def test_restart_failed_goes_dead_and_the_next_tick_restarts_again() -> None:
    fleet, clock = make(2)
    kill(fleet, clock, "e0")
    clock.t += 5
    fleet.restart_failed("e0", "srun step exited 1")
    assert fleet.state("e0") is D
    r = tick(fleet, clock)
    assert transitions(r) == [("e0", "RESTARTING", "DEAD"), ("e0", "DEAD", "RESTARTING")]
    assert r.events[0]["time"] == 1000.0 + 3 + 5  # stamped when reported, delivered with the tick
    assert r.to_restart == ["e0"] and fleet.engine("e0").restarts == 2 and fleet.run_restarts == 2


def test_driver_reports_are_checked() -> None:
    fleet, clock = make(2)
    with pytest.raises(ValueError, match="unknown engine"):
        fleet.restarted("nope", url(9))
    with pytest.raises(ValueError, match="while the engine is HEALTHY"):
        fleet.restarted("e0", url(9))
    with pytest.raises(ValueError, match="while the engine is HEALTHY"):
        fleet.restart_failed("e0", "x")
    kill(fleet, clock, "e0")
    with pytest.raises(ValueError, match="which engine 'e1' uses"):
        fleet.restarted("e0", url(1) + "/v1")
    with pytest.raises(ValueError, match="no port"):
        fleet.restarted("e0", "http://10.0.0.1/v1")
    fleet.restarted("e0", url(0))  # the OS may hand the same port back: allowed
    assert fleet.engine("e0").previous_urls == []


# -- budgets and retirement ---------------------------------------------------------------------------
def test_per_engine_budget_retires_loudly() -> None:
    fleet, clock = make(2, restarts_per_engine=2)
    for n in (1, 2):
        kill(fleet, clock, "e0")
        assert fleet.engine("e0").restarts == n
        fleet.restarted("e0", url(10 + n))
        tick(fleet, clock)
        tick(fleet, clock)
        assert fleet.state("e0") is H
    r = kill(fleet, clock, "e0")
    assert fleet.state("e0") is RT and r.to_restart == [] and r.retired == ["e0"]
    retired = r.events[-1]
    assert (retired["from_state"], retired["to_state"], retired["level"]) == ("DEAD", "RETIRED", "error")
    assert "restarted 2/2 times" in retired["reason"] and "health probe failed" in retired["reason"]
    assert r.serving_urls == [url(1)] and r.fatal is None
    assert fleet.probe_targets() == {"e1": url(1)}
    r = tick(fleet, clock)
    assert r.events == [] and r.retired == [] and fleet.state("e0") is RT  # terminal


def test_per_run_budget_defaults_to_twice_the_fleet_and_retires_when_spent() -> None:
    fleet, _ = make(3)
    assert fleet.snapshot()["budget"]["run_total"] == 6
    fleet, clock = make(3, restarts_per_run=1)
    kill(fleet, clock, "e0")
    r = kill(fleet, clock, "e1")
    assert fleet.state("e1") is RT and r.retired == ["e1"]
    assert "run restart budget spent: 1/1" in r.events[-1]["reason"]
    assert fleet.engine("e1").restarts == 0


def test_restart_failures_spend_the_budget_too() -> None:
    fleet, clock = make(1, restarts_per_engine=2)
    kill(fleet, clock, "e0")
    fleet.restart_failed("e0", "node down")
    tick(fleet, clock)
    fleet.restart_failed("e0", "node down")
    r = tick(fleet, clock)
    assert fleet.state("e0") is RT and "restart failed: node down" in r.events[-1]["reason"]


# -- fatal ------------------------------------------------------------------------------------------------
def test_fatal_only_when_nothing_serves_or_can_come_back() -> None:
    fleet, clock = make(2, restarts_per_engine=1)
    kill(fleet, clock, "e0")
    r = kill(fleet, clock, "e1")
    assert r.fatal is None and r.serving_urls == []  # both restarting: wait for them
    fleet.restarted("e0", url(10))
    fleet.restart_failed("e1", "out of GPU memory")
    r = tick(fleet, clock, {url(10): FAIL})
    assert fleet.state("e1") is RT and r.fatal is None  # e0 is still recovering
    tick(fleet, clock, {url(10): FAIL})
    r = tick(fleet, clock, {url(10): FAIL})
    assert fleet.state("e0") is RT and r.serving_urls == []
    assert r.fatal is not None and "all 2 engine(s) are RETIRED" in r.fatal
    assert "out of GPU memory" in r.fatal and "e0 on node0" in r.fatal
    assert tick(fleet, clock).fatal == r.fatal  # stays fatal


def test_fatal_with_no_restart_budget() -> None:
    fleet, clock = make(1, restarts_per_engine=0)
    r = kill(fleet, clock, "e0")
    assert r.to_restart == [] and r.retired == ["e0"]
    assert r.fatal and "0/2 run restarts used" in r.fatal


# -- the serving set, snapshot, construction -------------------------------------------------------------
def test_serving_set_is_the_whole_set_every_tick() -> None:
    fleet, clock = make(3)
    results = [tick(fleet, clock) for _ in range(3)]
    assert all(r.serving_urls == [url(0), url(1), url(2)] for r in results)
    r = tick(fleet, clock, {url(1): FAIL})
    assert r.serving_urls == [url(0), url(2)]
    r = tick(fleet, clock, {url(1): FAIL})
    assert r.serving_urls == [url(0), url(2)]  # unchanged: repeated whole, not an empty delta


def test_probes_accept_bools_and_any_url_spelling() -> None:
    fleet, _ = make(2)
    r = fleet.observe(TickInput(probes={url(0) + "/v1/": False, url(1): True}))
    assert fleet.state("e0") is S and r.serving_urls == [url(1)]
    r = fleet.observe(TickInput(outcomes={url(1) + "/v1": (0, 2), url(1): (0, 1)}))  # summed: 3 failures
    assert fleet.state("e1") is S
    fleet.observe(TickInput(probes={"http://10.9.9.9:1": False}, outcomes={"http://10.9.9.9:1": (0, 9)}))
    assert fleet.state("e0") is S and fleet.engine("e0").strikes == 1  # unknown URLs: ignored


def test_snapshot_is_json_serialisable_and_complete() -> None:
    fleet, clock = make(3, restarts_per_engine=1)
    kill(fleet, clock, "e1")
    fleet.restarted("e1", url(11))
    tick(fleet, clock, {url(2): FAIL}, outcomes={url(0): (10, 1)})
    snap = json.loads(json.dumps(fleet.snapshot()))
    e0, e1, e2 = snap["engines"]
    assert e0["last_window"] == {"successes": 10, "failures": 1} and e0["serving"]
    assert (e1["state"], e1["url"], e1["restarts"], e1["restarts_left"]) == ("RECOVERING", url(11), 1, 0)
    assert e1["previous_urls"] == [url(1)] and not e1["serving"]
    assert (e2["state"], e2["serving"], e2["last_probe_ok"]) == ("SUSPECT", False, False)
    assert e2["consecutive_failures"] == 1 and e2["strikes"] == 1 and "timeout" in e2["last_reason"]
    assert snap["totals"] == {
        "HEALTHY": 1,
        "SUSPECT": 1,
        "DEAD": 0,
        "RESTARTING": 0,
        "RECOVERING": 1,
        "RETIRED": 0,
        "STALE": 0,
        "DRAINING": 0,
        "engines": 3,
        "serving": 1,
    }
    assert snap["budget"] == {"per_engine": 1, "run_total": 6, "run_used": 1, "run_left": 5}
    assert snap["fatal"] is None and snap["time"] == clock.t
    assert snap["policy"]["dead_after"] == 3
    assert [e["to_state"] for e in snap["recent_events"]][-3:] == ["RESTARTING", "RECOVERING", "SUSPECT"]


def test_construction_is_checked() -> None:
    with pytest.raises(ValueError, match="at least one engine"):
        FleetHealth([])
    with pytest.raises(ValueError, match="duplicate engine id"):
        FleetHealth([EngineRecord("a", "n", url(0)), EngineRecord("a", "n", url(1))])
    with pytest.raises(ValueError, match="share the URL"):
        FleetHealth([EngineRecord("a", "n", url(0) + "/v1"), EngineRecord("b", "n", url(0))])
    mine = EngineRecord("a", "n", url(0) + "/v1")
    fleet = FleetHealth([mine])
    fleet.mark_dead("a", "x")
    assert mine.state is H and mine.url == url(0) + "/v1"  # the caller's record is not the machine's


@pytest.mark.parametrize(
    "bad",
    [
        {"suspect_after": 3, "dead_after": 3},
        {"suspect_after": 0},
        {"healthy_after": 0},
        {"window_failure_fraction": 0.0},
        {"window_failure_fraction": 1.5},
        {"restarts_per_engine": -1},
        {"restarts_per_run": -1},
        {"recovery_timeout_s": 0},
    ],
)
def test_policy_is_validated(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        HealthPolicy(**bad)  # type: ignore[arg-type]


# -- STALE: the front's verdict on weight versions, followed -------------------------------------------
ST = EngineState.STALE
NEW = "http://10.0.0.1:9100"
OLD_WEIGHTS = "serves version 'default', the fleet is on 'step-7'"


def restart_e0(fleet: FleetHealth, clock: Clock, new_url: str = NEW) -> None:
    kill(fleet, clock, "e0")
    fleet.restarted("e0", new_url + "/v1")


def test_nothing_is_stale_while_the_front_holds_nothing_out() -> None:
    fleet, clock = make(2)
    restart_e0(fleet, clock)
    front_tick(fleet, clock, {})
    r = front_tick(fleet, clock, {})
    assert fleet.state("e0") is H and NEW in r.serving_urls and r.stale_urls == []
    r = front_tick(fleet, clock, None)  # the front did not answer: nothing changes on that
    assert fleet.state("e0") is H and NEW in r.serving_urls


def test_restarted_engine_held_out_by_the_front_is_stale_until_stamped() -> None:
    fleet, clock = make(2)
    restart_e0(fleet, clock)
    front_tick(fleet, clock, {})
    r = front_tick(fleet, clock, {})  # readmission due: pushed, and the front checks its version
    assert transitions(r) == [("e0", "RECOVERING", "HEALTHY")] and NEW in r.serving_urls
    r = front_tick(fleet, clock, {NEW + "/v1": "weight version not verified yet"})
    assert transitions(r) == [("e0", "HEALTHY", "STALE")] and r.stale_urls == [NEW]
    assert NEW not in r.serving_urls and "not verified yet" in r.events[0]["reason"]
    assert r.events[0]["level"] == "warning" and r.fatal is None
    assert fleet.probe_targets()["e0"] == NEW  # still probed
    r = front_tick(fleet, clock, {NEW: OLD_WEIGHTS})  # the front's verdict: the reason follows it
    assert fleet.state("e0") is ST and r.events == [] and NEW not in r.serving_urls
    assert "'default'" in fleet.engine("e0").last_reason
    r = front_tick(fleet, clock, None)  # the front did not answer: no evidence, stays out
    assert fleet.state("e0") is ST and r.events == [] and NEW not in r.serving_urls
    r = front_tick(fleet, clock, {})  # the trainer refit and stamped it: the front readmitted it
    assert transitions(r) == [("e0", "STALE", "HEALTHY")] and NEW in r.serving_urls and r.stale_urls == []
    assert fleet.snapshot()["totals"]["STALE"] == 0


def test_serving_engine_held_out_goes_stale_and_stale_can_die() -> None:
    fleet, clock = make(3)
    r = front_tick(fleet, clock, {url(1): OLD_WEIGHTS})
    assert transitions(r) == [("e1", "HEALTHY", "STALE")] and url(1) not in r.serving_urls
    for _ in range(3):
        clock.t += 1.0
        r = fleet.observe(TickInput(probes={url(1): FAIL, url(0): True, url(2): True}, stale={url(1): "x"}))
    assert ("e1", "STALE", "DEAD") in transitions(r) and r.to_restart == ["e1"]
    fleet2, clock2 = make(1)
    front_tick(fleet2, clock2, {url(0): OLD_WEIGHTS})
    assert fleet2.state("e0") is ST and fleet2.mark_dead("e0", "process exited")
