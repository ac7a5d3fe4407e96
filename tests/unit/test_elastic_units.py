"""Unit tests of the elastic fleet's pure parts: the tail policy, the health machine's membership
(``add`` / ``drain`` / ``remove`` and the DRAINING state), the CLI <-> driver file exchange, the grow job's
batch script and time limit, and the grow holder's reasons to end.

Why these, and why here: ``tests/local/test_elastic_local.py`` runs the whole fleet (Ray, engine hosts, a
router) and only sees what a replay sees; the rules below decide *when* nodes are given back or asked
for, which engines the router may use while a node leaves, and what Slurm is asked for. Each is pure (or
touches only files under ``tmp_path``), so every edge is pinned here in milliseconds: no Ray, no Slurm, no
subprocess (``shellcheck`` alone, when it is installed). Time is injected (``Reading.now``, a fake clock).
"""

from __future__ import annotations

import json
import shlex
import shutil
import stat
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from launcher.fleet import EngineRecord, EngineState, FleetHealth, HealthPolicy, ProbeResult, TickInput
from launcher.fleet.elastic import holder, shapes, slurm_ops
from launcher.fleet.elastic.shapes import ElasticAnswer, ElasticRequest
from launcher.fleet.elastic.slurm_ops import SlurmRefused, grow_script, grow_time_limit_s
from launcher.fleet.elastic.tail import Decision, Reading, TailPolicy, TailSettings
from launcher.spec import ResolvedSpec, parse_spec
from tests.support.fleet_health import Clock, url

# ===================================================================================================
# The tail policy
# ===================================================================================================

CAP = 40
"""4 nodes x 10 requests: the shrink threshold (25 %) is 10 in flight."""


def reading(now: float, in_flight: int, nodes: int = 4, capacity: int = CAP, **kw: Any) -> Reading:
    return Reading(now=now, in_flight=in_flight, capacity=capacity, nodes=nodes, **kw)


def armed(settings: TailSettings | None = None, version: str | None = "v1") -> TailPolicy:
    """A policy that saw the step's load (in flight == the threshold) at t=0."""
    policy = TailPolicy(settings or TailSettings())
    assert policy.observe(reading(0, 10, version=version)) is None
    return policy


def shrunk(version: str = "v1") -> TailPolicy:
    """A policy that shrank a 4-node fleet to 1 node (3 given back) at t=40."""
    policy = armed(version=version)
    assert policy.observe(reading(10, 2, version=version)) is None
    decision = policy.observe(reading(40, 2, version=version))
    assert decision is not None and decision.op == "shrink" and decision.nodes == 3
    assert policy.given_back == 3
    return policy


def test_a_quiet_fleet_is_never_shrunk_before_it_is_armed() -> None:
    policy = TailPolicy(TailSettings())
    # idle before the first step, for far longer than for_s, and just below the threshold
    for t in range(0, 1000, 5):
        assert policy.observe(reading(t, 0)) is None
    for t in range(1000, 2000, 5):
        assert policy.observe(reading(t, 9)) is None
    assert policy.given_back == 0


def test_arms_at_the_threshold_and_shrinks_to_the_floor_after_for_s() -> None:
    policy = armed()  # in flight 10 == 25 % of 40: armed
    assert policy.observe(reading(100, 2)) is None  # the low timer starts here
    assert policy.observe(reading(115, 3)) is None
    assert policy.observe(reading(129.9, 2)) is None  # 29.9 s below: not yet
    decision = policy.observe(reading(130, 2))
    assert decision is not None
    assert decision.op == "shrink"
    assert decision.nodes == 4 - 1
    for words in ("in-flight 2", "25%", "capacity 40", "for 30 s", "3 node(s) back", "1 kept"):
        assert words in decision.reason, (words, decision.reason)
    assert policy.given_back == 3


def test_shrink_gives_back_nodes_minus_floor() -> None:
    policy = armed(TailSettings(floor_nodes=2, for_s=5))
    assert policy.observe(reading(1, 1, nodes=7, capacity=70)) is None
    decision = policy.observe(reading(6, 1, nodes=7, capacity=70))
    assert isinstance(decision, Decision)
    assert (decision.op, decision.nodes) == ("shrink", 5)
    assert "5 node(s) back" in decision.reason and "2 kept" in decision.reason


