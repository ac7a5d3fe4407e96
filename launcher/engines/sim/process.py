"""``SimEngine``: the simulator as a separate process behind the launcher's ``Engine`` interface.

The launcher starts it exactly like a vLLM server (own process group, log file, health wait with a
deadline, SIGTERM then SIGKILL), so the code paths the launcher uses for real engines are the ones
the GPU-less tests exercise.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from typing import IO

from ..base import Engine, EngineSpec, EngineStartError
from .cli import API_KEY_ENV

JOB_DIR_ENV = "RL_LAUNCH_JOB_DIR"
"""Exported by the driver to every process of a job."""


def scratch_root() -> str | None:
    """``<job dir>/scratch`` inside a job (the engine's URL file, and its log when none is given), so a
    job writes nothing into a shared ``/tmp``; the system temp directory otherwise."""
    job_dir = os.environ.get(JOB_DIR_ENV)
    if not job_dir:
        return None
    root = os.path.join(job_dir, "scratch")
    os.makedirs(root, exist_ok=True)
    return root


class SimEngine(Engine):
    """One simulator process serving ``engines`` simulated engines (``urls`` lists them all;
    ``url``/``port`` are the first). ``spec.extra_args`` are simulator flags, e.g. ``["--speed", "10"]``.
    ``spec.model`` becomes the served model name; ``tensor_parallel_size`` is ignored."""

    def __init__(self, spec: EngineSpec, *, engines: int = 1, python: str | None = None) -> None:
        self.spec = spec
        self.engines = engines
        self.python = python or sys.executable
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._log_path: str | None = spec.log_path
        self._url_file: str | None = None
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self._urls: list[str] = []
        # The log's tail, kept when stop() deletes a temporary log, so a post-mortem still has it.
        self._log_tail_cache = ""

    @property
    def port(self) -> int:
        """The first engine's port: ``spec.port`` if fixed, else known once ``wait_ready`` returned
        (0 before: an OS-chosen port must not be handed out before the child has bound it)."""
        if self._urls:
            return int(self._urls[0].rsplit(":", 1)[1])
        return self.spec.port

    @property
    def urls(self) -> list[str]:
        """Every engine's ``http://host:port`` once ready."""
        return list(self._urls)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> str | None:
        return self._log_path

    def command(self) -> list[str]:
        cmd = [
            self.python,
            "-m",
            "launcher.engines.sim",
            "--host",
            self.spec.host,
            "--port",
            str(self.spec.port),
            "--engines",
            str(self.engines),
            "--model-name",
            self.spec.name,
            "--watch-parent",
        ]
        if self._url_file:
            cmd += ["--url-file", self._url_file]
        if self.spec.api_key and self.spec.key_guard:  # as the launcher's vLLM engines (--middleware)
            cmd.append("--key-guard")
        return cmd + list(self.spec.extra_args)

    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError("engine already started")
        self._tmpdir = tempfile.TemporaryDirectory(prefix="rl-sim-", dir=scratch_root())
        self._url_file = os.path.join(self._tmpdir.name, "urls")
        if self._log_path is None:
            self._log_path = os.path.join(self._tmpdir.name, "sim.log")
        else:
            os.makedirs(os.path.dirname(os.path.abspath(self._log_path)), exist_ok=True)
        env = dict(os.environ)
        env.pop(API_KEY_ENV, None)  # spec.api_key decides, not whatever the launcher inherited
        env.update(self.spec.env)
        if self.spec.api_key:
            env[API_KEY_ENV] = self.spec.api_key  # the environment, never argv (visible in ps)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._log = open(self._log_path, "ab")  # closed in stop()
        self._proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # own process group: stop() can signal everything it spawned
        )

    def _read_urls(self) -> list[str]:
        if not self._url_file:
            return []
        try:
            with open(self._url_file) as fh:
                return [ln.strip() for ln in fh if ln.strip()]
        except FileNotFoundError:
            return []

    @staticmethod
    def _healthy(url: str) -> bool:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2.0) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_ready(self, deadline: float | None = None) -> None:
        if self._proc is None:
            raise EngineStartError("engine not started")
        if deadline is None:
            deadline = time.monotonic() + self.spec.startup_timeout_s
        urls: list[str] = []
        while True:
            rc = self._proc.poll()
            if rc is not None:
                raise EngineStartError(
                    f"simulator exited with code {rc} while starting; log tail:\n{self.log_tail()}"
                )
            if not urls:
                urls = self._read_urls()
            if urls and all(self._healthy(u) for u in urls):
                self._urls = urls
                return
            if time.monotonic() >= deadline:
                raise EngineStartError(
                    "simulator not healthy before its deadline; log tail:\n" + self.log_tail()
                )
            time.sleep(0.05)

    def stop(self, grace_s: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            self._signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            # SIGKILL the group even after a clean exit of the leader: a stray child must not survive.
            self._signal_group(proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5.0)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._tmpdir is not None:
            if self._log_path and self._log_path.startswith(self._tmpdir.name):
                self._log_tail_cache = self._tail_file(self._log_path, 200)
            self._tmpdir.cleanup()
            self._tmpdir = None
        self._urls = []

    @staticmethod
    def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @staticmethod
    def _tail_file(path: str, lines: int) -> str:
        try:
            with open(path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(fh.tell() - 64 * 1024, 0))
                tail = deque(fh.read().decode("utf-8", errors="replace").splitlines(), maxlen=lines)
        except OSError:
            return ""
        return "\n".join(tail)

    def log_tail(self, lines: int = 40) -> str:
        if self._log_path and os.path.exists(self._log_path):
            return self._tail_file(self._log_path, lines)
        return "\n".join(self._log_tail_cache.splitlines()[-lines:])
