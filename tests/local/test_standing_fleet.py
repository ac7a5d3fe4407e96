"""Standing fleets in local mode, as a user runs them (``rl-launch fleet up``, ``rl-launch submit`` of a job
whose spec says ``generation: {fleet: NAME}``, ``rl-launch cancel``, ``rl-launch fleet down``):

* a trainer attaches and replays, holds a refit's pause and is killed mid-step; the fleet resumes within
  the lease, the trainer's key is revoked, a resubmitted trainer attaches, refits at once and finishes,
  and the fleet's engines are the same processes on the same ports throughout;
* two consumers saturating the fleet at once each get at least 40% of the completions; a plain
  consumer's key cannot pause;
* bad input is refused before anything is started: another model, another user's fleet, another
  cluster, a fleet that is gone; ``fleet down`` with attached jobs names them and needs ``--force``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from launcher.jobdir import JobDir
from tests.support.cli import RL_LAUNCH
from tests.support.running_job import job_leftovers, job_processes, wait_for
from tests.support.specs import local_spec, sim, trainer_command, write_spec
from tests.support.standing_fleet import TRAINER, fleet_resumed, key_revoked

pytestmark = pytest.mark.ray


def fleet_spec(tmp_path: Path, name: str = "shared", root: Path | None = None, **fleet: Any) -> Path:
    return write_spec(
        tmp_path / f"fleet-{name}.yaml",
        local_spec(
            name,
            root=root if root is not None else tmp_path / "jobs",
            fleet={"consumers": {"trainer": {"admin": True}}, **fleet},
            generation=sim(2, speed=4),
            router={"backend_timeout_s": 30},
        ),
    )


def trainer_spec(
    tmp_path: Path,
    mode: str,
    name: str = "trainer",
    fleet: str = "shared",
    root: Path | None = None,
    **gen: Any,
) -> Path:
    """An attached job's spec (its jobs under ``root``, default ``tmp_path/jobs``)."""
    return write_spec(
        tmp_path / f"{name}-{mode.split()[0]}.yaml",
        local_spec(
            name,
            root=root if root is not None else tmp_path / "jobs",
            command=trainer_command(tmp_path, TRAINER, mode),
            generation={"fleet": fleet, **gen},
        ),
    )


def run(*args: str, timeout: float = 300, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RL_LAUNCH, *args], capture_output=True, text=True, timeout=timeout, **kw)


def job_of(tmp_path: Path, name: str, root: Path | None = None) -> list[Path]:
    root = root if root is not None else tmp_path / "jobs"
    return sorted(
        (p for p in root.iterdir() if p.name.startswith(f"{name}-")), key=lambda p: p.stat().st_mtime
    )


def engine_processes(fleet_job: Path) -> tuple[set[str], set[str]]:
    """(engine URLs, pids of the fleet's simulator processes): the same sets mean no engine was
    restarted (a restart is a new process on a new port)."""
    urls = {e.url for e in JobDir(fleet_job).engine_entries()}
    pids = {p.split(":")[0] for p in job_processes(fleet_job) if "launcher.engines.sim" in p}
    return urls, pids


@dataclass
class Standing:
    """The module's standing fleet: its job dir and the job root its attached jobs go under."""

    job: Path
    root: Path


