"""What ``rl-launch fleet grow/shrink`` and the driver exchange, and the ``elastic`` part of the job state.

The CLI (on a login node) and the driver (on the allocation) share only the job directory, which is 0700
and the user's own: a request is a file the CLI writes atomically into ``<job>/elastic/requests``, the
driver takes it, acts, and writes the answer to ``<job>/elastic/answers/<id>.json``. No port is opened for
it, so nobody else on the cluster can resize a job (the brief's rule: every port is reachable by anyone).
This module is the one owner of those two shapes and of the state section ``rl-launch status`` reads.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from launcher.jobdir.atomic import write_json_atomic
from launcher.jobdir.paths import elastic_answers_dir as answers_dir
from launcher.jobdir.paths import elastic_dir
from launcher.jobdir.paths import elastic_requests_dir as requests_dir

Op = Literal["grow", "shrink", "cancel"]

REQUEST_ID = re.compile(r"[0-9a-z-]{1,64}")
"""What a request id may be: it names the request's and the answer's files, so nothing that reaches out
of their directory (``../x`` had the answer written to ``elastic/x.json``). The CLI's ids are
``<ms>-<hex>``."""


def check_id(request_id: object) -> str:
    """``request_id`` if it is a request id, else ``ValueError`` saying what one is."""
    if not isinstance(request_id, str) or not REQUEST_ID.fullmatch(request_id):
        raise ValueError(
            f"request id {str(request_id)[:80]!r} is not one: 1-64 of [0-9a-z-] (the CLI makes them)"
        )
    return request_id


# Grow states, in order (ENDED/CANCELLED/FAILED are final).
GROW_PENDING = "PENDING"
"""Submitted, waiting in Slurm's queue (``reason`` says why: Resources, Priority, ...)."""
GROW_STARTING = "STARTING"
"""Its nodes are allocated; engine hosts are starting on them."""
GROW_JOINED = "JOINED"
"""Its engines are in the fleet."""
GROW_ENDED = "ENDED"
GROW_CANCELLED = "CANCELLED"
GROW_FAILED = "FAILED"
GROW_FINAL = frozenset({GROW_ENDED, GROW_CANCELLED, GROW_FAILED})

# Node states (a generation node of the fleet, from the allocation or a grow).
NODE_SERVING = "SERVING"
NODE_DRAINING = "DRAINING"
NODE_RELEASED = "RELEASED"


@dataclass
class ElasticRequest:
    """One resize asked of a running job.

    ``grow``: ``nodes`` more generation nodes (``time_limit_s``: at most this long, never past the job's
    own end). ``shrink``: ``nodes`` of them chosen by the driver, or the ``node_names`` given; drained for
    at most ``drain_timeout_s`` (None: the spec's ``generation.drain_timeout_s``). ``cancel``: the grow
    ``grow_id`` still queued or starting."""

    op: Op
    nodes: int = 0
    node_names: list[str] = field(default_factory=list)
    grow_id: str = ""
    drain_timeout_s: float | None = None
    time_limit_s: float | None = None
    by: str = "rl-launch fleet"
    id: str = field(default_factory=lambda: f"{int(time.time() * 1000):013d}-{secrets.token_hex(3)}")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ElasticRequest:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        check_id(known.get("id"))
        return cls(**known)


@dataclass
class ElasticAnswer:
    """The driver's answer: ``ok`` and one line (the refusal's reason names what to change)."""

    id: str
    ok: bool
    message: str
    grow_id: str = ""
    nodes: list[str] = field(default_factory=list)


def make_dirs(job_dir: str | Path) -> None:
    for d in (elastic_dir(job_dir), requests_dir(job_dir), answers_dir(job_dir)):
        d.mkdir(mode=0o700, exist_ok=True)


def send(job_dir: str | Path, request: ElasticRequest) -> None:
    """Leave ``request`` for the job's driver (atomically: it never reads half a request)."""
    make_dirs(job_dir)
    write_json_atomic(requests_dir(job_dir) / f"{check_id(request.id)}.json", asdict(request))


def wait_answer(
    job_dir: str | Path, request_id: str, timeout_s: float, poll_s: float = 0.2
) -> ElasticAnswer | None:
    """The driver's answer to ``request_id``, or None if none came within ``timeout_s``."""
    path = answers_dir(job_dir) / f"{check_id(request_id)}.json"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            data = json.loads(path.read_text())
            return ElasticAnswer(**{k: data[k] for k in ElasticAnswer.__dataclass_fields__ if k in data})
        except (OSError, ValueError, TypeError, AttributeError):  # not (yet) a whole answer: keep waiting
            pass
        if time.monotonic() > deadline:
            return None
        time.sleep(poll_s)


def take_requests(job_dir: str | Path) -> list[ElasticRequest | tuple[str, str]]:
    """The requests waiting, oldest first, each removed as it is taken. A file that is not a request comes
    back as ``(id, why)`` so the driver can answer it instead of ignoring it; ``id`` is the file's name,
    ``''`` when that is not a request id (no answer can be named for it). A request whose id is not its
    file's name is refused: the answer goes where the asker waits, under that name."""
    d = requests_dir(job_dir)
    try:
        names = sorted(n for n in os.listdir(d) if n.endswith(".json"))
    except OSError:
        return []
    out: list[ElasticRequest | tuple[str, str]] = []
    for name in names:
        path = d / name
        stem = name[: -len(".json")]
        try:
            check_id(stem)
            request = ElasticRequest.from_json(json.loads(path.read_text()))
            if request.id != stem:
                raise ValueError(f"its id {request.id!r} is not its file's name")
            out.append(request)
        except (OSError, ValueError, TypeError) as exc:
            named = stem if REQUEST_ID.fullmatch(stem) else ""
            shown = name if named else repr(name[:100])  # a stranger name is quoted, cut, on one line
            out.append((named, f"unreadable request {shown}: {exc}"))
        try:
            path.unlink()
        except OSError:
            pass
    return out


def answer(job_dir: str | Path, reply: ElasticAnswer) -> None:
    make_dirs(job_dir)
    write_json_atomic(answers_dir(job_dir) / f"{check_id(reply.id)}.json", asdict(reply))


def node_seconds(nodes: list[dict[str, Any]], now: float) -> tuple[float, float]:
    """``(held, given back)`` node-seconds of the state's node rows at ``now``: a node counts from
    ``since`` until ``released_at`` (or now), and what it gave back from ``released_at`` until now (the
    job's end, once it ended)."""
    held = given = 0.0
    for n in nodes:
        since = n.get("since")
        if since is None:
            continue
        end = n.get("released_at") or now
        held += max(0.0, end - since)
        if n.get("released_at"):
            given += max(0.0, now - n["released_at"])
    return held, given
