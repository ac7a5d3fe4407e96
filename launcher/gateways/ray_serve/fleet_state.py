"""What Ray Serve's routing must know of the refit window: one small file, written by the gateway, read by
the Serve replicas.

Why a file: the judge of the refit window (``launcher.gateways.fleet_endpoint``: which engine is held out
as stale or quarantined by a refit, which weight version each serves) runs in the driver, while the ingress
and the engine replicas that must obey it are Serve replicas, possibly on other nodes. The job directory
is shared by every node, so the gateway writes ``engines/serve-fleet.json`` atomically whenever the
verdict or the replicas change, and each replica process reads it at most every ``READ_EVERY_S``
(``FleetStateReader``: cached, read in a thread, never from disk per request). A hold-out therefore reaches
routing within about ``READ_EVERY_S`` of the endpoint deciding it. This module owns the file's shape;
nothing else parses it.

The file sits beside ``engines/serve/``, not in it: every ``*.json`` there is a replica's own record
(``replica.registry_dir``).

The rule a replica is held to (``FleetState.refusal``): one the file holds out does not serve; once the
fleet has a stamped version, neither does one the file does not list yet (a replacement replica comes back
on the checkpoint's weights and is checked against the fleet's version only once the gateway has seen it:
until then it would serve stale rollouts unlabelled). Before any stamp every engine serves the checkpoint,
so an unlisted replica serves. No file at all (a Serve application without the driver's gateway, e.g. the
bench's arms) holds nothing out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.jobdir import read_json, write_json_atomic
from launcher.jobdir.paths import serve_fleet_file

READ_EVERY_S = 0.5
"""How stale a replica process's view of the file may be: one read per process per period, whatever the
request rate."""


@dataclass(frozen=True)
class ReplicaState:
    url: str
    """The replica's engine, as its registry record names it."""
    version: str | None
    """The weight version the fleet endpoint last recorded for that engine (``None``: unknown)."""
    held_out: str | None
    """Why the engine may not serve (stale, quarantined by a refit, not checked yet); ``None``: it serves."""


@dataclass(frozen=True)
class FleetState:
    version: str | None
    """The fleet's current weight version (``None`` before the first stamp)."""
    replicas: Mapping[str, ReplicaState] = field(default_factory=dict)
    """Serve replica unique id -> its engine's state, for the replicas alive when the gateway wrote it."""

    def refusal(self, replica_id: str) -> str | None:
        """Why replica ``replica_id`` may not serve now, else ``None`` (see the module's rule)."""
        replica = self.replicas.get(replica_id)
        if replica is not None:
            return replica.held_out
        if self.version is None:
            return None
        return f"replica {replica_id} is not checked against weight version {self.version!r} yet"

    def held_out(self) -> dict[str, str]:
        """``{replica id: why}`` for the listed replicas that may not serve."""
        return {rid: r.held_out for rid, r in self.replicas.items() if r.held_out is not None}

    def version_of(self, replica_id: str) -> str | None:
        replica = self.replicas.get(replica_id)
        return replica.version if replica is not None else None

    def none_may_serve(self, running: int) -> str | None:
        """Why none of Serve's ``running`` engine replicas may serve (the ingress then answers the
        no-healthy status at once instead of letting Serve queue the request), else ``None``."""
        held = self.held_out()
        if not held:
            return None
        if self.version is not None:  # unlisted replicas are refused too: only the listed, admitted ones
            if any(rid not in held for rid in self.replicas):
                return None
        elif running > len(held):  # unlisted replicas serve before any stamp
            return None
        reasons = "; ".join(f"{self.replicas[rid].url}: {why}" for rid, why in sorted(held.items()))
        return f"every engine replica is held out of routing by the refit window ({reasons})"

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "replicas": {
                rid: {"url": r.url, "version": r.version, "held_out": r.held_out}
                for rid, r in sorted(self.replicas.items())
            },
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FleetState:
        replicas = data.get("replicas") or {}
        return cls(
            data.get("version"),
            {
                str(rid): ReplicaState(str(r.get("url", "")), r.get("version"), r.get("held_out"))
                for rid, r in replicas.items()
                if isinstance(r, dict)
            },
        )


def fleet_state_path(job_dir: str | Path) -> Path:
    return serve_fleet_file(job_dir)


def write_fleet_state(job_dir: str | Path, state: FleetState) -> None:
    """Atomically (a reader on another node never sees half of it); the gateway is the one writer."""
    path = fleet_state_path(job_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {**state.to_json(), "written_at": time.time()})


def read_fleet_state(job_dir: str | Path) -> FleetState | None:
    """The file's state; ``None`` when there is none (no gateway wrote one) or it cannot be read."""
    data = read_json(fleet_state_path(job_dir))
    return FleetState.from_json(data) if data is not None else None


class FleetStateReader:
    """One process's cached view of the file: ``get`` reads it again (in a thread: the job directory is a
    shared filesystem) only when the last read is ``every_s`` old, and concurrent callers share one read.
    A read that finds nothing keeps the last state: a file once written is never removed while Serve
    runs, so a failed read is the filesystem's hiccup, not the refit window lifting its hold-outs."""

    def __init__(self, job_dir: str | Path | None, every_s: float = READ_EVERY_S) -> None:
        self.job_dir = job_dir
        self.every_s = every_s
        self._state: FleetState | None = None
        self._at = float("-inf")
        self._reading: asyncio.Task[FleetState | None] | None = None

    async def get(self) -> FleetState | None:
        if self.job_dir is None:
            return None
        if time.monotonic() - self._at >= self.every_s:
            if self._reading is None:
                self._reading = asyncio.ensure_future(asyncio.to_thread(read_fleet_state, self.job_dir))
            reading = self._reading
            try:
                state = await asyncio.shield(reading)
            finally:
                if self._reading is reading and reading.done():
                    self._reading = None
            if state is not None:
                self._state = state
            self._at = time.monotonic()
        return self._state
