"""A supervised ``vllm-router`` process on a fixed address, and the Ray actor that owns it.

Why a supervisor thread and not only Ray's actor restart: the process dies on its own (a crash, an OOM
kill, an operator's ``kill``) far more often than the actor does; restarting it in place from the actor
brings it back on the same host:port in well under a second, with no Ray round trip. Why the actor too
(``max_restarts=-1``, like our own router's): if the actor's process dies, Ray restarts it with the same
constructor arguments, and it starts vllm-router on the very same port again. The child gets
``PR_SET_PDEATHSIG`` so it never outlives its supervisor: an orphan would hold the port and the
restarted actor could not bind it.

A restarted vllm-router comes back with no workers: the fleet controller's next push registers them
again (``launcher.gateways.vllm_router.admin.Registrar``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from launcher.gateways.vllm_router.admin import VllmRouterAdmin

_PR_SET_PDEATHSIG = 1
START_TIMEOUT_S = 30.0
_RESTART_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the stop path still kills it
        pass


class VllmRouterProcess:
    """One vllm-router command kept running: started now, restarted whenever it exits until ``stop``."""

    def __init__(self, command: Sequence[str], base_url: str, log_path: str | os.PathLike[str] | None = None):
        self.command = list(command)
        self.url = base_url
        self.log_path = Path(log_path) if log_path else None
        self.admin = VllmRouterAdmin(base_url)
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _spawn(self) -> None:
        out: Any = subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_path, "ab")  # the child holds it; closed below
        try:
            self._proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()

    def start(self, timeout_s: float = START_TIMEOUT_S) -> VllmRouterProcess:
        """Start it and return once ``/liveness`` answers; raises ``RuntimeError`` with its log's tail."""
        with self._lock:
            self._spawn()
        self.wait_live(timeout_s)
        self._thread = threading.Thread(target=self._supervise, name="vllm-router-supervisor", daemon=True)
        self._thread.start()
        return self

    def wait_live(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.admin.live():
            proc = self._proc
            if proc is not None and proc.poll() is not None and not self._supervised():
                raise RuntimeError(f"vllm-router exited with {proc.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm-router did not answer {self.url}/liveness in {timeout_s:.0f} s")
            time.sleep(0.05)

    def _supervised(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _supervise(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            proc = self._proc
            assert proc is not None
            started = time.monotonic()
            proc.wait()
            if self._stopping.is_set():
                return
            # A process that lived a while starts its backoff over; one that keeps dying waits longer.
            failures = 0 if time.monotonic() - started > 30 else failures + 1
            backoff = _RESTART_BACKOFF_S[min(failures, len(_RESTART_BACKOFF_S)) - 1] if failures else 0.0
            if self._stopping.wait(backoff):
                return
            with self._lock:
                if self._stopping.is_set():
                    return
                self._spawn()
                self.restarts += 1

    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def log_tail(self) -> str:
        """The last line of its log that says what went wrong (one line), and where the log is."""
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        lines = self.log_path.read_bytes()[-20000:].decode(errors="replace").splitlines()
        errors = [x.strip() for x in lines if "error" in x.lower()] or [x.strip() for x in lines if x.strip()]
        return f"{errors[-1] if errors else '(empty log)'} (log: {self.log_path})"

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop supervising and end the process (TERM, then KILL); idempotent."""
        self._stopping.set()
        with self._lock:
            proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)


class VllmRouterActor:
    """The managed vllm-router inside a Ray actor meant for ``max_restarts=-1``: everything comes from
    the constructor's arguments (the command holds the fixed port), so a restart rebinds the same URL."""

    def __init__(self, command: list[str], base_url: str, log_path: str | None) -> None:
        self._process = VllmRouterProcess(command, base_url, log_path).start()

    def base_url(self) -> str:
        return self._process.url

    def pid(self) -> int | None:
        """The vllm-router process's pid: changes whenever it (or this actor) restarted."""
        return self._process.pid()

    def restarts(self) -> int:
        return self._process.restarts

    def stop(self) -> None:
        self._process.stop()


def remote_vllm_router_actor(**options: Any) -> Any:
    import ray

    return ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1, **options)(VllmRouterActor)
