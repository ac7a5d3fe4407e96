"""Bounds of the elastic fleet (issue 28, review findings 11 and 13): the grow holder ends when Slurm no
longer knows the fleet's job or the job's state stops changing; a grow whose job's end Slurm does not give
is refused; request ids name no file outside their directory; a local grow is bounded."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from launcher.driver.engine_hosts import EngineHostLauncher
from launcher.fleet.elastic import holder, shapes, slurm_ops
from launcher.fleet.elastic.manager import MAX_LOCAL_NODES, ElasticFleet
from launcher.fleet.elastic.shapes import ElasticAnswer, ElasticRequest
from launcher.fleet.elastic.slurm_ops import SlurmRefused, grow_time_limit_s
from launcher.gateways.kinds import front_kind
from launcher.jobdir import JobDir, StateWriter, write_json_atomic
from launcher.spec import parse_spec
from launcher.steps.processes import LocalSteps


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def slurm_says(monkeypatch: pytest.MonkeyPatch, states: list[str]) -> None:
    """``holder.job_state`` answers these, one per poll (the test fails if asked more often)."""
    answers = iter(states)
    monkeypatch.setattr(holder, "job_state", lambda job_id: next(answers))


def job_with_state(tmp_path: Path) -> Path:
    job = tmp_path / "job"
    job.mkdir()
    write_json_atomic(job / "state.json", {"phase": "training"})
    return job


# -- the holder -----------------------------------------------------------------------------------------


def test_the_grow_ends_after_polls_in_which_slurm_does_not_know_the_fleet_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = job_with_state(tmp_path)
    # unknown twice, known (a controller hiccup ends the count), then unknown three times in a row
    slurm_says(monkeypatch, ["", "", "RUNNING", "", "", ""])
    watch = holder.FleetJobWatch(job, "123", unknown_polls=3, stale_s=1e9)
    seen = []
    for _ in range(6):
        write_json_atomic(job / "state.json", {"phase": "training"})  # the driver's tick: fresh
        seen.append(holder.why_end(job, "123", "g1", watch))
    assert seen[:5] == [None] * 5
    assert seen[5] == (
        "Slurm has not known the fleet's job 123 for 3 polls in a row (neither squeue nor sacct lists it)"
    )


def test_the_grow_ends_when_the_state_stops_changing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = job_with_state(tmp_path)
    slurm_says(monkeypatch, ["RUNNING"] * 5)
    clock = Clock()
    watch = holder.FleetJobWatch(job, "123", stale_s=300, clock=clock)
    clock.t += 299
    assert holder.why_end(job, "123", "g1", watch) is None
    write_json_atomic(job / "state.json", {"phase": "training", "tick": 2})  # a tick: the count restarts
    clock.t += 200
    assert holder.why_end(job, "123", "g1", watch) is None
    clock.t += 200
    assert holder.why_end(job, "123", "g1", watch) is None  # 200 s since it changed
    clock.t += 100
    why = holder.why_end(job, "123", "g1", watch)
    assert why == (
        "the fleet's state.json has not been written for 300 s (its driver writes it every second): "
        "the driver is gone"
    )
    (job / "state.json").unlink()  # gone altogether is a change, then as stale as a file that stays
    assert holder.why_end(job, "123", "g1", watch) is None


def test_the_driver_writes_the_state_every_tick(tmp_path: Path) -> None:
    """The holder's staleness rests on this: the fleet controller's tick (every second) ends by writing
    the fleet's snapshot with ``StateWriter.update``, and each update is a whole new file (new inode)."""
    job = JobDir(tmp_path / "job").create()
    state = StateWriter(job)
    state.event("training", "running")
    before = job.state_file.stat()
    state.update(fleet={"engines": []})
    after = job.state_file.stat()
    assert (after.st_ino, after.st_mtime_ns) != (before.st_ino, before.st_mtime_ns)
    assert after.st_ino != before.st_ino


def test_the_holder_process_ends_its_grow_when_slurm_forgets_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    job = job_with_state(tmp_path)
    monkeypatch.setattr(holder, "POLL_S", 0.01)
    monkeypatch.setattr(holder, "UNKNOWN_POLLS", 5)
    polls: list[str] = []
    monkeypatch.setattr(holder, "job_state", lambda job_id: polls.append(job_id) or "")
    assert holder.main(["--job-dir", str(job), "--fleet-job", "77", "--grow", "g3"]) == 0
    assert polls == ["77"] * 5
    out = capsys.readouterr().out
    assert "ending grow g3: Slurm has not known the fleet's job 77 for 5 polls in a row" in out


def test_a_grow_is_refused_when_slurm_gives_no_end_for_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    monkeypatch.setattr(slurm_ops, "job_end_time", lambda job_id: asked.append(job_id))
    for wanted in (600, None):
        with pytest.raises(SlurmRefused) as err:
            grow_time_limit_s("4242", wanted, now=1000.0)
        assert str(err.value) == (
            "Slurm gives no end time for the job (4242: squeue does not list it or did not answer), and a "
            "grow must end with the job: try again once squeue lists it"
        )
    assert asked == ["4242", "4242"]