def test_a_dip_shorter_than_for_s_does_not_shrink_and_restarts_the_timer() -> None:
    policy = armed()
    assert policy.observe(reading(100, 2)) is None  # low since 100
    assert policy.observe(reading(125, 2)) is None
    assert policy.observe(reading(128, 10)) is None  # recovered: the dip (28 s) was a turn's gap
    assert policy.observe(reading(131, 2)) is None  # low since 131: 100 no longer counts
    assert policy.observe(reading(140, 2)) is None  # 40 s after the first dip began, 9 s after this one
    assert policy.observe(reading(160.5, 2)) is None
    decision = policy.observe(reading(161, 2))  # 30 s after 131
    assert decision is not None and decision.op == "shrink"


def test_no_decision_while_busy() -> None:
    policy = armed()
    assert policy.observe(reading(100, 2)) is None
    # low long past for_s, but a resize is under way
    assert policy.observe(reading(200, 2, busy=True)) is None
    assert policy.given_back == 0
    decision = policy.observe(reading(201, 2))
    assert decision is not None and decision.op == "shrink"

    # and no grow while busy, whatever the version or the load
    assert policy.observe(reading(300, 2, nodes=1, capacity=10, version="v2", busy=True)) is None
    assert policy.observe(reading(301, 10, nodes=1, capacity=10, busy=True)) is None
    assert policy.given_back == 3


def test_grows_back_what_it_gave_when_the_version_changes() -> None:
    policy = shrunk("v1")
    # the shrunk fleet: same version, light load, or no version known (the front did not answer)
    assert policy.observe(reading(50, 2, nodes=1, capacity=10, version="v1")) is None
    assert policy.observe(reading(60, 2, nodes=1, capacity=10, version=None)) is None
    decision = policy.observe(reading(70, 2, nodes=1, capacity=10, version="v2"))
    assert decision is not None
    assert decision.op == "grow" and decision.nodes == 3
    assert "weight version changed" in decision.reason and "v1 -> v2" in decision.reason
    assert "3 node(s) asked back" in decision.reason
    assert policy.given_back == 0
    # nothing is given back any more: another version change asks for nothing
    assert policy.observe(reading(80, 2, nodes=4, capacity=40, version="v3")) is None


def test_grows_back_when_the_load_passes_grow_above() -> None:
    policy = shrunk("v1")
    # 75 % of the shrunk fleet's 10 is 7.5: 7 stays, 8 asks the nodes back
    assert policy.observe(reading(50, 7, nodes=1, capacity=10, version="v1")) is None
    decision = policy.observe(reading(51, 8, nodes=1, capacity=10, version="v1"))
    assert decision is not None and decision.op == "grow" and decision.nodes == 3
    assert "in-flight 8 > 75%" in decision.reason and "capacity 10" in decision.reason
    assert policy.given_back == 0


def test_grow_above_is_strictly_above() -> None:
    policy = shrunk("v1")
    # 75 % of 8 is exactly 6: at it, the shrunk fleet still copes; one more asks the nodes back
    assert policy.observe(reading(50, 6, nodes=1, capacity=8, version="v1")) is None
    decision = policy.observe(reading(51, 7, nodes=1, capacity=8, version="v1"))
    assert decision is not None and decision.op == "grow" and decision.nodes == 3


def test_grow_back_false_never_grows() -> None:
    policy = armed(TailSettings(grow_back=False))
    assert policy.observe(reading(10, 2)) is None
    assert policy.observe(reading(40, 2)) is not None
    assert policy.observe(reading(50, 10, nodes=1, capacity=10, version="v2")) is None
    assert policy.given_back == 3


def test_after_a_grow_it_must_be_armed_again_before_shrinking() -> None:
    policy = shrunk("v1")
    # the shrink left 2 nodes (one would not drain in time), and the step's last turns loaded them:
    # that load belongs to the step that is ending, not to the next one
    assert policy.observe(reading(45, 10, nodes=2, capacity=20, version="v1")) is None
    assert policy.observe(reading(50, 2, nodes=2, capacity=20, version="v2")) is not None  # grow
    # the grown fleet is quiet (the next step has not loaded it yet): no shrink, however long
    for t in range(60, 400, 10):
        assert policy.observe(reading(t, 2, version="v2")) is None
    assert policy.observe(reading(400, 10, version="v2")) is None  # armed again
    assert policy.observe(reading(410, 2, version="v2")) is None
    decision = policy.observe(reading(440, 2, version="v2"))
    assert decision is not None and decision.op == "shrink" and decision.nodes == 3


