"""The training phase: the user's command runs on the driver's node (``bash -c``) in a session of its
own, so the teardown can stop all of it by process group; its output is teed to the job's training log
and the driver's stdout; its exit code is the job's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from launcher.steps.reaper import guard


class TrainingCommand:
    """The training command of one job: run once, stopped by the teardown."""

    def __init__(self, command: str, log_path: Path) -> None:
        self.command = command
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.reaper: subprocess.Popen[bytes] | None = None

    def run(self, env: dict[str, str], check: Callable[[], None]) -> int:
        """Run the command to its end; its exit code. ``check`` is called every second while it runs and
        stops the wait by raising (the fleet is gone, the time limit is near); the command is left
        running for the teardown to stop."""
        self.proc = subprocess.Popen(
            ["bash", "-c", self.command],
            env=env,
            cwd=os.getcwd(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        # Its session ends with the driver, even one SIGKILLed: nothing else would stop it in local mode.
        self.reaper = guard(self.proc)
        tee = threading.Thread(target=_tee, args=(self.proc, self.log_path), daemon=True)
        tee.start()
        while True:
            try:
                code = self.proc.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                check()
        tee.join(5)
        return code

    def stop(self) -> None:
        """SIGTERM to the command's process group, SIGKILL after 10 s; nothing if it never ran or has
        ended."""
        if self.proc is None or self.proc.poll() is not None:
            self._wait_reaper()
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._wait_reaper()

    def _wait_reaper(self) -> None:
        """The reaper exits once the command's session is empty: wait for it (no zombie left)."""
        if self.reaper is not None:
            try:
                self.reaper.wait(1)
            except subprocess.TimeoutExpired:
                pass


def _tee(proc: subprocess.Popen[bytes], log_path: Path) -> None:
    assert proc.stdout is not None
    with log_path.open("ab") as log:
        for line in iter(proc.stdout.readline, b""):
            log.write(line)
            log.flush()
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