# -- request ids --------------------------------------------------------------------------------------------


def test_a_request_id_that_reaches_out_is_refused_and_answered_in_place(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    shapes.make_dirs(job)
    reqs = shapes.requests_dir(job)
    # the review's request: its answer was written to elastic/traversal-demo.json
    (reqs / "0000000000001-aaaaaa.json").write_text(json.dumps({"op": "cancel", "id": "../traversal-demo"}))
    (reqs / "0000000000002-bbbbbb.json").write_text(json.dumps({"op": "cancel", "id": "0000000000009-other"}))
    (reqs / "Evil Name.json").write_text(json.dumps({"op": "cancel", "id": "Evil Name"}))
    taken = shapes.take_requests(job)
    cli_made = "1-64 of [0-9a-z-] (the CLI makes them)"
    assert taken == [
        (
            "0000000000001-aaaaaa",
            "unreadable request 0000000000001-aaaaaa.json: "
            f"request id '../traversal-demo' is not one: {cli_made}",
        ),
        (
            "0000000000002-bbbbbb",
            "unreadable request 0000000000002-bbbbbb.json: "
            "its id '0000000000009-other' is not its file's name",
        ),
        ("", f"unreadable request 'Evil Name.json': request id 'Evil Name' is not one: {cli_made}"),
    ]
    for bad in ("../traversal-demo", "x/y", "", "A", "a" * 65, "é"):
        with pytest.raises(ValueError, match="is not one: 1-64 of"):
            shapes.answer(job, ElasticAnswer(bad, False, "no"))
        with pytest.raises(ValueError, match="is not one"):
            shapes.send(job, ElasticRequest("cancel", id=bad))
        with pytest.raises(ValueError, match="is not one"):
            shapes.wait_answer(job, bad, timeout_s=0)
    assert sorted(p.name for p in shapes.elastic_dir(job).iterdir()) == ["answers", "requests"]
    assert list(shapes.answers_dir(job).iterdir()) == []
    assert shapes.check_id(ElasticRequest("grow").id)  # the CLI's own ids pass


# -- a local grow ---------------------------------------------------------------------------------------


def local_fleet(tmp_path: Path) -> tuple[ElasticFleet, list[str]]:
    """The driver's elastic fleet of a local job with one generation node (nothing started)."""
    spec = parse_spec(
        {
            "name": "bound",
            "cluster": "local",
            "job_root": str(tmp_path / "jobs"),
            "training": {"command": "true"},
            "generation": {"engine": "sim", "engines_per_node": 2, "served_model_name": "sim-8b"},
        }
    ).resolved()
    job = JobDir(tmp_path / "jobs" / "bound-1").create()
    state = StateWriter(job)
    said: list[str] = []
    front: Any = front_kind(spec.router.kind)
    engines = EngineHostLauncher(spec, job, state, LocalSteps(), ["localhost"], front, True, said.append)
    fleet = ElasticFleet(
        spec,
        job,
        state,
        None,  # type: ignore[arg-type]  # a refused grow reaches no engine: no controller needed
        engines,
        None,
        local=True,
        training_nodes=["localhost"],
        held_since=0.0,
        say=said.append,
    )
    return fleet, said


def test_a_local_grow_past_the_bound_is_refused_and_starts_nothing(tmp_path: Path) -> None:
    fleet, _ = local_fleet(tmp_path)
    for nodes in (MAX_LOCAL_NODES, 10_000):
        reply = fleet.handle(ElasticRequest("grow", nodes=nodes, id=f"0000000000001-{nodes}"))
        assert reply.ok is False
        assert reply.message == (
            f"--nodes {nodes}: a local job runs every node's engines on this machine, at most "
            f"{MAX_LOCAL_NODES} generation node(s) in all, and it holds 1; "
            f"ask for at most {MAX_LOCAL_NODES - 1}"
        )
    assert fleet.grows == {} and fleet.engines.hosts.all() == []
    assert not any(f.name.startswith("engine-host-") for f in fleet.job.path.rglob("*"))


def test_an_unnamed_request_is_said_in_the_drivers_log(tmp_path: Path) -> None:
    fleet, said = local_fleet(tmp_path)
    (shapes.requests_dir(fleet.job.path) / "Odd.json").write_text("{}")
    fleet.tick()
    assert said == [
        "elastic: ignored unreadable request 'Odd.json': request id 'Odd' is not one: 1-64 of [0-9a-z-] "
        "(the CLI makes them)"
    ]
    assert list(shapes.answers_dir(fleet.job.path).iterdir()) == []
    assert os.listdir(shapes.requests_dir(fleet.job.path)) == []