@pytest.mark.parametrize(("nodes", "floor"), [(1, 1), (2, 2), (1, 2), (3, 3)])
def test_never_shrinks_at_or_below_the_floor(nodes: int, floor: int) -> None:
    policy = TailPolicy(TailSettings(floor_nodes=floor))
    capacity = 10 * nodes
    assert policy.observe(reading(0, capacity, nodes=nodes, capacity=capacity)) is None
    for t in range(1, 500, 7):
        assert policy.observe(reading(t, 0, nodes=nodes, capacity=capacity)) is None
    assert policy.given_back == 0


def test_no_capacity_is_no_decision() -> None:
    policy = armed()
    for t in range(1, 200, 10):
        assert policy.observe(reading(t, 0, capacity=0)) is None


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"floor_nodes": 0}, "floor_nodes must be >= 1"),
        ({"shrink_below": 0.0}, "shrink_below must be in (0, 1)"),
        ({"shrink_below": 1.0}, "shrink_below must be in (0, 1)"),
        ({"for_s": 0.0}, "for_s must be > 0"),
        ({"for_s": -1.0}, "for_s must be > 0"),
        ({"grow_above": 0.0}, "grow_above must be in (0, 1]"),
        ({"grow_above": 1.5}, "grow_above must be in (0, 1]"),
    ],
)
def test_tail_settings_refuse(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError) as info:
        TailSettings(**kwargs)
    assert words in str(info.value)


def test_tail_settings_accept_the_bounds() -> None:
    TailSettings(floor_nodes=1, shrink_below=0.01, for_s=0.001, grow_above=1.0)


# ===================================================================================================
# FleetHealth membership: add, drain, remove, DRAINING
# ===================================================================================================

H, DR, RT = EngineState.HEALTHY, EngineState.DRAINING, EngineState.RETIRED


def fleet_of(n: int = 2, **policy: Any) -> tuple[FleetHealth, Clock]:
    clock = Clock()
    engines = [EngineRecord(f"e{i}", f"node{i}", url(i) + "/v1") for i in range(n)]
    return FleetHealth(engines, HealthPolicy(**policy), clock=clock), clock


def tick(fleet: FleetHealth, clock: Clock, fail: tuple[str, ...] = ()) -> Any:
    """One tick 1 s later: every probe target passes except the ids in ``fail``."""
    clock.t += 1.0
    targets = fleet.probe_targets()
    probes = {u: ProbeResult(eid not in fail, "refused") for eid, u in targets.items()}
    return fleet.observe(TickInput(probes=probes))  # stale None: no engine enters or leaves STALE


def put_in(fleet: FleetHealth, clock: Clock, eid: str, state: EngineState) -> None:
    """Drive engine ``eid`` into ``state`` through the machine's own transitions."""
    if state is EngineState.HEALTHY:
        pass
    elif state is EngineState.SUSPECT:
        tick(fleet, clock, fail=(eid,))
    elif state is EngineState.DEAD:
        assert fleet.mark_dead(eid, "exited 1")
    elif state is EngineState.RESTARTING:
        assert fleet.mark_dead(eid, "exited 1")
        assert eid in tick(fleet, clock).to_restart
    elif state is EngineState.RECOVERING:
        put_in(fleet, clock, eid, EngineState.RESTARTING)
        fleet.restarted(eid, "http://10.0.0.1:9999/v1")
    elif state is EngineState.STALE:
        clock.t += 1.0
        fleet.observe(TickInput(stale={fleet.engine(eid).url: "serves v0, the fleet v1"}))
    elif state is EngineState.RETIRED:
        assert fleet.policy.restarts_per_engine == 0
        assert fleet.mark_dead(eid, "exited 1")
        assert eid in tick(fleet, clock).retired
    elif state is EngineState.DRAINING:
        assert fleet.drain(eid, "shrink")
    assert fleet.state(eid) is state


def new_engines(*ids: int) -> list[EngineRecord]:
    return [EngineRecord(f"e{i}", f"node{i}", url(i) + "/v1") for i in ids]


