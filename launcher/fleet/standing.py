"""Standing fleets: a generation-only job (``rl-launch fleet up``) that jobs attach to by name.

The one module that owns what a fleet and its consumers leave on the shared filesystem:

* **the fleet record** ``<job_root>/fleets/<name>.json`` (``FleetRecord``): which job directory serves the
  name now, on which cluster, for which user and model. Written when the fleet is submitted (so a fleet
  still queued can be found and waited for) and again by its driver once it serves.
* **the consumers file** ``<fleet job>/consumers.json`` (its shape is ``router.consumers``'s, which the
  router reads): one entry per attached job with the sha256 of its client key, its weight and whether it
  may refit. The attaching job's driver adds its own entry and removes it when it ends; the fleet's
  driver also removes the entry of every consumer whose job has ended (``prune_ended``), so a key is
  revoked however its job ended (a SIGKILLed driver, a node lost, a time limit).

Why the attaching job resolves everything before it allocates (``resolve_fleet``): a job that waits in
the queue for an hour and then finds the fleet gone, another user's, on another cluster or serving
another model has wasted the hour; each of those is refused at submit time with the reason.
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import socket
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from launcher.jobdir import JobDir, write_json_atomic
from launcher.jobdir.ownership import (
    Untrusted,
    check_root,
    ensure_job_root,
    entry_problem,
    make_private,
    user_label,
)
from launcher.jobdir.paths import FLEETS_DIR
from launcher.jobdir.paths import consumers_file as consumers_path
from launcher.jobdir.paths import fleet_record_file as record_path

DOWN_FILE = "down.json"
"""``rl-launch fleet down`` writes it into the fleet's job directory; the fleet's driver then ends cleanly
(exit 0, "brought down"), where a signal would have recorded a cancel."""
OWNER = "owner"
"""The consumer name the fleet's own API key is counted under (``router.consumers``)."""

Liveness = Literal["serving", "starting", "queued", "gone"]


class FleetRefused(RuntimeError):
    """A fleet that cannot be attached to (or brought down) now; the message is one line with the reason
    and what to do."""


@dataclass(frozen=True)
class FleetRecord:
    name: str
    job_dir: str
    cluster: Literal["slurm", "local"]
    cluster_id: str
    """``local:<host>`` or ``slurm:<ClusterName>``: a fleet is reachable only from its own cluster."""
    uid: int
    user: str
    served_model_name: str
    slurm_job_id: str | None
    t: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FleetRecord:
        return cls(**{k: data.get(k) for k in cls.__dataclass_fields__})  # type: ignore[arg-type]


