"""The job directory: every file's name, who writes it, and how it is read.

Layout (on the shared filesystem, so every node and the login node see it)::

    <job_dir>/
      submitted.json          SubmittedJob, by ``rl-launch submit`` (a Slurm job is known while queued)
      spec.resolved.yaml      the resolved spec the job runs (written by submit; no secrets)
      state.json              the job state (phase, figures, FleetSnapshot, GatewaySnapshot): StateWriter only
      events.jsonl            append-only: phase changes, fleet events, restarts
      driver.log              the driver's own log
      gym_overlay.yaml        policy_base_url / policy_api_key / policy_model_name for NeMo-Gym
      secrets/api_key         the per-run client API key, 0600 in a 0700 directory
      secrets/admin_token     the router's admin token (router and fleet controller only), 0600
      secrets/engine_key      what the engines take (the front and the fleet's own calls present it; no
                              client holds it), 0600; a copy of api_key behind a front that passes the
                              client's key on to the engines (``FrontKind.engines_take_client_key``)
      secrets/ray_token       the job's Ray token (RAY_AUTH_TOKEN_PATH of every Ray node, the driver and
                              the training command), 0600
      secrets/registration_capability  the path secret of the registration URL of a job whose trainer
                              owns its engines (``generation.owner: trainer``), 0600
      secrets/<name>          a component's own credential (``new_secret``; e.g. Dynamo's etcd password), 0600
      engines/node-<i>.json          the engine host's config for generation node i (driver)
      engines/node-<i>.urls.json     EngineListing: what node i serves, or its start error (engine host)
      engines/node-<i>.control.json  ControlRequests: restart requests (fleet controller)
      engines/serve-fleet.json       the Ray Serve front's fleet state (its gateway)
      engines/serve/<replica>.json   one Ray Serve replica's engine (that replica)
      logs/                   engine, engine-host, Ray and training logs
      cache_reset.json        the last fleet-wide cache reset (driver), for the dashboard
      record/                 the router's request record (router.record; read by launcher.record)
      plots/                  a finished job's step timeline and engine load (driver, at teardown)
      elastic/                grow jobs' sbatch scripts and release files; requests/ and answers/ of resizes
      consumers.json          a standing fleet's consumers and keys (fleet owner), 0600
      dynamo/                 the Dynamo front's etcd data and planes' configs
      bench/                  a replay run as the job's training command
      result.json             JobResult, written last (driver)

    <job_root>/fleets/<name>.json   a standing fleet's record (``launcher.fleet.standing``)

The paths of the entries below ``logs/`` whose contents a feature package owns are composed in
``paths.py``, not by the package: a reader and its writer then cannot drift to two spellings.
Every file has one writer; writes are atomic with unique temporary names (``atomic.py``). Listings are
always returned in numeric node order, so engine N of ``rl-launch logs --engine N``, the dashboard's rows
and the fleet controller's ids name the same engine from 11 nodes on.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from launcher.jobdir.atomic import append_json_line, read_json, write_json_atomic
from launcher.jobdir.records import (
    ControlRequests,
    EngineEntry,
    EngineListing,
    JobResult,
    SubmittedJob,
)

_LISTING = re.compile(r"^node-(\d+)\.urls\.json$")


def _event_records(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The events in ``lines`` of ``events.jsonl``; a line that is not a JSON object (one being appended
    right now, or a torn tail) is skipped."""
    out = []
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


class JobDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).resolve()

    def __repr__(self) -> str:
        return f"JobDir({str(self.path)!r})"

    # -- names ------------------------------------------------------------------------------------------
    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def engines(self) -> Path:
        return self.path / "engines"

    @property
    def state_file(self) -> Path:
        return self.path / "state.json"

    @property
    def events_file(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def result_file(self) -> Path:
        return self.path / "result.json"

    @property
    def submitted_file(self) -> Path:
        return self.path / "submitted.json"

    @property
    def spec_file(self) -> Path:
        return self.path / "spec.resolved.yaml"

    @property
    def driver_log(self) -> Path:
        return self.path / "driver.log"

    @property
    def training_log(self) -> Path:
        return self.logs / "training.log"

    @property
    def api_key_file(self) -> Path:
        return self.path / "secrets" / "api_key"

    @property
    def admin_token_file(self) -> Path:
        return self.path / "secrets" / "admin_token"

    @property
    def engine_key_file(self) -> Path:
        return self.path / "secrets" / "engine_key"

    @property
    def ray_token_file(self) -> Path:
        return self.path / "secrets" / "ray_token"

    @property
    def cache_reset_file(self) -> Path:
        """The last fleet-wide cache reset (``router.fleet.cache_reset.CacheResetReport``), for the
        dashboard."""
        return self.path / "cache_reset.json"

    def host_config_file(self, node_index: int) -> Path:
        return self.engines / f"node-{node_index}.json"

    def listing_file(self, node_index: int) -> Path:
        return self.engines / f"node-{node_index}.urls.json"

    def control_file(self, node_index: int) -> Path:
        return self.engines / f"node-{node_index}.control.json"

    def engine_host_log(self, node_index: int) -> Path:
        return self.logs / f"engine-host-node{node_index}.log"

    def engine_log(self, node_index: int, index: int) -> Path:
        return self.logs / f"engine-node{node_index}-{index}.log"

    def create(self) -> JobDir:
        """The job directory and its fixed folders, 0700 whatever the umask: the files inside are
        trusted (state, listings, control requests) or private (logs, secrets), and a folder made from a
        group-writable umask let group members replace them. A missing job root is made 0700 too
        (``ownership.make_private``: ``parents=True`` made it from the umask, 775 under umask 002)."""
        from launcher.jobdir.ownership import make_private

        make_private(self.path.parent)
        for d in (self.path, self.logs, self.engines):
            d.mkdir(mode=0o700, exist_ok=True)
            os.chmod(d, 0o700)
        return self

    def exists(self) -> bool:
        return self.submitted_file.exists() or self.state_file.exists() or self.events_file.exists()

    def slurm_job_id(self) -> str | None:
        """The Slurm job id: from ``submitted.json`` or the driver's state, else the ``<name>-<id>``
        suffix of the directory (local runs are named ``<name>-local-<time>-<pid>`` and have none)."""
        submitted = self.read_submitted()
        if submitted is not None and submitted.job_id:
            return submitted.job_id
        state_id = self.read_state().get("slurm_job_id")
        if state_id:
            return str(state_id)
        if "-local-" in self.path.name:
            return None
        suffix = self.path.name.rsplit("-", 1)[-1]
        return suffix if suffix.isdigit() else None

    def driver_alive(self) -> bool | None:
        """Whether this job's driver process still runs: None when that cannot be told from here (no
        driver recorded yet, or it runs on another host)."""
        import socket

        from launcher.jobdir.process import is_same_process

        state = self.read_state()
        pid = state.get("driver_pid")
        if not pid or state.get("driver_host") not in (None, socket.gethostname()):
            return None
        return is_same_process(int(pid), state.get("driver_start_ticks"))

    # -- secrets ----------------------------------------------------------------------------------------
    def _new_secret(self, path: Path) -> Path:
        """A random secret in a 0600 file (0700 directory): handed over by path or environment, never by
        argv, never written to the spec or a log."""
        path.parent.mkdir(mode=0o700, exist_ok=True)
        os.chmod(path.parent, 0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        os.fchmod(fd, 0o600)  # a file that was there keeps its mode otherwise
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
        return path

    def secret_file(self, name: str) -> Path:
        """``secrets/<name>``: a credential one component of the job owns (Dynamo's etcd and NATS)."""
        return self.path / "secrets" / name

    def new_secret(self, name: str) -> Path:
        return self._new_secret(self.secret_file(name))

    def new_api_key(self) -> Path:
        return self._new_secret(self.api_key_file)

    def new_admin_token(self) -> Path:
        """Separate from the API key: every rollout worker holds the API key, and must not be able to add
        or remove the router's engines with it."""
        return self._new_secret(self.admin_token_file)

    def new_engine_key(self, client_key: bool = False) -> Path:
        """The engines' own key, so that no client key (the owner's, in every rollout worker's Gym
        config, nor a consumer's) opens an engine's routes (``/pause``, ``/collective_rpc``...) directly.
        ``client_key``: a copy of the API key instead, for a front that passes the client's key on to
        the engines (they must then take it)."""
        if not client_key:
            return self._new_secret(self.engine_key_file)
        path = self.engine_key_file
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.read_api_key())
        return path

    def new_ray_token(self) -> Path:
        """Ray's own: whoever holds it runs code as the job's user on every node (Ray's token auth)."""
        return self._new_secret(self.ray_token_file)

    def read_api_key(self) -> str:
        return self.api_key_file.read_text().strip()

    def read_admin_token(self) -> str:
        return self.admin_token_file.read_text().strip()

    def new_registration_capability(self) -> Path:
        """For engines the trainer owns: the secret path segment of the URL it registers them at and
        rolls out through (``router.http.capability``), apart from every key, because NeMo-RL's
        registration sends no header and the URL ends up in its logged config."""
        return self._new_secret(self.secret_file("registration_capability"))

    def read_registration_capability(self) -> str:
        """The registration capability; empty for a job without one (its engines are rl-launch's)."""
        try:
            return self.secret_file("registration_capability").read_text().strip()
        except FileNotFoundError:
            return ""

    def read_engine_key(self) -> str:
        """The engines' key; the API key for a job directory made before there was one (its engines
        take the API key: a running job must stay reachable by the status and the fleet commands)."""
        try:
            return self.engine_key_file.read_text().strip()
        except FileNotFoundError:
            return self.read_api_key()

    # -- state and events (read side; the driver writes through StateWriter) ---------------------------
    def read_state(self) -> dict[str, Any]:
        return read_json(self.state_file) or {}

    def read_events(self) -> list[dict[str, Any]]:
        try:
            lines = self.events_file.read_text().splitlines()
        except OSError:
            return []
        return _event_records(lines)

    def read_event_tail(self, last: int, tail_bytes: int = 256 * 1024) -> tuple[float | None, list[dict]]:
        """``(start time, last events)`` from ``events.jsonl`` without reading it whole: a multi-day run
        with a fleet controller appends for days, and the dashboard re-reads it every frame. The start
        time is the first ``starting`` event, which sits in the file's first lines."""
        path = self.events_file
        try:
            size = path.stat().st_size
            with path.open("rb") as f:
                head_bytes = f.read(64 * 1024)
                if size <= len(head_bytes):
                    tail_bytes_read = head_bytes
                else:
                    f.seek(max(0, size - tail_bytes))
                    tail_bytes_read = f.read()
        except OSError:
            return None, []
        head = head_bytes.decode(errors="replace").splitlines()
        lines = tail_bytes_read.decode(errors="replace").splitlines()
        if size > tail_bytes:
            lines = lines[1:]  # the first line of a tail read is most likely cut
        start = next((e.get("t") for e in _event_records(head) if e.get("phase") == "starting"), None)
        events = _event_records(lines)
        return (float(start) if isinstance(start, int | float) else None), events[-last:] if last > 0 else []

    def log_event(self, kind: str, detail: str = "", **fields: Any) -> None:
        """Append an event that changes no state (any process may; lines never interleave)."""
        append_json_line(self.events_file, {"t": time.time(), "phase": kind, "detail": detail, **fields})

    # -- engine listings and control requests ---------------------------------------------------------
    def listing_indices(self) -> list[int]:
        """Node indices with a listing, in numeric order (node-10 after node-9, never after node-1)."""
        try:
            names = os.listdir(self.engines)
        except OSError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _LISTING.match(n)))

    def read_listing(self, node_index: int) -> EngineListing | None:
        data = read_json(self.listing_file(node_index))
        return EngineListing.from_dict(data, node_index) if data is not None else None

    def write_listing(self, listing: EngineListing) -> None:
        write_json_atomic(self.listing_file(listing.node_index), listing.to_dict())

    def listings(self) -> list[EngineListing]:
        out = []
        for i in self.listing_indices():
            listing = self.read_listing(i)
            if listing is not None:
                out.append(listing)
        return out

    def engine_entries(self) -> list[EngineEntry]:
        """Every listed engine in fleet order: node index, then engine index."""
        return [e for listing in self.listings() for e in sorted(listing.engines, key=lambda e: e.index)]

    def read_control(self, node_index: int) -> ControlRequests:
        data = read_json(self.control_file(node_index))
        return ControlRequests.from_dict(data) if data is not None else ControlRequests()

    def write_control(self, node_index: int, requests: ControlRequests) -> None:
        write_json_atomic(self.control_file(node_index), requests.to_dict())

    # -- result and submission ----------------------------------------------------------------------
    def read_result(self) -> JobResult | None:
        data = read_json(self.result_file)
        return JobResult.from_dict(data) if data is not None else None

    def write_result(self, result: JobResult) -> None:
        write_json_atomic(self.result_file, result.to_dict())

    def read_cache_reset(self) -> dict[str, Any] | None:
        data = read_json(self.cache_reset_file)
        return data if isinstance(data, dict) else None

    def write_cache_reset(self, report: dict[str, Any]) -> None:
        """Written by ``rl-launch fleet reset-cache`` (not the driver: a file of its own, so it never
        races the driver's writes of ``state.json``)."""
        write_json_atomic(self.cache_reset_file, report)

    def read_submitted(self) -> SubmittedJob | None:
        data = read_json(self.submitted_file)
        return SubmittedJob.from_dict(data) if data is not None else None

    def write_submitted(self, record: SubmittedJob) -> None:
        write_json_atomic(self.submitted_file, record.to_dict())


class StateWriter:
    """The one writer of ``state.json``, shared by the driver's main thread and the fleet thread.

    The state lives in memory and every change is written whole under a lock: no thread reads the file
    back to modify it, so one thread's update can never drop another's (a lost phase), and the unique
    temporary names of ``write_json_atomic`` keep two renames from colliding."""

    def __init__(self, job: JobDir) -> None:
        self.job = job
        self._lock = threading.Lock()
        self._state: dict[str, Any] = job.read_state()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._state)

    def update(self, **fields: Any) -> None:
        with self._lock:
            self._state.update(fields)
            write_json_atomic(self.job.state_file, self._state)

    def event(self, phase: str, detail: str = "", **figures: Any) -> None:
        """A phase change: appended to the events and made the current state."""
        t = time.time()
        with self._lock:
            append_json_line(self.job.events_file, {"t": t, "phase": phase, "detail": detail, **figures})
            self._state.update({"phase": phase, "detail": detail, "updated": t, **figures})
            write_json_atomic(self.job.state_file, self._state)

    def log_event(self, kind: str, detail: str = "", **fields: Any) -> None:
        self.job.log_event(kind, detail, **fields)
