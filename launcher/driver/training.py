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

    @property
    def started(self) -> bool:
        return self.proc is not None

    def failure(self, code: int, lines: int = 10) -> str:
        """Why the job failed when the command exited with ``code``: with the last lines of its log, as an
        engine's failure has them. Before, the job said only "training command exited with 2" and the
        cause ("can't open file '.../train.py'", run from another directory) was in the training log
        alone, for ``rl-launch logs --training`` to find."""
        tail = log_tail(self.log_path, lines)
        said = f"\n{tail}" if tail else ", which is empty"
        return f"training command exited with {code} (log: {self.log_path}){said}"

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


def log_tail(path: Path, lines: int, max_bytes: int = 16384) -> str:
    """The last ``lines`` non-blank lines of ``path``, indented (its last ``max_bytes`` only: a trainer
    may have written gigabytes); empty if there is none."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(["  " + line.rstrip() for line in text.splitlines() if line.strip()][-lines:])
