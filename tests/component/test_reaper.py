"""``launcher.steps.reaper``: a local step's session ends with the driver that started it, however the driver
ends, and never otherwise. Real processes; no Ray (``tests/local/test_driver_sigkill.py`` runs a whole
job)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from launcher.jobdir import start_ticks
from launcher.steps.processes import LocalSteps
from launcher.steps.reaper import end_session, session_members

# A step like Ray's head: one child in the leader's group that ignores SIGTERM (only SIGKILL ends it) and
# one that moved to a process group of its own inside the session (as Ray's workers do).
STEP = textwrap.dedent(
    """
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", "import os, signal, time; signal.signal(signal.SIGTERM, "
        "signal.SIG_IGN); print('stubborn', os.getpid(), flush=True); time.sleep(300)"])
    subprocess.Popen([sys.executable, "-c", "import os, time; print('grouped', os.getpid(), flush=True); "
        "time.sleep(300)"], process_group=0)
    time.sleep(300)
    """
)

# The driver: starts the step through LocalSteps (as the Ray head and engine hosts are), says the pids.
DRIVER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from launcher.steps.processes import LocalSteps
    log = Path(sys.argv[1])
    step = LocalSteps().start("localhost", "demo", [sys.executable, "-c", sys.argv[2]], {}, log)
    print(step.proc.pid, step.reaper.pid, flush=True)
    time.sleep(300)
    """
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _read_pids(log: Path, names: tuple[str, ...], timeout_s: float = 30) -> list[int]:
    """The pids the step's children wrote (``NAME PID`` lines) once each is set up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = [ln.split() for ln in (log.read_text() if log.exists() else "").splitlines()]
        said = {w[0]: int(w[1]) for w in lines if len(w) == 2 and w[1].isdigit()}
        if all(n in said for n in names):
            return [said[n] for n in names]
        time.sleep(0.1)
    raise AssertionError(f"no pids in {log}: {log.read_text() if log.exists() else ''}")


def test_a_sigkilled_driver_takes_the_whole_session_of_its_step(tmp_path: Path) -> None:
    log = tmp_path / "step.log"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(log), STEP],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert driver.stdout is not None
        leader, reaper = (int(w) for w in driver.stdout.readline().split())
        stubborn, grouped = _read_pids(log, ("stubborn", "grouped"))
        members = session_members(leader)
        assert {leader, stubborn, grouped} <= set(members), members
        assert os.getpgid(grouped) != leader and os.getsid(grouped) == leader
        assert os.getsid(reaper) not in (leader, driver.pid)  # out of both sessions: kill -9 -PGID spares it
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and its group, no teardown
        t0 = time.monotonic()
        driver.wait(10)
        left = _wait_gone([leader, stubborn, grouped, reaper], timeout_s=30)
        took = time.monotonic() - t0
    finally:
        for pid in [p for p in locals().get("members", []) if _alive(p)]:
            os.kill(pid, signal.SIGKILL)
    assert left == [], left
    said = log.read_text()
    assert f"pid {driver.pid}, which started session {leader}, is gone: ending the session" in said, said
    # the leader went on SIGTERM (its group's); what ignores it or left the group, on SIGKILL
    assert f"SIGKILLed after 10 s: {sorted([stubborn, grouped])}" in said, said
    assert took < 10 + 5, took
    print(f"\nsession of a SIGKILLed driver's step gone after {took:.1f} s")


def test_the_drivers_own_stop_leaves_the_reaper_nothing_to_do(tmp_path: Path) -> None:
    log = tmp_path / "step.log"
    step = LocalSteps().start("localhost", "demo", ["sleep", "300"], {}, log)
    assert step.reaper is not None and step.reaper.poll() is None
    step.stop(grace_s=5)
    assert step.reaper.poll() == 0  # waited for by stop(): no zombie either
    assert "is gone" not in log.read_text()


def test_a_step_started_from_a_thread_outlives_that_thread(tmp_path: Path) -> None:
    """The driver starts engine hosts from the fleet controller's and elastic threads: a step tied to
    the starting thread (PR_SET_PDEATHSIG) would die when that thread ends."""
    started = []
    th = threading.Thread(
        target=lambda: started.append(
            LocalSteps().start("localhost", "demo", ["sleep", "300"], {}, tmp_path / "l")
        )
    )
    th.start()
    th.join()
    (step,) = started
    try:
        time.sleep(1.5)  # several reaper polls
        assert step.alive() and step.reaper is not None and step.reaper.poll() is None
    finally:
        step.stop(grace_s=5)


def test_a_recycled_leader_pid_is_never_signalled(tmp_path: Path) -> None:
    """A session whose leader's start time is not the one given is a stranger's: nothing is sent."""
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        ticks = start_ticks(proc.pid)
        assert ticks is not None
        assert end_session(proc.pid, ticks + 1, grace_s=0.5) == []
        time.sleep(0.3)
        assert proc.poll() is None
        assert end_session(proc.pid, ticks, grace_s=5) == []  # its own: ended on SIGTERM
        assert proc.wait(5) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