def test_add_joins_healthy_with_a_new_event_and_grows_the_run_budget() -> None:
    fleet, clock = fleet_of(2)
    assert fleet.run_budget == 4
    clock.t = 2000.0
    fleet.add(new_engines(2, 3), "grow g1")
    assert fleet.state("e2") is H and fleet.state("e3") is H
    assert fleet.engine("e2").url == url(2)  # canonical: the /v1 is gone
    assert fleet.engine("e2").since == 2000.0
    assert fleet.run_budget == 4 + 2 * 2
    assert fleet.serving_urls() == [url(0), url(1), url(2), url(3)]
    assert set(fleet.probe_targets()) == {"e0", "e1", "e2", "e3"}
    result = tick(fleet, clock)
    joined = [e for e in result.events if e["from_state"] == "(new)"]
    assert [(e["engine_id"], e["to_state"], e["reason"], e["level"]) for e in joined] == [
        ("e2", "HEALTHY", "grow g1", "info"),
        ("e3", "HEALTHY", "grow g1", "info"),
    ]
    assert result.serving_urls == [url(0), url(1), url(2), url(3)]
    snap = fleet.snapshot()
    assert snap["budget"]["run_total"] == 8
    assert [e["id"] for e in snap["engines"]] == ["e0", "e1", "e2", "e3"]


def test_add_keeps_a_fixed_run_budget() -> None:
    fleet, _ = fleet_of(2, restarts_per_run=5)
    assert fleet.run_budget == 5
    fleet.add(new_engines(2, 3, 4), "grow g1")
    assert fleet.run_budget == 5


@pytest.mark.parametrize(
    "records",
    [
        [EngineRecord("e1", "node9", url(9))],  # an id the fleet has
        [EngineRecord("e7", "node9", url(1) + "/v1/")],  # another spelling of e1's URL
        [EngineRecord("e7", "node9", url(7)), EngineRecord("e8", "node9", url(7))],  # among themselves
        [EngineRecord("e7", "node9", url(7)), EngineRecord("e7", "node9", url(8))],
    ],
)
def test_add_refuses_a_duplicate_id_or_url(records: list[EngineRecord]) -> None:
    fleet, _ = fleet_of(2)
    with pytest.raises(ValueError, match=r"duplicate engine id|share the URL"):
        fleet.add(records, "grow g1")


def test_a_refused_add_changes_nothing() -> None:
    fleet, _ = fleet_of(2)
    with pytest.raises(ValueError):
        fleet.add([EngineRecord("e7", "node9", url(1))], "grow g1")
    assert [e["id"] for e in fleet.snapshot()["engines"]] == ["e0", "e1"]
    assert fleet.serving_urls() == [url(0), url(1)]
    fleet.add(new_engines(2), "grow g2")  # and the fleet can still grow
    assert fleet.state("e2") is H


_RESTARTED = (EngineState.RESTARTING, EngineState.RECOVERING)


@pytest.mark.parametrize(
    "state",
    [
        EngineState.HEALTHY,
        EngineState.SUSPECT,
        EngineState.DEAD,
        EngineState.RESTARTING,
        EngineState.RECOVERING,
        EngineState.STALE,
    ],
)
def test_drain_moves_any_live_state_to_draining(state: EngineState) -> None:
    fleet, clock = fleet_of(3, restarts_per_engine=3)
    put_in(fleet, clock, "e0", state)  # a DEAD one is not resolved yet: the drain comes first
    assert fleet.drain("e0", "fleet shrink: node0") is True
    assert fleet.state("e0") is DR
    drained_url = fleet.engine("e0").url
    assert drained_url not in fleet.serving_urls()
    assert "e0" not in fleet.probe_targets()
    result = tick(fleet, clock)
    assert drained_url not in result.serving_urls
    assert "e0" not in result.to_restart and "e0" not in result.retired
    moved = [e for e in result.events if e["engine_id"] == "e0" and e["to_state"] == "DRAINING"]
    assert [(e["from_state"], e["reason"], e["level"]) for e in moved] == [
        (str(state), "fleet shrink: node0", "info")
    ]
    assert fleet.state("e0") is DR and fleet.run_restarts == (1 if state in _RESTARTED else 0)
    assert result.fatal is None
    snap = {e["id"]: e for e in fleet.snapshot()["engines"]}
    assert snap["e0"]["state"] == "DRAINING" and snap["e0"]["serving"] is False
    assert fleet.snapshot()["totals"]["DRAINING"] == 1


