"""The driver's own lines (``Driver._say``): whole lines on stderr and in the driver log, whichever thread
says them. The teardown stops its parts from parallel threads, each saying "teardown: X stopped in N s";
``print`` writes a line and its newline apart, and two ran together on one line
("...training stopped in 0.0 s[rl-launch 14.8s] teardown: router stopped in 0.0 s")."""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

import pytest

from launcher.driver.driver import Driver
from launcher.jobdir import JobDir

LINE = re.compile(r"^\[rl-launch +\d+\.\ds\] teardown: part-\d+ stopped in 0\.0 s$")


def test_lines_said_at_once_by_many_threads_stay_whole(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    driver = Driver.__new__(Driver)  # only what _say uses: the job directory and the clock
    driver.job = JobDir(tmp_path / "job").create()
    driver.t0 = time.monotonic()
    driver._say_lock = threading.Lock()
    start = threading.Barrier(16)

    def part(n: int) -> None:
        start.wait()
        for _ in range(200):
            driver._say(f"teardown: part-{n} stopped in 0.0 s")

    threads = [threading.Thread(target=part, args=(n,)) for n in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    sys.stderr.flush()
    err = capfd.readouterr().err.splitlines()
    logged = driver.job.driver_log.read_text().splitlines()
    for lines in (err, logged):
        bad = [line for line in lines if not LINE.match(line)]
        assert not bad and len(lines) == 16 * 200, bad[:5]


def test_a_training_failure_carries_its_log_tail(tmp_path: Path) -> None:
    from launcher.driver.training import TrainingCommand

    log = tmp_path / "training.log"
    log.write_text(
        "step 1\n" * 200_000 + "\nTraceback (most recent call last):\n\nValueError: bad config\n\n"
    )
    said = TrainingCommand("python train.py", log).failure(1, lines=3)
    assert said == (
        f"training command exited with 1 (log: {log})\n  step 1\n  Traceback (most recent call last):\n"
        "  ValueError: bad config"
    )
    log.write_text("")
    assert (
        TrainingCommand("true", log).failure(3)
        == f"training command exited with 3 (log: {log}), which is empty"
    )
    assert TrainingCommand("true", tmp_path / "none.log").failure(3).endswith("which is empty")