@pytest.fixture(scope="module")
def standing_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standing]:
    """One local standing fleet of 2 simulated engines, brought up by the CLI, shared by the checks that
    leave it serving (attach, kill a trainer, refit, refusals). At the module's end it is brought down as a
    user does, and that is checked: ``fleet down`` succeeds (nothing is attached: every check detaches),
    the fleet finishes, nothing of it is left, its record is gone, and an attach to it is refused."""
    base = tmp_path_factory.mktemp("standing")
    root = base / "jobs"
    proc = run("fleet", "up", str(fleet_spec(base)), "--json", timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    job = Path(json.loads(proc.stdout)["job_dir"])
    try:
        yield Standing(job=job, root=root)
    finally:
        down = run("fleet", "down", "shared", "--root", str(root), timeout=180)
        before = set(root.iterdir())
        gone = run("submit", str(trainer_spec(base, "refit", root=root)), timeout=120)
        after = set(root.iterdir())
        if down.returncode != 0:  # something stayed attached: bring it down anyway, then fail
            run("fleet", "down", "shared", "--force", "--root", str(root), timeout=180)
        wait_for(lambda: job_processes(job) == [], 60, "the fleet's processes to end")
    assert down.returncode == 0, down.stderr
    assert JobDir(job).read_result().outcome == "finished"
    assert not (root / "fleets" / "shared.json").exists()
    # a fleet that is gone
    assert gone.returncode != 0, gone.stdout
    assert after == before  # no job directory: nothing was started
    last = gone.stderr.strip().splitlines()[-1]
    assert "no standing fleet of that name" in last or "is gone" in last, last


@pytest.fixture
def fleet_up(standing_fleet: Standing) -> Standing:
    """The shared fleet, serving again (both engines listed, nothing paused) whatever ran before."""
    fleet_url = JobDir(standing_fleet.job).read_state()["fleet_url"]
    admin = {"Authorization": "Bearer " + JobDir(standing_fleet.job).read_admin_token()}

    def serving() -> bool:
        req = urllib.request.Request(fleet_url + "/fleet/is_paused", headers=admin)
        body = json.loads(urllib.request.urlopen(req, timeout=5).read())["result"]
        engines = len(JobDir(standing_fleet.job).engine_entries()) == 2
        return engines and not body["router_paused"] and not any(body["engines_paused"].values())

    wait_for(serving, 60, "the standing fleet to serve, unpaused")
    return standing_fleet


def test_trainer_killed_mid_step_fleet_survives_and_resubmitted_trainer_refits_at_once(
    tmp_path: Path, fleet_up: Standing
) -> None:
    fleet_job, root = fleet_up.job, fleet_up.root
    engines_before = engine_processes(fleet_job)
    assert len(engines_before[0]) == 2 and engines_before[1]
    state = JobDir(fleet_job).read_state()
    assert state["fleet_record"]["name"] == "shared" and state["router_url"]

    # the first trainer: attaches, replays, holds a refit's pause, and is killed there
    first = subprocess.Popen(
        [RL_LAUNCH, "submit", str(trainer_spec(tmp_path, "hold", root=root))],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own group, killed below as a whole (never the test's)
    )
    try:

        def holding() -> bool:
            if first.poll() is not None:
                out = first.stdout.read() if first.stdout else ""
                raise AssertionError(f"trainer A ended before holding the pause: {out[-3000:]}")
            return any((j / "holding.json").exists() for j in job_of(tmp_path, "trainer", root))

        wait_for(holding, 180, "trainer A to hold the refit's pause")
        (trainer_a,) = job_of(tmp_path, "trainer", root)
        key_a = JobDir(trainer_a).read_api_key()
        # while it is attached, fleet down is refused and names it
        down = run("fleet", "down", "shared", "--root", str(root))
        assert down.returncode != 0 and trainer_a.name in down.stderr, down.stderr
        # status shows who is attached, with its figures
        status = run("status", str(fleet_job), "--json", timeout=60)
        assert status.returncode == 0, status.stderr
        consumers = json.loads(status.stdout)["standing"]["consumers"]["consumers"]
        assert consumers[trainer_a.name]["admin"] is True and consumers[trainer_a.name]["requests"] > 0
        # the trainer dies at once (no teardown of its own): SIGKILL to its driver and training command
        state_a = JobDir(trainer_a).read_state()
        assert os.getpgid(int(state_a["driver_pid"])) != os.getpgid(0)
        os.killpg(os.getpgid(int(state_a["driver_pid"])), signal.SIGKILL)
        for pid in _training_pids(trainer_a):
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
    finally:
        first.kill()
        first.wait(30)
    # the lease (4 s) runs out: the router resumes on its own
    fleet_url = JobDir(fleet_job).read_state()["fleet_url"]
    admin = {"Authorization": "Bearer " + JobDir(fleet_job).read_admin_token()}
    wait_for(fleet_resumed(fleet_url, admin), 30, "the fleet to resume after the lease")
    resumed_after = time.monotonic() - killed
    # its key is revoked once the fleet sees its job ended (its driver is gone)
    router = JobDir(fleet_job).read_state()["router_url"]
    wait_for(key_revoked(router, key_a), 30, "the killed trainer's key to be revoked")
    # nothing of the killed trainer's job is left (its local Ray head was in a session of its own; the
    # head's reaper ends it): only that job's processes, by its job dir, since other lanes run jobs too
    wait_for(lambda: job_leftovers(trainer_a) == [], 60, "the killed trainer's processes to end")

    # the resubmitted trainer: attaches, refits at once, replays, finishes
    t_submit = time.time()
    second = run("submit", str(trainer_spec(tmp_path, "refit", root=root)), timeout=300)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    trainer_b = job_of(tmp_path, "trainer", root)[-1]
    first_rollout = json.loads((trainer_b / "first.json").read_text())
    refit = json.loads((trainer_b / "refit.json").read_text())
    replay = json.loads((trainer_b / "replay.json").read_text())["rows"][0]
    assert replay["errors"] == 0 and replay["sessions_ok"] == replay["sessions"], replay
    assert first_rollout["status"] == 200
    assert len(refit["before"]["engines"]) == 2  # the fleet's versions, there for the new trainer to see
    events = JobDir(trainer_b).read_events()
    started = events[0]["t"]
    took = first_rollout["t"] - started
    fleet_events = JobDir(fleet_job).read_events()
    own_start = next(e["t"] for e in fleet_events if e["phase"] == "fleet_serving") - fleet_events[0]["t"]
    print(
        f"\nstanding fleet: its own start (Ray, 2 engines, router) {own_start:.1f} s; lease resumed the "
        f"fleet {resumed_after:.1f} s after the trainer was killed; "
        f"resubmitted trainer's first rollout {took:.1f} s after its driver started "
        f"({first_rollout['t'] - t_submit:.1f} s after `rl-launch submit`)"
    )
    assert took < 30
    assert engine_processes(fleet_job) == engines_before  # never restarted: same processes, same ports
    versions = json.loads(
        urllib.request.urlopen(
            urllib.request.Request(fleet_url + "/fleet/weight_version", headers=admin), timeout=5
        ).read()
    )["result"]
    assert versions["current"] == "v2"
    consumer_b = (JobDir(trainer_b).read_state().get("attached_to") or {}).get("consumer")
    attached = json.loads((fleet_job / "consumers.json").read_text())["consumers"]
    assert consumer_b and consumer_b not in attached  # detached at its end
    # fleet down (nothing of it left, its record gone) is checked once, when the module's fleet ends


def _training_pids(job: Path) -> list[int]:
    marker = f"RL_JOB_DIR={job}".encode()
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                pids.append(int(pid))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return pids


def test_two_consumers_share_the_fleet_fairly_and_a_plain_key_cannot_pause(tmp_path: Path) -> None:
    """Capacity 4 in flight over 2 engines; consumer ``heavy`` runs 16 requests at once, ``light`` 4, for
    the same 12 s: each gets at least 40% of the completions while both run."""
    proc = run("fleet", "up", str(fleet_spec(tmp_path, capacity=4)), "--json", timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fleet_job = Path(json.loads(proc.stdout)["job_dir"])
    try:
        jobs = [
            subprocess.Popen([RL_LAUNCH, "submit", str(trainer_spec(tmp_path, f"load 12 {n}", name=name))])
            for name, n in (("heavy", 16), ("light", 4))
        ]
        for p in jobs:
            assert p.wait(240) == 0
        done = {
            name: json.loads((job_of(tmp_path, name)[-1] / "completions.json").read_text())
            for name in ("heavy", "light")
        }
        start = max(min(t) for t in done.values())
        end = min(max(t) for t in done.values())
        window = {name: sum(start <= t <= end for t in ts) for name, ts in done.items()}
        total = sum(window.values())
        shares = {name: n / total for name, n in window.items()}
        print(f"\nfair share over {end - start:.1f} s contended: {window} -> {shares}")
        assert total >= 20 and min(shares.values()) >= 0.40, (window, shares)
        # a plain consumer (not in fleet.consumers as admin) may not pause the fleet
        pause = run("submit", str(trainer_spec(tmp_path, "pause", name="eval")), timeout=240)
        assert pause.returncode == 0, pause.stderr[-2000:]
        answer = json.loads((job_of(tmp_path, "eval")[-1] / "pause.json").read_text())
        assert answer["status"] == 403, answer
        # every consumer's key was revoked when its job ended
        wait_for(
            lambda: not json.loads((fleet_job / "consumers.json").read_text())["consumers"], 10, "revoke"
        )
    finally:
        down = run("fleet", "down", "shared", "--root", str(tmp_path / "jobs"), timeout=180)
        assert down.returncode == 0, down.stderr
    wait_for(lambda: job_processes(fleet_job) == [], 30, "the fleet's processes to end")


def test_bad_attachments_are_refused_before_anything_starts(tmp_path: Path, fleet_up: Standing) -> None:
    root = fleet_up.root

    def refused(spec: Path, *args: str) -> str:
        before = set(root.iterdir())
        proc = run("submit", str(spec), *args, timeout=120)
        assert proc.returncode != 0, proc.stdout
        assert set(root.iterdir()) == before  # no job directory: nothing was started
        return proc.stderr.strip().splitlines()[-1]

    other_model = refused(trainer_spec(tmp_path, "refit", root=root, served_model_name="qwen-72b"))
    assert "serves model 'sim-8b'" in other_model and "qwen-72b" in other_model, other_model
    assert "no standing fleet of that name" in refused(
        trainer_spec(tmp_path, "refit", fleet="nope", root=root)
    )
    # --fleet on a spec of its own: its generation gives way, but its model must match
    own = write_spec(
        tmp_path / "own.yaml",
        local_spec("own", root=root, command="true", generation=sim(served_model_name="other")),
    )
    assert "serves model 'sim-8b'" in refused(own, "--fleet", "shared")
    record_file = root / "fleets" / "shared.json"
    record = json.loads(record_file.read_text())
    try:  # another cluster
        record_file.write_text(json.dumps({**record, "cluster_id": "slurm:elsewhere"}))
        assert "runs on slurm:elsewhere" in refused(trainer_spec(tmp_path, "refit", root=root))
        # another user's fleet (its job directory and record belong to someone else)
        record_file.write_text(json.dumps({**record, "uid": 65534, "user": "nobody"}))
        assert "belongs to user nobody" in refused(trainer_spec(tmp_path, "refit", root=root))
    finally:
        record_file.write_text(json.dumps(record))
    # a second fleet of the same name while it serves
    again = run("fleet", "up", str(fleet_spec(tmp_path, root=root)), timeout=60)
    assert again.returncode != 0 and "already serving" in again.stderr, again.stderr
    # a fleet that is gone: checked when the module's fleet is brought down (standing_fleet)


def test_readme_standing_fleet_commands(tmp_path: Path) -> None:
    """The two commands of docs/standing-fleets.md for a local standing fleet, as written (in a home of
    their own, so the jobs land under its ~/rl-launch/jobs), then ``rl-launch fleet down``."""
    import re

    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "standing-fleets.md").read_text()
    section = text[text.index("# Standing fleets") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert commands[0].startswith("rl-launch fleet up") and commands[1].startswith("rl-launch submit --fleet")
    env = dict(os.environ, HOME=str(tmp_path))
    jobs = tmp_path / "rl-launch" / "jobs"
    up = subprocess.run([RL_LAUNCH, *commands[0].split()[1:]], cwd=root, env=env, capture_output=True,
                        text=True, timeout=240)  # fmt: skip
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    (fleet_job,) = [p for p in jobs.iterdir() if p.name.startswith("local-fleet-")]
    try:
        job = subprocess.run([RL_LAUNCH, *commands[1].split()[1:]], cwd=root, env=env, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
        out = job.stdout + job.stderr
        assert job.returncode == 0, out[-4000:]
        assert "attached to standing fleet 'local-fleet'" in out and "rollout replay" in out, out[-3000:]
        (trainer,) = [p for p in jobs.iterdir() if p.name.startswith("local-replay-")]
        replay = json.loads((trainer / "replay.json").read_text())["rows"][0]
        assert replay["errors"] == 0 and replay["sessions_ok"] == replay["sessions"], replay
        listing = subprocess.run([RL_LAUNCH, "list", "--json"], env=env, capture_output=True, text=True)
        rows = {r["job"]: r for r in json.loads(listing.stdout)}
        assert rows[fleet_job.name]["fleet"] == "local-fleet"
        assert rows[trainer.name]["attached_to"] == "local-fleet"
    finally:
        down = subprocess.run([RL_LAUNCH, "fleet", "down", "local-fleet", "--force"], env=env,
                              capture_output=True, text=True, timeout=180)  # fmt: skip
    assert down.returncode == 0, down.stderr
    wait_for(lambda: job_processes(fleet_job) == [], 30, "the fleet's processes to end")


def documented(page: str, command: str) -> list[str]:
    """The words of the line in ``page``'s first bash block that starts with ``command``, as written."""
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / page).read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, page
    (line,) = [x for x in block.group(1).splitlines() if x.startswith(command)]
    return line.split("#")[0].split()


def first_frame(argv: list[str], env: dict[str, str], until: str, timeout_s: float) -> tuple[str, int]:
    """Run ``argv`` on a terminal of its own (a pseudo-terminal: the live dashboard draws frames only on
    one, as in a user's shell) until its output shows ``until``, then Ctrl-C it; ``(output, exit code)``.
    A command that ends by itself (an error) is read to its end.

    The command starts as a shell starts a foreground job: in a session whose controlling terminal is
    that pseudo-terminal, with SIGINT at its default, and Ctrl-C is the byte the terminal turns into
    SIGINT. The default matters: CI runs pytest in the background of a script, where SIGINT is ignored and
    that is inherited; Python then leaves it ignored and a signal sent straight to the command did nothing
    (in CI the dashboard never ended)."""
    import fcntl
    import pty
    import select
    import termios

    def foreground_job() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        argv,
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env=env,
        close_fds=True,
        start_new_session=True,
        preexec_fn=foreground_job,
    )
    os.close(follower)
    out = b""
    deadline = time.monotonic() + timeout_s
    try:
        while until.encode() not in out and time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # the command ended and closed its terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
    finally:
        if proc.poll() is None:
            os.write(leader, b"\x03")  # Ctrl-C
        # Read on while it ends: its last frame and the cursor's restore are written on the way out, and a
        # terminal nobody reads blocks that write once its buffer is full (in CI the command then never
        # ended: 30 s past the Ctrl-C), as a user's shell never would.
        end = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < end:
            ready, _, _ = select.select([leader], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # its terminal is closed: nothing left to block on
                    break
                if not chunk:
                    break
                out += chunk
        code = proc.wait(30)
        os.close(leader)
    return out.decode(errors="replace"), code


def test_docs_lora_status_line_finds_the_standing_fleet_by_its_name(tmp_path: Path) -> None:
    """docs/lora.md's ``rl-launch status lora-fleet``, run as written (no --root: the default job root,
    in a home of its own) while a standing fleet of that name serves, on a terminal as a user runs it.
    Before, every command that takes a JOB matched directory names only, and the fleet's directory is
    ``lora-fleet-local-<time>-<pid>``: "no job 'lora-fleet'" while it served. The fleet here has
    simulated engines (the page's has 2 real vLLM CPU engines); the lookup is the same."""
    argv = documented("lora.md", "rl-launch status")
    name = argv[2]
    assert argv == ["rl-launch", "status", name], argv
    env = dict(os.environ, HOME=str(tmp_path))
    spec = write_spec(
        tmp_path / "fleet.yaml",
        local_spec(name, root=None, fleet={"consumers": {}}, generation=sim(2, speed=4)),
    )
    up = run("fleet", "up", str(spec), "--json", timeout=240, env=env)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    job = Path(json.loads(up.stdout)["job_dir"])
    assert job.parent == tmp_path / "rl-launch" / "jobs" and job.name.startswith(f"{name}-local-")
    try:
        frame, code = first_frame([RL_LAUNCH, *argv[1:]], env, until="HEALTHY", timeout_s=60)
        as_json = run("status", name, "--json", timeout=60, env=env)
        logs = run("logs", name, timeout=30, env=env)
    finally:
        down = run("fleet", "down", name, timeout=180, env=env)
    print(f"\n$ {' '.join(argv)}  (exit {code})\n{frame[-2500:]}")
    assert f"no job {name!r}" not in frame and job.name in frame and "HEALTHY" in frame, frame[-3000:]
    assert code == 0, frame[-3000:]  # Ctrl-C ends the live view cleanly
    assert as_json.returncode == 0, as_json.stderr
    snap = json.loads(as_json.stdout)
    assert snap["job"]["dir"] == str(job) and snap["condition"] == "running", snap["job"]
    assert logs.returncode == 0 and str(job) in logs.stdout, logs.stdout[-2000:] + logs.stderr
    assert down.returncode == 0, down.stderr
    wait_for(lambda: job_processes(job) == [], 60, "the fleet's processes to end")