@pytest.mark.parametrize("state", [EngineState.DRAINING, EngineState.RETIRED])
def test_drain_refuses_draining_and_retired(state: EngineState) -> None:
    fleet, clock = fleet_of(2, restarts_per_engine=0)
    put_in(fleet, clock, "e0", state)
    tick(fleet, clock)
    assert fleet.drain("e0", "again") is False
    assert fleet.state("e0") is state
    assert not [e for e in tick(fleet, clock).events if e["engine_id"] == "e0"]


def test_a_draining_engine_is_never_restarted_nor_judged() -> None:
    fleet, clock = fleet_of(2)
    assert fleet.drain("e0", "shrink")
    assert fleet.mark_dead("e0", "its host exited (stopped by the shrink)") is False
    clock.t += 1.0
    # evidence against its URL (a late probe, the router's last failures) counts for nothing
    for _ in range(10):
        clock.t += 1.0
        result = fleet.observe(
            TickInput(probes={url(0): ProbeResult(False, "refused")}, outcomes={url(0): (0, 50)}, stale={})
        )
        assert result.to_restart == [] and result.retired == []
        assert fleet.state("e0") is DR
    assert fleet.run_restarts == 0
    assert fleet.engine("e0").consecutive_failures == 0


def test_draining_is_not_serving_for_the_fatal_rule() -> None:
    fleet, clock = fleet_of(2, restarts_per_engine=0)
    assert fleet.drain("e0", "shrink")
    assert tick(fleet, clock).fatal is None  # e1 still serves
    put_in(fleet, clock, "e1", EngineState.RETIRED)
    fatal = tick(fleet, clock).fatal
    assert fatal is not None
    assert "DRAINING" in fatal and "1 engine(s) are RETIRED and 1 DRAINING" in fatal
    assert "e1 on node1" in fatal
    assert fleet.snapshot()["fatal"] == fatal


def test_remove_refuses_an_engine_that_is_not_draining() -> None:
    fleet, clock = fleet_of(2)
    for state in (EngineState.HEALTHY, EngineState.SUSPECT):
        put_in(fleet, clock, "e0", state)
        with pytest.raises(ValueError, match="not DRAINING"):
            fleet.remove("e0", "stopped")
        assert fleet.state("e0") is state
    with pytest.raises(ValueError, match="unknown engine id"):
        fleet.remove("e9", "stopped")


def test_remove_forgets_a_drained_engine() -> None:
    fleet, clock = fleet_of(3)
    assert fleet.drain("e1", "shrink node1")
    tick(fleet, clock)
    clock.t = 5000.0
    fleet.remove("e1", "drained and stopped")
    snap = fleet.snapshot()
    assert [e["id"] for e in snap["engines"]] == ["e0", "e2"]
    assert snap["totals"]["engines"] == 2 and snap["totals"]["DRAINING"] == 0
    with pytest.raises(ValueError, match="unknown engine id"):
        fleet.state("e1")
    result = tick(fleet, clock)
    removed = [e for e in result.events if e["engine_id"] == "e1"]
    assert len(removed) == 1
    assert removed[0]["from_state"] == "DRAINING" and removed[0]["to_state"] == "(removed)"
    assert removed[0]["reason"] == "drained and stopped" and removed[0]["time"] == 5000.0
    assert removed[0]["url"] == url(1) and removed[0]["node"] == "node1"
    assert result.serving_urls == [url(0), url(2)]
    assert any(e["to_state"] == "(removed)" for e in snap["recent_events"])
    # its URL is free again: a node grown later may reuse it
    fleet.add([EngineRecord("e5", "node5", url(1))], "grow")
    assert fleet.state("e5") is H


