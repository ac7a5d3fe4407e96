"""The fleet controller's own timers and host watch, without Ray: the parts ``FleetHealth`` leaves to it.

``FleetHealth`` has no timer for RESTARTING and cannot see processes; the controller must give every
restart a deadline and condemn a dead engine host's engines at once, or a job waits forever.
"""

from __future__ import annotations

from pathlib import Path

from launcher.fleet import EngineState, HealthPolicy, TickInput
from launcher.fleet.controller import FleetController
from launcher.jobdir import EngineEntry, EngineListing, JobDir, StateWriter


class FakeHosts:
    def __init__(self) -> None:
        self.codes: dict[int, int | None] = {0: None, 1: None}
        self.restarted: list[int] = []

    def exited(self, node_index: int) -> int | None:
        return self.codes[node_index]

    def restart(self, node_index: int) -> None:
        self.restarted.append(node_index)
        self.codes[node_index] = None

    def describe(self, node_index: int) -> str:
        return f"node gpu-{node_index}; log tail"


def make(tmp_path: Path, **kwargs: object) -> tuple[FleetController, JobDir, FakeHosts]:
    job = JobDir(tmp_path / "j").create()
    for n in range(2):
        job.write_listing(
            EngineListing(
                node=f"gpu-{n}",
                node_index=n,
                engines=[
                    EngineEntry(index=i, url=f"http://10.0.0.{n}:{9000 + i}", node=f"gpu-{n}", node_index=n)
                    for i in range(2)
                ],
            )
        )
    hosts = FakeHosts()
    said: list[str] = []
    controller = FleetController(
        job,
        StateWriter(job),
        None,
        2,
        HealthPolicy(),
        hosts=hosts,
        say=said.append,
        **kwargs,  # type: ignore[arg-type]
    )
    return controller, job, hosts


def test_dead_host_condemns_its_engines_at_once_and_is_started_again(tmp_path: Path) -> None:
    controller, job, hosts = make(tmp_path)
    hosts.codes[1] = 137
    controller._check_hosts()
    assert [controller.fleet.state(f"node1-{i}") for i in range(2)] == [EngineState.DEAD] * 2
    assert [controller.fleet.state(f"node0-{i}") for i in range(2)] == [EngineState.HEALTHY] * 2
    died = [e for e in job.read_events() if e["phase"] == "engine_host_died"]
    assert died and died[0]["node_index"] == 1 and died[0]["exit_code"] == 137
    assert died[0]["engines"] == ["node1-0", "node1-1"]
    result = controller.fleet.observe(TickInput(probes={}, outcomes={}))
    assert sorted(result.to_restart) == ["node1-0", "node1-1"]
    for eid in result.to_restart:
        controller._request_restart(eid)
    controller._restart_hosts(result.to_restart)
    assert hosts.restarted == [1]
    assert job.read_control(1).restart == {0: 1, 1: 1}  # the new host adopts these generations
    controller._check_hosts()  # alive again: nothing new
    assert len([e for e in job.read_events() if e["phase"] == "engine_host_died"]) == 1


def test_restart_that_never_answers_times_out(tmp_path: Path) -> None:
    controller, _, _ = make(tmp_path, restart_timeout_s=0.0)
    controller.fleet.mark_dead("node0-0", "probe failed")
    result = controller.fleet.observe(TickInput(probes={}, outcomes={}))
    assert result.to_restart == ["node0-0"]
    controller._request_restart("node0-0")
    assert controller.fleet.state("node0-0") is EngineState.RESTARTING
    controller._expire_restarts()
    assert controller.fleet.state("node0-0") is EngineState.DEAD
    assert "no replacement within 0 s" in controller.fleet.engine("node0-0").last_reason


def test_stopped_controller_neither_watches_nor_restarts_hosts(tmp_path: Path) -> None:
    controller, job, hosts = make(tmp_path)
    controller.stop()
    hosts.codes[0] = 0  # the teardown stopped it
    controller._check_hosts()
    controller._restart_hosts(["node0-0"])
    assert hosts.restarted == [] and not [e for e in job.read_events() if e["phase"] == "engine_host_died"]
    fleet = job.read_state()["fleet"]
    assert fleet["final"] is True and {e["state"] for e in fleet["engines"]} == {"STOPPED"}
