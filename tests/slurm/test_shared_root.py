"""A shared job root (issue 28, security review 2026-12 finding 6): what another user plants there is never
acted on, and what rl-launch makes there is 0700.

The attack, as the review ran it: a team scratch job root (1777); another user makes ``fleets/``, a job
directory whose ``state.json`` names an unrelated process of the victim's (pid, start ticks, host, a
router URL, serving) and ``fleets/prod.json`` pointing at it with the victim's uid. The victim's
``rl-launch fleet down prod`` then SIGTERMed that process. Here the victim is the test's own user, the
planter ``tests/support/other_user.py``'s second Unix user (files planted by the test, then chowned to it:
pytest's tmp dirs sit under a 0700 parent the other user cannot enter), and every command runs as a user
runs it, the venv's ``rl-launch``.

Besides the planted files, each check that stands between a record and a signal is tested alone, with
the caller's own files: a state without start ticks, a pid whose command line is not the job's driver,
a process of another user. A lookalike driver (``python -m launcher.driver.run_local JOB`` resolved to a
sleeping module of the test's) shows the checks still let the real thing be signalled.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.fleet import standing
from launcher.jobdir import JobDir, JobResult, StateWriter, start_ticks
from tests.support.cli import RL_LAUNCH
from tests.support.other_user import OtherUser, other_user
from tests.support.specs import local_spec, sim, write_spec


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RL_LAUNCH, *args], capture_output=True, text=True, timeout=timeout)


def one_line_error(out: subprocess.CompletedProcess[str], alone: bool = True) -> str:
    """The command failed with one ``Error:`` line (click's): with ``alone``, nothing else on stderr
    (refused before it did anything); else after its progress lines."""
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("Error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], out.stderr
    assert len(lines) == 1 or not alone, out.stderr
    return errors[0]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture
def probe() -> OtherUser:
    return other_user()


@pytest.fixture
def victim() -> Iterator[subprocess.Popen[bytes]]:
    """An unrelated long-running process of the caller's: what the planted state names."""
    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    proc.kill()
    proc.wait(10)


@pytest.fixture
def lookalike(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """A process whose command line is a local fleet's driver's (``python -m launcher.driver.run_local
    JOB``), for the caller's own job directory ``JOB`` (not yet a job: the test writes its state). Its
    module is the test's own, which sleeps: run from its folder, ``-m`` finds it first."""
    fake = tmp_path / "lookalike"
    (fake / "launcher" / "driver").mkdir(parents=True)
    (fake / "launcher" / "__init__.py").write_text("")
    (fake / "launcher" / "driver" / "__init__.py").write_text("")
    (fake / "launcher" / "driver" / "run_local.py").write_text("import time\ntime.sleep(600)\n")
    job = JobDir(tmp_path / "jobs" / "own-fleet").create()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.driver.run_local", str(job.path)], cwd=fake, env=env
    )
    deadline = time.monotonic() + 10
    while b"run_local" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield job.path, proc
    proc.kill()
    proc.wait(10)


def serving_state(pid: int, ticks: int | None) -> dict[str, object]:
    """A state that says: a fleet serving, its driver ``pid`` on this host."""
    state: dict[str, object] = {
        "phase": "serving",
        "t": time.time(),
        "driver_pid": pid,
        "driver_host": socket.gethostname(),
        "router_url": "http://127.0.0.1:9",
        "fleet_serving_since": time.time(),
    }
    if ticks is not None:
        state["driver_start_ticks"] = ticks
    return state


def write_job(job: Path, state: dict[str, object]) -> None:
    job.mkdir(exist_ok=True)
    (job / "state.json").write_text(json.dumps(state))
    (job / "submitted.json").write_text(
        json.dumps(
            {"job_id": "", "name": job.name, "cluster": "local", "t": time.time(), "job_dir": str(job)}
        )
    )


def write_fleet_record(root: Path, job: Path, uid: int, name: str = "prod") -> Path:
    record = standing.FleetRecord(
        name, str(job), "local", f"local:{socket.gethostname()}", uid, "x", "sim-8b", None, time.time()
    )
    (root / "fleets").mkdir(exist_ok=True)
    path = root / "fleets" / f"{name}.json"
    path.write_text(json.dumps(record.to_json()))
    return path


def shared_root(tmp_path: Path) -> Path:
    root = tmp_path / "scratch"
    root.mkdir()
    root.chmod(0o1777)
    return root


# -- the review's attack, and each of its layers -------------------------------------------------------------
# whose is what: "review" is the review's run (the other user made fleets/, the record and the job
# directory); each other case plants only one thing, so each check is seen refusing on its own.
PLANTS = {
    "review": {"fleets", "record", "job"},
    "record file": {"record"},
    "record uid": {"uid"},
    "job directory": {"job"},
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_fleet_record_is_refused_and_the_named_process_lives(
    plant: str, tmp_path: Path, probe: OtherUser, victim: subprocess.Popen[bytes]
) -> None:
    root = shared_root(tmp_path)
    theirs = PLANTS[plant]
    job = root / "probe-job"
    write_job(job, serving_state(victim.pid, start_ticks(victim.pid)))
    record = write_fleet_record(root, job, probe.uid if "uid" in theirs else os.getuid())
    if "fleets" in theirs:
        (root / "fleets").chmod(0o777)
        probe.chown(root / "fleets")
    else:
        (root / "fleets").chmod(0o700)
    if "record" in theirs:
        probe.chown(record)
    if "job" in theirs:
        job.chmod(0o777)
        probe.chown(job, job / "state.json", job / "submitted.json")
    else:
        job.chmod(0o700)

    down = run("fleet", "down", "prod", "--root", str(root), "--timeout", "3")
    line = one_line_error(down)
    assert victim.poll() is None, f"the victim's process was signalled: {down.stderr}"
    assert not (job / "down.json").exists()  # nothing was written into the planted directory
    where = {"review": root / "fleets", "record file": record, "record uid": record, "job directory": job}
    assert str(where[plant]) in line and f"user {probe.name} (uid {probe.uid})" in line, line
    print(f"\n{plant}: {line}")

    grow = run("fleet", "grow", "prod", "--nodes", "1", "--root", str(root))
    assert str(where[plant]) in one_line_error(grow)
    assert not (job / "elastic").exists()
    with pytest.raises(standing.FleetRefused):  # in-process too: the record is never returned
        standing.read_record(root, "prod")
    if plant == "review":  # a fleets/ of another user's is refused whole
        with pytest.raises(standing.FleetRefused):
            standing.list_records(root)
    else:  # the record is left out of the listing
        assert standing.list_records(root) == []


def test_list_cancel_status_logs_skip_or_refuse_a_planted_job_directory(
    tmp_path: Path, probe: OtherUser, victim: subprocess.Popen[bytes]
) -> None:
    root = shared_root(tmp_path)
    mine = JobDir(root / "mine-local-1-1").create()
    StateWriter(mine).event("finished", "training finished")
    mine.write_result(JobResult(0, "training finished", "finished"))
    time.sleep(0.01)
    job = root / "probe-job"  # newer than mine: it would be "the newest job"
    write_job(job, {**serving_state(victim.pid, start_ticks(victim.pid)), "phase": "training"})
    job.chmod(0o777)
    probe.chown(job, job / "state.json", job / "submitted.json")

    listing = run("list", "--json", "--root", str(root))
    assert listing.returncode == 0, listing.stderr
    assert [r["job"] for r in json.loads(listing.stdout)] == ["mine-local-1-1"]
    assert f"{job} belongs to user {probe.name}" in listing.stderr, listing.stderr
    print(f"\nlist: {listing.stderr.strip()}")

    newest = run("status", "--json", "--root", str(root), "--interval", "0.1")
    assert newest.returncode == 0, newest.stderr
    assert json.loads(newest.stdout)["job"]["name"] == "mine-local-1-1"

    for argv in (
        ["cancel", "probe-job", "--no-wait"],
        ["cancel", str(job), "--no-wait"],
        ["status", "probe-job", "--json"],
        ["logs", "probe-job"],
        ["fleet", "pause", "probe-job"],
    ):
        line = one_line_error(run(*argv, "--root", str(root)))
        assert f"{job} belongs to user {probe.name} (uid {probe.uid}), not to you" in line, (argv, line)
    assert victim.poll() is None
    print(f"cancel: {line}")


# -- the checks between a state and a signal, on the caller's own files --------------------------------------
def own_fleet(root: Path, job: Path, state: dict[str, object]) -> None:
    root.mkdir(mode=0o700, exist_ok=True)
    write_job(job, state)
    write_fleet_record(root, job, os.getuid())


def test_a_driver_without_start_ticks_is_never_signalled(
    tmp_path: Path, lookalike: tuple[Path, subprocess.Popen[bytes]]
) -> None:
    job, proc = lookalike
    own_fleet(tmp_path / "jobs", job, serving_state(proc.pid, None))
    for argv in (["fleet", "down", "prod", "--timeout", "1"], ["cancel", job.name, "--no-wait"]):
        line = one_line_error(run(*argv, "--root", str(tmp_path / "jobs")), alone=False)
        assert f"(pid {proc.pid}) recorded no start time" in line, line
    assert proc.poll() is None
    print(f"\nno start ticks: {line}")


def test_a_pid_that_is_not_the_jobs_driver_is_never_signalled(
    tmp_path: Path, victim: subprocess.Popen[bytes]
) -> None:
    root = tmp_path / "jobs"
    job = root / f"own-local-20260101-000000-{victim.pid}"  # even the pid in the name cannot make it one
    own_fleet(root, job, serving_state(victim.pid, start_ticks(victim.pid)))
    for argv in (["fleet", "down", "prod", "--timeout", "1"], ["cancel", job.name, "--no-wait"]):
        line = one_line_error(run(*argv, "--root", str(root)), alone=False)
        assert f"pid {victim.pid} is not the driver of {job} (it runs `sleep 600`)" in line, line
    assert victim.poll() is None
    print(f"\nnot a driver: {line}")


def test_another_users_process_is_never_signalled(tmp_path: Path, probe: OtherUser) -> None:
    """Root could signal it: the uid is checked, not left to the kernel."""
    theirs = subprocess.Popen(["sleep", "600"], user=probe.uid, group=probe.gid, extra_groups=[], cwd="/")
    try:
        root = tmp_path / "jobs"
        own_fleet(root, root / "own-fleet", serving_state(theirs.pid, start_ticks(theirs.pid)))
        line = one_line_error(
            run("fleet", "down", "prod", "--timeout", "1", "--root", str(root)), alone=False
        )
        assert f"pid {theirs.pid}" in line and f"runs as user {probe.name}" in line, line
        assert theirs.poll() is None
    finally:
        theirs.kill()
        theirs.wait(10)


def test_the_fleets_own_driver_is_still_stopped(
    tmp_path: Path, lookalike: tuple[Path, subprocess.Popen[bytes]]
) -> None:
    """Start ticks, uid and command line all match: a driver that ignores the down file is SIGTERMed."""
    job, proc = lookalike
    own_fleet(tmp_path / "jobs", job, serving_state(proc.pid, start_ticks(proc.pid)))
    down = subprocess.Popen(
        [RL_LAUNCH, "fleet", "down", "prod", "--timeout", "1", "--root", str(tmp_path / "jobs")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.wait(30) == -signal.SIGTERM  # reaped here (its parent), so fleet down sees it gone
    _, err = down.communicate(timeout=60)
    assert down.returncode == 0, err
    assert "no teardown within 1 s; stopping its job" in err and "fleet 'prod' is down" in err
    assert not (tmp_path / "jobs" / "fleets" / "prod.json").exists()


# -- the job root and fleets/ --------------------------------------------------------------------------------
def test_job_root_fleets_and_job_dirs_are_0700_under_umask_002(tmp_path: Path) -> None:
    root = tmp_path / "home" / "rl-launch" / "jobs"
    old = os.umask(0o002)
    try:
        job = JobDir(root / "fleet-local-1-1").create()
        record = standing.new_record("prod", job.path, "local", "sim-8b", None)
        path = standing.write_record(root, record)
    finally:
        os.umask(old)
    modes = {p: mode(p) for p in (root.parent, root, root / "fleets", job.path)}
    assert set(modes.values()) == {0o700}, {str(p): oct(m) for p, m in modes.items()}
    assert mode(path) == 0o600
    assert standing.read_record(root, "prod") == record
    # one of the caller's own fleets/ made from the umask by an earlier rl-launch: made private on use
    (root / "fleets").chmod(0o775)
    assert [r.name for r in standing.list_records(root)] == ["prod"]
    assert mode(root / "fleets") == 0o700


def refused_spec(tmp_path: Path, root: Path) -> Path:
    return write_spec(
        tmp_path / "spec.yaml", local_spec("refused", root=root, command="true", generation=sim(1))
    )


def test_a_root_others_may_rename_things_in_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "group-jobs"
    root.mkdir()
    root.chmod(0o775)  # made from umask 002, no sticky bit: group members can rename your entries
    mine = JobDir(root / "mine-local-1-1").create()
    StateWriter(mine).event("finished", "done")
    for argv in (["list"], ["status", "--json"], ["fleet", "down", "prod"]):
        line = one_line_error(run(*argv, "--root", str(root)))
        assert f"job root {root} is writable by others without the sticky bit (mode 0775)" in line, line
        assert f"chmod 700 {root}" in line
    submit = run("submit", str(refused_spec(tmp_path, root)))
    assert "without the sticky bit" in one_line_error(submit)
    assert sorted(p.name for p in root.iterdir()) == ["mine-local-1-1"]  # nothing started
    print(f"\ngroup-writable root: {line}")
    root.chmod(0o1775)  # a team scratch: sticky, so others add names but cannot move yours
    listing = run("list", "--json", "--root", str(root))
    assert listing.returncode == 0 and [r["job"] for r in json.loads(listing.stdout)] == ["mine-local-1-1"]


def test_a_root_owned_by_another_user_is_refused(tmp_path: Path, probe: OtherUser) -> None:
    root = tmp_path / "their-jobs"
    root.mkdir(mode=0o755)
    probe.chown(root)
    line = one_line_error(run("list", "--root", str(root)))
    assert f"job root {root} belongs to user {probe.name} (uid {probe.uid})" in line, line
    assert "use a job root of your own" in line


# -- scancel ---------------------------------------------------------------------------------------------
@pytest.mark.slurm
def test_scancel_only_of_a_job_slurm_lists_as_yours(tmp_path: Path, probe: OtherUser) -> None:
    """The caller's own job directory and fleet record name another user's Slurm job (a record gone
    wrong, a copied directory): root, or a Slurm operator, could scancel it; neither ``cancel`` nor
    ``fleet down`` does. On the local Slurm cluster, the other user's job held in the queue."""
    from launcher.jobdir import SubmittedJob
    from launcher.slurm import queue
    from tests.support.slurm import _slurm_unreachable

    reason = _slurm_unreachable()
    if reason:
        pytest.skip(
            f"no Slurm cluster reachable: {reason} (slurm/cluster.sh start, then run on its login node)"
        )
    argv = ["sbatch", "--parsable", "--hold", "--output=/dev/null", "--chdir=/", "--wrap", "sleep 600"]
    submitted = probe.run(argv)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    try:
        root = tmp_path / "jobs"
        job = JobDir(root / f"own-{job_id}").create()
        job.write_submitted(
            SubmittedJob(job_id=job_id, name="own", cluster="slurm", t=time.time(), job_dir=str(job.path))
        )
        line = one_line_error(run("cancel", job.path.name, "--root", str(root), "--no-wait"))
        assert f"Slurm job {job_id} belongs to user {probe.name} (uid {probe.uid}), not to you" in line, line
        record = standing.FleetRecord(
            "prod", str(job.path), "slurm", standing.cluster_id("slurm"), os.getuid(), "x", "m", job_id, 0.0
        )
        standing.write_record(root, record)
        line = one_line_error(run("fleet", "down", "prod", "--root", str(root), "--timeout", "3"))
        assert f"Slurm job {job_id} belongs to user {probe.name}" in line, line
        entry = queue.squeue_entry(job_id)
        assert entry is not None and entry.state == "PENDING", entry
        print(f"\nscancel refused: {line}")
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
