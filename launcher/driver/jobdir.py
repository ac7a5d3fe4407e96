"""The job directory: everything a job leaves for people and tools to read.

Layout (on the shared filesystem, so every node and the login node see it)::

    <job_dir>/
      spec.resolved.yaml      the resolved spec (no secrets: the API key is never in the spec)
      state.json              the current phase and figures, rewritten atomically (``rl-launch --follow``)
      events.jsonl            append-only: every phase change with a timestamp and detail
      driver.log              the driver's own log
      gym_overlay.yaml        policy_base_url / policy_api_key / policy_model_name for NeMo-Gym
      secrets/api_key         the per-run API key, mode 0600 in a 0700 directory
      engines/node-<i>.json   the engine host's config for generation node i
      engines/node-<i>.urls.json   the URLs it serves once ready (or its start error)
      logs/                   engine, engine-host, Ray and training logs
      result.json             exit code and reason, written last
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PHASES = ("queued", "starting", "ray_up", "engines_ready", "router_serving", "training", "finished", "failed")


def write_json_atomic(path: Path, payload: object) -> None:
    """Readers on other nodes must never see half a file: write aside, then rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    os.replace(tmp, path)


@dataclass
class JobDir:
    path: Path

    def __post_init__(self) -> None:
        self.path = Path(self.path).resolve()

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
    def api_key_file(self) -> Path:
        return self.path / "secrets" / "api_key"

    def create(self) -> JobDir:
        for d in (self.path, self.logs, self.engines):
            d.mkdir(parents=True, exist_ok=True)
        return self

    def new_api_key(self) -> Path:
        """A random per-run key in a 0600 file (0700 directory): handed to engines and the router by
        path or environment, never by argv, never written to the spec or a log."""
        secrets_dir = self.api_key_file.parent
        secrets_dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(secrets_dir, 0o700)
        fd = os.open(self.api_key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
        return self.api_key_file

    def read_api_key(self) -> str:
        return self.api_key_file.read_text().strip()

    def event(self, phase: str, detail: str = "", **figures: Any) -> None:
        record = {"t": time.time(), "phase": phase, "detail": detail, **figures}
        with self.events_file.open("a") as f:
            f.write(json.dumps(record, default=str) + "\n")
        state = self.read_state()
        state.update({"phase": phase, "detail": detail, "updated": record["t"], **figures})
        write_json_atomic(self.state_file, state)

    def log_event(self, kind: str, detail: str = "", **fields: Any) -> None:
        """Append an event that is not a phase change (fleet state changes, restarts, router restarts)."""
        record = {"t": time.time(), "phase": kind, "detail": detail, **fields}
        with self.events_file.open("a") as f:
            f.write(json.dumps(record, default=str) + "\n")

    def update_state(self, **fields: Any) -> None:
        state = self.read_state()
        state.update(fields)
        write_json_atomic(self.state_file, state)

    def read_state(self) -> dict[str, Any]:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}

    def read_events(self) -> list[dict[str, Any]]:
        try:
            lines = self.events_file.read_text().splitlines()
        except OSError:
            return []
        return [json.loads(line) for line in lines if line.strip()]
