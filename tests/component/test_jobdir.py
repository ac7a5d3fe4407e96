"""The job directory as a protocol: typed records, one writer per file, atomic writes, one order.

No Ray, no Slurm: these pin the shapes and the races that every process of a job relies on.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from launcher.cli.main import main
from launcher.jobdir import (
    ControlRequests,
    EngineEntry,
    EngineListing,
    JobDir,
    JobResult,
    StateWriter,
    SubmittedJob,
    write_json_atomic,
)


def listing(node_index: int, engines: int, tmp: Path) -> EngineListing:
    return EngineListing(
        node=f"gpu-{node_index}",
        node_index=node_index,
        engines=[
            EngineEntry(
                index=i,
                url=f"http://10.0.0.{node_index}:{9000 + i}",
                api_url=f"http://10.0.0.{node_index}:{9000 + i}/v1",
                node=f"gpu-{node_index}",
                node_index=node_index,
                log=str(tmp / f"engine-node{node_index}-{i}.log"),
            )
            for i in range(engines)
        ],
    )


def test_listings_are_in_numeric_node_order_from_eleven_nodes_on(tmp_path: Path) -> None:
    job = JobDir(tmp_path / "j").create()
    for n in (10, 2, 0, 11, 1):  # written out of order; as strings node-10 sorts before node-2
        job.write_listing(listing(n, 2, tmp_path))
    assert job.listing_indices() == [0, 1, 2, 10, 11]
    ids = [e.id for e in job.engine_entries()]
    assert ids[:4] == ["node0-0", "node0-1", "node1-0", "node1-1"]
    assert ids[6:] == ["node10-0", "node10-1", "node11-0", "node11-1"]


def test_logs_engine_takes_the_dashboard_id_and_the_fleet_position(tmp_path: Path) -> None:
    root = tmp_path / "jobs"
    job = JobDir(root / "demo-local-1-1").create()
    StateWriter(job).event("training", "running")
    for n in range(12):
        job.write_listing(listing(n, 1, tmp_path))
        (tmp_path / f"engine-node{n}-0.log").write_text(f"log of node {n}\n")
    runner = CliRunner()
    by_id = runner.invoke(main, ["logs", "demo-local-1-1", "--engine", "node10-0", "--root", str(root)])
    assert by_id.exit_code == 0, by_id.output
    assert by_id.output == "log of node 10\n"
    by_position = runner.invoke(main, ["logs", "--engine", "10", "--root", str(root)])  # newest job
    assert by_position.output == "log of node 10\n"
    bad = runner.invoke(main, ["logs", "--engine", "node99-0", "--root", str(root)])
    assert bad.exit_code != 0 and "--engine takes 0..11 or an id (node0-0" in bad.output


def test_state_writer_loses_no_update_between_two_threads(tmp_path: Path) -> None:
    """The driver's main thread (phases) and the fleet thread (fleet snapshot) both update state.json;
    read-modify-write through one temp name lost phases and raised FileNotFoundError."""
    job = JobDir(tmp_path / "j").create()
    state = StateWriter(job)
    errors: list[BaseException] = []

    def phases() -> None:
        try:
            for i in range(200):
                state.event("training", f"step {i}", step=i)
        except BaseException as exc:
            errors.append(exc)

    def fleet() -> None:
        try:
            for i in range(200):
                state.update(fleet={"tick": i})
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=phases), threading.Thread(target=fleet)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    final = job.read_state()
    assert final["step"] == 199 and final["fleet"] == {"tick": 199} and final["detail"] == "step 199"
    assert len(job.read_events()) == 200
    assert [p.name for p in job.path.iterdir() if p.name.endswith(".tmp")] == []


def test_atomic_writes_from_many_threads_leave_one_whole_file(tmp_path: Path) -> None:
    target = tmp_path / "x.json"
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            for _ in range(50):
                write_json_atomic(target, {"writer": i, "pad": "x" * 1000})
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert json.loads(target.read_text())["writer"] in range(4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


def test_records_round_trip_and_tolerate_missing_keys(tmp_path: Path) -> None:
    job = JobDir(tmp_path / "j").create()
    job.write_control(3, ControlRequests(restart={1: 2}))
    assert job.read_control(3).restart == {1: 2}
    assert job.read_control(4).restart == {}
    job.write_result(JobResult(143, "cancelled by SIGTERM", "cancelled", "SIGTERM", {"teardown_s": 1.5}))
    result = job.read_result()
    assert result is not None and (result.outcome, result.signal, result.exit_code) == (
        "cancelled",
        "SIGTERM",
        143,
    )
    job.result_file.write_text(json.dumps({"exit_code": 3, "reason": "old driver"}))
    old = job.read_result()
    assert old is not None and old.outcome == "failed"
    job.write_submitted(SubmittedJob("42", "demo", "slurm", 1.0))
    assert job.slurm_job_id() == "42"
    assert JobDir(tmp_path / "demo-local-20260101-1-5").slurm_job_id() is None


def test_status_endpoint_validates_events_n(tmp_path: Path) -> None:
    from launcher.driver.status_server import StatusServer

    job = JobDir(tmp_path / "j").create()
    job.new_api_key()
    key = {"Authorization": f"Bearer {job.read_api_key()}"}  # never served open
    state = StateWriter(job)
    for i in range(5):
        state.event("training", f"e{i}")
    server = StatusServer(job, "127.0.0.1", 0).start()
    try:
        with urllib.request.urlopen(
            urllib.request.Request(f"{server.url}/events?n=2", headers=key), timeout=5
        ) as resp:
            assert [e["detail"] for e in json.load(resp)["events"]] == ["e3", "e4"]
        for bad in ("abc", "0", "-1", "", "1.5"):
            with pytest.raises(urllib.error.HTTPError) as info:
                request = urllib.request.Request(f"{server.url}/events?n={bad}", headers=key)
                urllib.request.urlopen(request, timeout=5)
            assert info.value.code == 400
            body = json.loads(info.value.read())
            assert "n must be a positive integer" in body["error"]
    finally:
        server.stop()


def test_finished_job_dashboard_shows_no_healthy_engine_and_fits_80_columns(tmp_path: Path) -> None:
    """The driver was killed before its final snapshot: the last fleet state said HEALTHY."""
    from launcher.status import collect_snapshot, render_snapshot

    job = JobDir(tmp_path / "demo-local-1-1").create()
    job.write_listing(listing(0, 2, tmp_path))
    engines = [
        {
            "id": f"node0-{i}",
            "node": "gpu-0",
            "url": f"http://10.0.0.0:{9000 + i}",
            "state": "HEALTHY",
            "restarts": 0,
            "last_reason": "passing health checks for a long while now, and then some more words",
        }
        for i in range(2)
    ]
    StateWriter(job).update(phase="training", fleet={"engines": engines})
    job.write_result(JobResult(143, "cancelled by SIGTERM", "cancelled", "SIGTERM"))
    snap = collect_snapshot(job.path, window_s=0)
    assert [e["state"] for e in snap["engines"]] == ["STOPPED", "STOPPED"]
    assert [e["state_at_end"] for e in snap["engines"]] == ["HEALTHY", "HEALTHY"]
    assert "job cancelled: exit 143" in snap["message"]
    console = Console(width=80, record=True, force_terminal=False)
    console.print(render_snapshot(snap, width=80))
    lines = console.export_text().splitlines()
    table = [line for line in lines if line.lstrip().startswith(("id", "node0-"))]
    assert len(table) == 3 and all(len(line) <= 80 for line in lines)
    assert "state" in table[0] and "STOPPED" in table[1]
    assert "url" not in table[0].split()  # dropped first, before the figures


def test_list_json_and_status_default_to_the_newest_job(tmp_path: Path) -> None:
    root = tmp_path / "jobs"
    older = JobDir(root / "a-local-1-1").create()
    StateWriter(older).event("starting", "older")
    newer = JobDir(root / "b-local-2-2").create()
    StateWriter(newer).event("starting", "newer")
    StateWriter(older).update(detail="still running, updated after the newer job started")
    out = CliRunner().invoke(main, ["list", "--json", "--root", str(root)])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)
    assert [r["job"] for r in rows] == ["a-local-1-1", "b-local-2-2"]
    assert rows[1]["job_dir"] == str(newer.path) and rows[1]["slurm"] == "local"
    status = CliRunner().invoke(main, ["status", "--json", "--root", str(root)])
    assert json.loads(status.output)["job"]["name"] == "b-local-2-2"


# Every command that looks a job up takes --root, and finds JOB there (launcher.jobdir.lookup) or says
# where it looked. What each prints when it finds the finished job (no fleet serving any more):
LOOKUP_COMMANDS: dict[str, tuple[list[str], str]] = {
    "list": (["list", "--json"], '"job": "done-local-1-1"'),
    "logs": (["logs", "done-local-1-1"], "driver line"),
    "status": (["status", "done-local-1-1", "--json", "--interval", "0.1"], '"name": "done-local-1-1"'),
    "cancel": (["cancel", "done-local-1-1", "--no-wait"], "done-local-1-1 has already ended (finished"),
    **{
        f"fleet {op}": (["fleet", op, "done-local-1-1"], "job done-local-1-1 has no serving fleet")
        for op in ("reset-cache", "pause", "resume", "is-paused", "abort", "version", "checksum", "step")
    },
}


def finished_job(root: Path) -> JobDir:
    job = JobDir(root / "done-local-1-1").create()
    StateWriter(job).event("finished", "training finished")
    job.driver_log.write_text("driver line\n")
    job.write_result(JobResult(0, "training finished", "finished"))
    return job


def test_default_root_is_the_specs_default_job_root() -> None:
    from launcher.jobdir.lookup import DEFAULT_ROOT
    from launcher.spec import DEFAULT_JOB_ROOT

    assert DEFAULT_ROOT == DEFAULT_JOB_ROOT


@pytest.mark.parametrize("name", list(LOOKUP_COMMANDS))
def test_every_lookup_command_finds_the_job_under_root_and_by_default_under_home(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv, found = LOOKUP_COMMANDS[name]
    help_text = CliRunner().invoke(main, [*argv[: 2 if argv[0] == "fleet" else 1], "--help"]).output
    assert "--root DIRECTORY" in help_text and "[default: ~/rl-launch/jobs]" in help_text
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    finished_job(home / "rl-launch" / "jobs")  # the default root, read when the command runs
    by_default = CliRunner().invoke(main, argv)
    assert found in by_default.output, by_default.output

    root = tmp_path / "elsewhere"
    finished_job(root)
    given = CliRunner().invoke(main, [*argv, "--root", str(root)])
    assert found in given.output, given.output
    assert str(home) not in given.output

    empty = tmp_path / "empty"
    empty.mkdir()
    missing = CliRunner().invoke(main, [*argv, "--root", str(empty)])
    if name == "list":
        assert missing.exit_code == 0 and json.loads(missing.output) == []
    else:
        assert missing.exit_code == 1
        where = f"no job 'done-local-1-1' under {empty} (rl-launch list shows the jobs there)"
        assert missing.output == f"Error: {where}\n"


def test_logs_follow_ends_with_the_job_and_training_log(tmp_path: Path) -> None:
    root = tmp_path / "jobs"
    job = JobDir(root / "demo-local-1-1").create()
    StateWriter(job).event("training", "running")
    job.driver_log.write_text("driver line\n")
    job.training_log.write_text("step 1 loss 0.5\n")

    def finish() -> None:
        with job.training_log.open("a") as f:
            f.write("step 2 loss 0.4\n")
        job.write_result(JobResult(0, "training finished", "finished"))

    timer = threading.Timer(1.0, finish)
    timer.start()
    out = CliRunner().invoke(main, ["logs", "--training", "-f", "--root", str(root)])
    timer.join()
    assert out.exit_code == 0, out.output
    assert out.output == "step 1 loss 0.5\nstep 2 loss 0.4\n"
    driver = CliRunner().invoke(main, ["logs", "demo-local-1-1", "--root", str(root)])
    assert driver.output == "driver line\n"


def test_list_says_lost_when_a_local_driver_died_without_a_result(tmp_path: Path) -> None:
    import socket

    root = tmp_path / "jobs"
    job = JobDir(root / "killed-local-1-1").create()
    StateWriter(job).event(
        "training", "running", driver_pid=2**22 + 7, driver_start_ticks=1, driver_host=socket.gethostname()
    )
    out = CliRunner().invoke(main, ["list", "--json", "--root", str(root)])
    (row,) = json.loads(out.output)
    assert row["phase"] == "lost" and "last phase training" in row["detail"]
    from launcher.status import collect_snapshot

    snap = collect_snapshot(job.path, window_s=0)
    assert snap["condition"] == "finished" and snap["message"].startswith("the driver is gone")


def test_job_directory_is_private_whatever_the_umask(tmp_path: Path) -> None:
    """Folders were made from the umask and files forced to 0644: with a group-writable umask, members of
    the user's group could replace ``state.json`` or a listing (which the CLI and driver trust)."""
    import os
    import stat

    from launcher.jobdir import EngineListing, StateWriter

    old = os.umask(0o002)
    try:
        job = JobDir(tmp_path / "job").create()
        StateWriter(job).event("starting", "x")
        job.write_listing(EngineListing(node="n", node_index=0, engines=[]))
        job.log_event("hello")
        job.new_api_key()
    finally:
        os.umask(old)
    for d in (job.path, job.logs, job.engines, job.api_key_file.parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for f in (job.state_file, job.events_file, job.listing_file(0), job.api_key_file):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_gym_overlay_replaces_a_planted_symlink_and_a_loose_mode(tmp_path: Path) -> None:
    """The overlay (it holds the client key) was opened in place: an existing 0644 file kept its mode and
    a symlink planted at its path was followed, writing the key wherever it pointed."""
    import os
    import stat

    from launcher.driver.gym_wiring import write_gym_overlay

    loose = tmp_path / "loose.yaml"
    loose.write_text("old\n")
    loose.chmod(0o644)
    write_gym_overlay(loose, {"policy_api_key": "k"})
    assert stat.S_IMODE(loose.stat().st_mode) == 0o600 and "policy_api_key: k" in loose.read_text()

    target = tmp_path / "elsewhere.txt"
    target.write_text("not yours\n")
    planted = tmp_path / "overlay.yaml"
    os.symlink(target, planted)
    write_gym_overlay(planted, {"policy_api_key": "k"})
    assert target.read_text() == "not yours\n"
    assert not planted.is_symlink() and stat.S_IMODE(planted.stat().st_mode) == 0o600