# ===================================================================================================
# The CLI <-> driver files (launcher.fleet.elastic.shapes)
# ===================================================================================================


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_send_take_answer_wait_round_trip(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    first = ElasticRequest("grow", nodes=2, time_limit_s=3600, by="alice", id="0000000000001-aaaaaa")
    second = ElasticRequest("shrink", node_names=["gpu3"], drain_timeout_s=60, id="0000000000002-bbbbbb")
    shapes.send(job, second)
    shapes.send(job, first)
    for d in (shapes.elastic_dir(job), shapes.requests_dir(job), shapes.answers_dir(job)):
        assert d.is_dir() and mode(d) == 0o700, d
    files = sorted(shapes.requests_dir(job).iterdir())
    assert [f.name for f in files] == [f"{first.id}.json", f"{second.id}.json"]  # no temporary left
    assert all(mode(f) == 0o600 for f in files)
    assert json.loads(files[0].read_text()) == asdict(first)

    taken = shapes.take_requests(job)
    assert taken == [first, second]  # oldest first
    assert list(shapes.requests_dir(job).iterdir()) == []  # each removed as it is taken
    assert shapes.take_requests(job) == []

    reply = ElasticAnswer(first.id, True, "grow g1: Slurm job 42", grow_id="g1", nodes=["gpu7", "gpu8"])
    shapes.answer(job, reply)
    path = shapes.answers_dir(job) / f"{first.id}.json"
    assert mode(path) == 0o600
    assert shapes.wait_answer(job, first.id, timeout_s=0) == reply


def test_wait_answer_waits_for_the_answer_and_gives_up(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    start = time.monotonic()
    assert shapes.wait_answer(job, "nobody", timeout_s=0.1, poll_s=0.02) is None
    assert time.monotonic() - start < 2.0

    reply = ElasticAnswer("r1", False, "refused: the fleet has 1 node")
    timer = threading.Timer(0.1, shapes.answer, args=(job, reply))
    timer.start()
    try:
        assert shapes.wait_answer(job, "r1", timeout_s=5, poll_s=0.02) == reply
    finally:
        timer.join()


def test_take_requests_without_a_directory(tmp_path: Path) -> None:
    assert shapes.take_requests(tmp_path) == []


def test_an_unreadable_request_comes_back_as_id_and_why(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    shapes.make_dirs(job)
    reqs = shapes.requests_dir(job)
    (reqs / "01-torn.json").write_text('{"op": "grow", "nod')
    (reqs / "02-noop.json").write_text(json.dumps({"nodes": 2}))  # no op: not a request
    (reqs / "03-list.json").write_text("[1, 2]")
    (reqs / "04-note.txt").write_text("not a request file")
    good = ElasticRequest("cancel", grow_id="g2", id="05-good")
    shapes.send(job, good)
    taken = shapes.take_requests(job)
    assert len(taken) == 4
    assert taken[3] == good
    for (rid, why), name in zip(taken[:3], ("01-torn", "02-noop", "03-list"), strict=True):
        assert rid == name
        assert why.startswith(f"unreadable request {name}.json: ")
    assert sorted(p.name for p in reqs.iterdir()) == ["04-note.txt"]


def test_request_from_json_ignores_unknown_fields() -> None:
    req = ElasticRequest.from_json({"op": "grow", "nodes": 3, "id": "x", "from_the_future": True})
    assert req == ElasticRequest("grow", nodes=3, id="x")


def test_wait_answer_survives_a_foreign_answer_file(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    shapes.make_dirs(job)
    (shapes.answers_dir(job) / "r1.json").write_text(json.dumps({"id": "r1"}))
    assert shapes.wait_answer(job, "r1", timeout_s=0.05, poll_s=0.01) is None


def test_node_seconds() -> None:
    now = 1000.0
    nodes: list[dict[str, Any]] = [
        {"name": "gpu1", "since": 100.0},  # held all along: 900
        {"name": "gpu2", "since": 200.0, "released_at": 600.0},  # held 400, given back 400
        {"name": "gpu3", "since": 900.0, "released_at": 950.0},  # held 50, given back 50
        {"name": "gpu4", "since": None},  # never started: nothing
        {"name": "gpu5"},
    ]
    held, given = shapes.node_seconds(nodes, now)
    assert held == pytest.approx(900 + 400 + 50)
    assert given == pytest.approx(400 + 50)
    assert shapes.node_seconds([], now) == (0.0, 0.0)
    # a node whose 'since' is in the future (a clock a little ahead) counts for nothing, not less
    assert shapes.node_seconds([{"since": 1010.0}], now) == (0.0, 0.0)


# ===================================================================================================
# The grow job (launcher.fleet.elastic.slurm_ops)
# ===================================================================================================


def resolved(tmp_path: Path, generation_slurm: dict[str, Any] | None = None) -> ResolvedSpec:
    data: dict[str, Any] = {
        "name": "t",
        "cluster": "slurm",
        "job_root": str(tmp_path / "jobs"),
        "slurm": {
            "partition": "batch",
            "account": "acct",
            "time": "02:00:00",
            "gpus_per_node": 8,
            "extra_sbatch": ["--mail-type=END"],
        },
        "training": {"nodes": 1, "command": "python train.py"},
        "generation": {"nodes": 2, "model": "Qwen/Qwen3-8B"},
    }
    if generation_slurm is not None:
        data["generation"]["slurm"] = generation_slurm
    return parse_spec(data).resolved()


def render_grow(
    tmp_path: Path,
    spec: ResolvedSpec,
    srun_args: tuple[str, ...] = (),
    time_limit_s: int = 90 * 60 + 59,
) -> tuple[Path, str]:
    job_dir = tmp_path / "jobs" / "t-123"
    script = grow_script(
        spec,
        job_dir,
        "g1",
        3,
        time_limit_s,
        ["gpu10", "gpu2", "gpu2", "gpu1"],
        "123",
        srun_args,
    )
    return job_dir, script


@pytest.mark.parametrize(
    ("generation_slurm", "partition", "gpus"),
    [(None, "batch", 8), ({"partition": "gen", "gpus_per_node": 4}, "gen", 4)],
)
def test_grow_script_asks_for_the_generation_resources(
    tmp_path: Path, generation_slurm: dict[str, Any] | None, partition: str, gpus: int
) -> None:
    spec = resolved(tmp_path, generation_slurm)
    job_dir, script = render_grow(tmp_path, spec)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    directives = [line for line in lines if line.startswith("#SBATCH ")]
    for expected in (
        "--job-name=t-grow",
        "--nodes=3",
        "--ntasks-per-node=1",
        f"--partition={partition}",
        f"--gpus-per-node={gpus}",
        "--account=acct",
        "--exclude=gpu1,gpu2,gpu10",  # every given node once, in Slurm's natural order
        "--time=90",  # 90 min 59 s rounds down
        f"--output={job_dir}/logs/grow-g1-%j.out",
        "--mail-type=END",
    ):
        assert f"#SBATCH {expected}" in directives, (expected, directives)
    assert not any(d.startswith("#SBATCH --time=") and d != "#SBATCH --time=90" for d in directives)
    if partition == "gen":
        assert "#SBATCH --partition=batch" not in directives
        assert "#SBATCH --gpus-per-node=8" not in directives
    # every directive precedes the first command, or sbatch would ignore it
    commands = [i for i, line in enumerate(lines) if line and not line.startswith("#")]
    assert len(commands) == 1
    assert max(i for i, line in enumerate(lines) if line.startswith("#SBATCH")) < commands[0]
    argv = shlex.split(lines[commands[0]])
    assert argv == [
        "exec",
        sys.executable,
        "-m",
        "launcher.fleet.elastic.holder",
        "--job-dir",
        str(job_dir),
        "--fleet-job",
        "123",
        "--grow",
        "g1",
    ]


@pytest.mark.parametrize("limit_s", [60, 61, 119, 3600, 7199])
def test_grow_script_time_is_whole_minutes_within_the_limit(tmp_path: Path, limit_s: int) -> None:
    _, script = render_grow(tmp_path, resolved(tmp_path), time_limit_s=limit_s)
    (minutes,) = [int(line.split("=", 1)[1]) for line in script.splitlines() if "--time=" in line]
    assert minutes == limit_s // 60
    assert minutes * 60 <= limit_s


def test_grow_script_in_a_container(tmp_path: Path) -> None:
    args = ("--container-image=nvcr.io/x/y:1", "--container-mounts=/lustre:/lustre")
    job_dir, script = render_grow(tmp_path, resolved(tmp_path), srun_args=args)
    last = [line for line in script.splitlines() if line.startswith("exec ")]
    assert len(last) == 1
    assert last[0].startswith("exec srun ")
    assert '--nodelist="$SLURMD_NODENAME"' in last[0]
    for a in args:
        assert a in last[0]
    assert last[0].endswith(f"-m launcher.fleet.elastic.holder --job-dir {job_dir} --fleet-job 123 --grow g1")


def test_grow_script_without_exclude(tmp_path: Path) -> None:
    script = grow_script(resolved(tmp_path), tmp_path / "j", "g2", 1, 600, [], "9", ())
    assert "--exclude" not in script
    assert "#SBATCH --nodes=1" in script.splitlines()


@pytest.mark.shellcheck
def test_grow_script_is_shellcheck_clean(tmp_path: Path) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck, brew install shellcheck)")
    for srun_args in ((), ("--container-image=nvcr.io/x/y:1",)):
        _, script = render_grow(tmp_path, resolved(tmp_path), srun_args=srun_args)
        path = tmp_path / "grow.sbatch"
        path.write_text(script)
        proc = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("wanted_s", "limit"),
    [(3600, 3600), (3659.9, 3600), (3599, 3540), (120, 120), (61, 60), (59, 60), (1, 60)],
)
def test_grow_time_limit_from_the_wanted_time(wanted_s: float, limit: int) -> None:
    assert grow_time_limit_s(None, wanted_s, now=1000.0) == limit


def test_grow_time_limit_needs_a_time() -> None:
    with pytest.raises(SlurmRefused, match="end time is unknown"):
        grow_time_limit_s(None, None, now=1000.0)


def test_grow_time_limit_never_outlasts_the_fleet_job(monkeypatch: pytest.MonkeyPatch) -> None:
    ends: dict[str, float | None] = {"42": 1000.0 + 1859.0, "43": 1000.0 + 100.0, "44": None}
    monkeypatch.setattr(slurm_ops, "job_end_time", lambda job_id: ends[job_id])
    assert grow_time_limit_s("42", 3600, now=1000.0) == 1800  # the job's end, whole minutes
    assert grow_time_limit_s("42", 600, now=1000.0) == 600  # what was asked, when sooner
    assert grow_time_limit_s("42", None, now=1000.0) == 1800
    with pytest.raises(SlurmRefused, match="too soon"):
        grow_time_limit_s("43", 3600, now=1000.0)
    for wanted in (3600, None):  # end unknown: refused (the grow could outlive the job by `wanted`)
        with pytest.raises(SlurmRefused, match="gives no end time for the job"):
            grow_time_limit_s("44", wanted, now=1000.0)


# ===================================================================================================
# The grow holder (launcher.fleet.elastic.holder.why_end)
# ===================================================================================================


def job_state_is(monkeypatch: pytest.MonkeyPatch, state: str | None) -> list[str]:
    """``holder.job_state`` answers ``state`` (None: the test fails if it is asked); the ids asked."""
    asked: list[str] = []

    def fake(job_id: str) -> str:
        asked.append(job_id)
        if state is None:
            raise AssertionError("why_end asked Slurm although it already had its answer")
        return state

    monkeypatch.setattr(holder, "job_state", fake)
    return asked


def test_why_end_release_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job_state_is(monkeypatch, None)
    (tmp_path / "elastic").mkdir()
    holder.release_file(tmp_path, "g1").touch()
    assert holder.release_file(tmp_path, "g1") == tmp_path / "elastic" / "grow-g1.release"
    assert holder.why_end(tmp_path, "123", "g1") == "released by the fleet's driver"


def test_why_end_torn_down_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job_state_is(monkeypatch, None)
    (tmp_path / "result.json").write_text(json.dumps({"torn_down": True, "ok": False}))
    assert holder.why_end(tmp_path, "123", "g1") == "the fleet's job was torn down"


@pytest.mark.parametrize("state", ["RUNNING", "COMPLETING", "PENDING", "CONFIGURING", ""])
def test_why_end_none_while_the_fleet_job_lives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state: str
) -> None:
    asked = job_state_is(monkeypatch, state)
    (tmp_path / "elastic").mkdir()
    holder.release_file(tmp_path, "g2").touch()  # another grow's release is not this one's
    assert holder.why_end(tmp_path, "123", "g1") is None
    (tmp_path / "result.json").write_text(json.dumps({"torn_down": False}))
    assert holder.why_end(tmp_path, "123", "g1") is None
    (tmp_path / "result.json").write_text('{"torn_do')  # torn: no evidence
    assert holder.why_end(tmp_path, "123", "g1") is None
    assert asked == ["123", "123", "123"]


@pytest.mark.parametrize("state", ["COMPLETED", "CANCELLED by 1000", "TIMEOUT", "FAILED", "SUSPENDED"])
def test_why_end_when_the_fleet_job_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state: str
) -> None:
    job_state_is(monkeypatch, state)
    assert holder.why_end(tmp_path, "123", "g1") == f"the fleet's job 123 is {state}"