def cluster_id(cluster: str) -> str:
    """Which cluster this process is on: Slurm's ``ClusterName`` (two clusters may share a filesystem
    and a job root, but not their networks), or ``local:<host>``."""
    if cluster == "local":
        return f"local:{socket.gethostname()}"
    import subprocess

    try:
        out = subprocess.run(
            ["scontrol", "show", "config"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "ClusterName":
            return f"slurm:{value.strip()}"
    return "slurm:?"


def new_record(
    name: str, job_dir: Path, cluster: Literal["slurm", "local"], model: str, slurm_job_id: str | None
) -> FleetRecord:
    uid = os.getuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    return FleetRecord(
        name, str(job_dir), cluster, cluster_id(cluster), uid, user, model, slurm_job_id, time.time()
    )


# -- the records: only the caller's own are read or written -------------------------------------------
# In a shared job root another user can plant ``fleets/`` or a record naming a job directory whose state
# names a process of the caller's; ``fleet down`` then signalled it (security review 2026-12, finding 6).
# So ``fleets/`` is 0700 and the caller's, and a record counts only when its file, its ``uid`` and its job
# directory are all the caller's (``launcher.jobdir.ownership``).


def _fleets_dir(job_root: str | Path, create: bool) -> Path:
    """``<job_root>/fleets``, made 0700 with ``create``; ``FleetRefused`` when the root or the directory
    is not the caller's to trust. One of the caller's own left group-readable by an earlier rl-launch
    (made from the umask) is chmodded 0700."""
    root = Path(job_root).expanduser()
    d = root / FLEETS_DIR
    try:
        if create:
            ensure_job_root(root)
            make_private(d)
        else:
            check_root(root)
    except Untrusted as exc:
        raise FleetRefused(str(exc)) from None
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return d
    if st.st_uid == os.getuid() and stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(d, 0o700)
        st = os.lstat(d)
    why = entry_problem(d, "fleets directory", st)
    if why is not None:
        raise FleetRefused(
            f"{why}; its records are not trusted (another user may have planted them): ask its owner to "
            "remove it, or use a job root of your own"
        )
    return d


def _load_record(path: Path) -> FleetRecord:
    """The record at ``path`` if the caller may trust it, else ``FleetRefused`` naming the path and its
    owner. ``FileNotFoundError`` when there is none; other ``OSError``/``ValueError``/``TypeError``: torn.
    Opened without following a symlink or blocking on a FIFO, and judged by the opened file's own stat,
    so what is checked is what is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FleetRefused(
                entry_problem(path, "fleet record") or f"fleet record {path}: a symlink"
            ) from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise FleetRefused(f"fleet record {path} is not a regular file: refused")
        why = entry_problem(path, "fleet record", st)
        if why is not None:
            raise FleetRefused(why)
        data = json.loads(f.read())
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    record = FleetRecord.from_json(data)
    if record.uid != os.getuid():
        owner = user_label(record.uid) if isinstance(record.uid, int) else repr(record.uid)
        raise FleetRefused(f"fleet record {path} says the fleet belongs to {owner}, not to you: refused")
    why = entry_problem(Path(record.job_dir), "its job directory")
    if why is not None:
        raise FleetRefused(f"fleet record {path}: {why}")
    return record


def write_record(job_root: str | Path, record: FleetRecord) -> Path:
    path = _fleets_dir(job_root, create=True) / f"{record.name}.json"
    write_json_atomic(path, record.to_json())
    return path


def read_record(job_root: str | Path, name: str) -> FleetRecord | None:
    """The caller's record of fleet ``name``; None when there is none; ``FleetRefused`` when it is
    unreadable, or not the caller's (the file, its ``uid`` or its job directory), naming path and owner."""
    path = _fleets_dir(job_root, create=False) / f"{name}.json"
    try:
        return _load_record(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        raise FleetRefused(
            f"fleet record {path}: unreadable ({exc}); remove it and bring the fleet up"
        ) from None


def list_records(job_root: str | Path) -> list[FleetRecord]:
    """The caller's readable records under ``job_root``; any other record is left out."""
    d = _fleets_dir(job_root, create=False)
    if not d.is_dir():
        return []
    out = []
    for path in sorted(d.glob("*.json")):
        try:
            out.append(_load_record(path))
        except (FleetRefused, OSError, ValueError, TypeError):
            continue
    return out


def remove_record(job_root: str | Path, record: FleetRecord) -> None:
    """Drop the name's record if it still points at this fleet's job (a newer fleet of the same name
    keeps its own)."""
    current = read_record(job_root, record.name)
    if current is not None and current.job_dir == record.job_dir:
        record_path(job_root, record.name).unlink(missing_ok=True)


def request_down(fleet_job: str | Path, force: bool, why: str) -> None:
    write_json_atomic(Path(fleet_job) / DOWN_FILE, {"t": time.time(), "force": force, "why": why})


def down_requested(fleet_job: str | Path) -> str | None:
    """Why the fleet was asked to come down (the request's words), or None."""
    path = Path(fleet_job) / DOWN_FILE
    if not path.exists():
        return None
    try:
        return str(json.loads(path.read_text()).get("why") or "rl-launch fleet down")
    except (OSError, ValueError):
        return "rl-launch fleet down"


# -- is it there? --------------------------------------------------------------------------------------
def liveness(record: FleetRecord) -> tuple[Liveness, str]:
    """Where the fleet is now, with the words for a person: queued (Slurm's reason), starting, serving
    (its URL), or gone (how it ended)."""
    job = JobDir(record.job_dir)
    result = job.read_result()
    if result is not None:
        return "gone", f"it ended: {result.outcome} ({result.reason})"
    state = job.read_state()
    if record.cluster == "slurm" and record.slurm_job_id:
        from launcher.slurm import queue

        entry = queue.squeue_entry(record.slurm_job_id)
        if entry is None:
            final = queue.sacct_state(record.slurm_job_id)
            if final or not queue.slurm_available():
                return "gone", f"Slurm job {record.slurm_job_id} is not in the queue ({final or 'ended'})"
        elif entry.state == "PENDING":
            return "queued", f"Slurm job {record.slurm_job_id} PENDING ({entry.reason})"
    else:
        alive = job.driver_alive()
        if alive is False:
            return "gone", "its driver is no longer running"
    if state.get("router_url") and state.get("fleet_serving_since") and not state.get("torn_down"):
        return "serving", str(state["router_url"])
    return "starting", f"phase {state.get('phase') or 'submitted'}"


def resolve_fleet(
    ref: str,
    job_root: str | Path,
    *,
    cluster: str,
    model_name: str | None,
) -> FleetRecord:
    """The fleet a job attaches to, checked before anything is allocated: it exists, is this user's, on
    this cluster, serves ``model_name`` (when the job names one) and has not ended. ``ref``: a fleet
    name under ``job_root`` or a fleet's job directory."""
    path = Path(ref).expanduser()
    if path.is_dir():
        data = JobDir(path).read_state().get("fleet_record")
        if not data:
            raise FleetRefused(f"generation.fleet {ref}: {path} is not a standing fleet's job directory")
        record = FleetRecord.from_json(data)
    else:
        found = read_record(job_root, ref)
        if found is None:
            known = ", ".join(r.name for r in list_records(job_root)) or "none"
            raise FleetRefused(
                f"generation.fleet {ref!r}: no standing fleet of that name under {job_root} (fleets there: "
                f"{known}); start one with `rl-launch fleet up SPEC`"
            )
        record = found
    try:
        owner = Path(record.job_dir).stat().st_uid
    except OSError:
        raise FleetRefused(f"generation.fleet {ref!r}: its job directory {record.job_dir} is gone") from None
    if owner != os.getuid() or record.uid != os.getuid():
        raise FleetRefused(
            f"generation.fleet {ref!r}: the fleet belongs to user {record.user} (uid {owner}), not to you; "
            "a fleet is shared with other users' jobs only through its owner"
        )
    here = cluster_id(cluster)
    if record.cluster_id != here:
        raise FleetRefused(
            f"generation.fleet {ref!r}: the fleet runs on {record.cluster_id}, this job on {here}; attach "
            "from the fleet's cluster"
        )
    if model_name and record.served_model_name != model_name:
        raise FleetRefused(
            f"generation.fleet {ref!r}: the fleet serves model {record.served_model_name!r}, this job asks "
            f"for {model_name!r}; fix generation.served_model_name / gym.model_name or attach elsewhere"
        )
    state, why = liveness(record)
    if state == "gone":
        raise FleetRefused(f"generation.fleet {ref!r}: the fleet is gone ({why}); bring it up again")
    return record


def wait_serving(
    record: FleetRecord, timeout_s: float, say: Callable[[str], None], poll_s: float = 1.0
) -> dict[str, Any]:
    """The fleet's state once it serves; bounded by ``timeout_s``, saying why it waits (Slurm's reason)
    whenever that changes. Raises ``FleetRefused`` if it ends or the wait runs out."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        state, why = liveness(record)
        if state == "serving":
            return JobDir(record.job_dir).read_state()
        if state == "gone":
            raise FleetRefused(f"fleet {record.name!r} is gone ({why})")
        if why != last:
            say(f"waiting for fleet {record.name!r}: {why}")
            last = why
        if time.monotonic() > deadline:
            raise FleetRefused(
                f"fleet {record.name!r} is not serving after {timeout_s:g} s ({why}); raise "
                "generation.fleet_wait_s or check it with `rl-launch status`"
            )
        time.sleep(poll_s)


# -- consumers -------------------------------------------------------------------------------------------
def attach(
    record: FleetRecord,
    consumer: JobDir,
    job_name: str,
    weight: float,
    admin: bool,
    adapters: Sequence[str] = (),
) -> str:
    """Register ``consumer`` with the fleet: a new client key in the consumer's own 0600 key file (the
    one its Gym overlay and environment read), its hash in the fleet's consumers file, never an admin
    credential (every rollout worker and agent sandbox reads it). ``admin`` (the fleet's spec marks the
    job so): the job's own ``secrets/admin_token`` is registered too, as the consumer's admin key
    (``router.consumers``), for the refit routes; only the job's driver and trainer read that file.
    ``adapters``: the LoRA adapters the fleet's spec reserves for the job
    (``fleet.consumers.<job>.adapters``), which the router lets only this consumer (and the owner) load,
    unload and call.
    Returns the consumer's name there (its job directory's name: unique per job)."""
    from router.consumers import add_admin_key, add_consumer

    consumer.new_api_key()
    name = consumer.path.name
    path = consumers_path(record.job_dir)
    add_consumer(
        path,
        name,
        consumer.read_api_key(),
        weight=weight,
        admin=False,
        job=str(consumer.path),
        replace=True,
        adapters=tuple(adapters),
    )
    if admin:
        add_admin_key(path, name, consumer.read_admin_token(), job=str(consumer.path), weight=weight)
    return name


def detach(record_job_dir: str | Path, name: str) -> bool:
    """Revoke consumer ``name``'s keys, its admin key included (``router.consumers.remove_consumer``)."""
    from router.consumers import remove_consumer

    return remove_consumer(consumers_path(record_job_dir), name)


def consumer_ended(job: JobDir) -> str | None:
    """Why an attached job counts as ended (its key is then revoked), or None while it may still run."""
    result = job.read_result()
    if result is not None:
        return f"{result.outcome}: {result.reason}"
    if not job.path.exists():
        return "its job directory is gone"
    alive = job.driver_alive()
    if alive is False:
        return "its driver is no longer running"
    slurm_id = job.slurm_job_id()
    if alive is None and slurm_id:
        from launcher.slurm import queue

        state = queue.job_state(slurm_id)
        if queue.is_final(state):
            return f"Slurm job {slurm_id} {state}"
    return None


def attached(fleet_job: str | Path) -> dict[str, Any]:
    """``{name: Consumer}`` attached now (from the consumers file)."""
    from router.consumers import read_consumers

    return dict(read_consumers(consumers_path(fleet_job)))


def prune_ended(fleet_job: str | Path) -> dict[str, str]:
    """Revoke the key of every consumer whose job ended; ``{name: why}`` of those removed."""
    removed = {}
    table = attached(fleet_job)
    for name, c in table.items():
        if c.account and c.account in table:
            continue  # an admin key goes with its account's entry
        why = consumer_ended(JobDir(c.job)) if c.job else None
        if why is not None and detach(fleet_job, name):
            removed[name] = why
    return removed
