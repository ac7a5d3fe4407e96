"""The consumers file: which jobs may use a standing generation fleet, with what weight and rights.

A fleet job runs engines and this router for a long time; training and eval jobs (*consumers*) attach to
it, each with its own client key, so that one job can be revoked without rotating everybody's key, and so
the router can tell jobs apart (fair share, per-consumer metrics). The launcher registers and revokes
consumers by editing one file; the router reads it (``ConsumerKeys``). This module is the one owner of
that file's shape: the launcher and the router both import it.

The file::

    {"version": 1, "consumers": {NAME: {"key_sha256": HEX, "weight": 1.0, "admin": false,
                                       "job": "...", "attached_at": 1767000000.0},
                                 NAME.admin: {"key_sha256": HEX, "admin": true, "account": NAME, ...}}}

Two kinds of entry, one credential each (``Consumer.account``):

* a **client key** (no ``account``): what the job's rollout workers send (its Gym overlay and environment
  carry it), taken on the client routes only. Every rollout worker and agent sandbox reads it, so it
  never opens an admin route, whatever the job's rights: ``admin`` is false for the entries the launcher
  writes (``admin: true`` on a client key, one key for both uses registered by hand with
  ``add_consumer(admin=True)``, still opens them: the owner chose that for a key it handed out itself).
* an **admin key** (``account``: the consumer it acts for): the job's own ``secrets/admin_token``,
  registered for a consumer its fleet's owner marked admin. It opens the refit routes (``/fleet/*``),
  never a client route (one use each: a leaked admin key generates nothing, and requests are never
  counted under a second ledger name), nor the owner's ``/workers`` (``router.http.auth``). Named
  ``<account>.admin``; revoking the account revokes it too (``remove_consumer``).

Choices, each against a failure:

* Only the sha256 of each key is stored: the file holds no secret, so a copy of it (a backup, a job
  directory shared with the cluster's users) grants nothing. Keys are 256-bit random
  (``new_key``), so an unsalted hash is enough: nobody can search that space.
* Written atomically (a temporary file in the same directory, then ``os.replace``) under an ``fcntl`` lock
  on a sibling lock file: two launcher processes attaching at once both keep their entry (a plain
  read-modify-write would lose one), and the router never reads half a file. Mode 0600.
* A corrupt file, or one of another version, is an error naming the file (``ConsumersFileError``), never
  silently "no consumers": the launcher must not overwrite what it cannot read. The router's live view
  keeps its last good table instead (a launcher mid-crash must not lock every job out).
* Names are what the launcher chose, ``[A-Za-z0-9._-]``: they become Prometheus label values and log
  words. ``owner`` is reserved for the fleet owner's own key (the router's API key).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import hmac
import logging
import math
import os
import re
import secrets
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

VERSION = 1
OWNER = "owner"
"""The consumer name of the fleet owner's own key (the router's API key, or the admin token)."""
NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
_HEX_RE = re.compile(r"[0-9a-f]{64}")


class ConsumersFileError(ValueError):
    """The consumers file cannot be read as version 1 (the one-line message names the file)."""


def hash_key(key: str) -> str:
    """The hex sha256 of ``key``, as the file stores it."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def new_key() -> str:
    """A fresh consumer key: 256 random bits, URL-safe (it travels in a bearer header and in configs)."""
    return secrets.token_urlsafe(32)


def check_name(name: str) -> str:
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        raise ValueError(f"consumer name {name!r} must be 1-128 characters of [A-Za-z0-9._-]")
    if name == OWNER:
        raise ValueError(f"consumer name {OWNER!r} is reserved for the fleet owner's own key")
    return name


ADMIN_SUFFIX = ".admin"
"""An admin key's entry name: ``<account>.admin`` (``admin_entry_name``)."""


def admin_entry_name(account: str) -> str:
    return check_name(check_name(account) + ADMIN_SUFFIX)


@dataclass(frozen=True)
class Consumer:
    """One entry of the fleet's consumers file. ``weight``: its share of the fleet's capacity when jobs
    contend (``router.state.fair_share``); ``admin``: it may call the refit routes (pause, refit);
    ``account``: set on an admin key, the consumer it acts for (module doc), empty on a client key."""

    name: str
    key_sha256: str
    weight: float = 1.0
    admin: bool = False
    job: str = ""
    attached_at: float = 0.0
    account: str = ""
    adapters: tuple[str, ...] = ()
    """The LoRA adapters the fleet's owner reserved for this consumer (``fleet.consumers.<name>.adapters``):
    only it (and the owner) may load, unload or call them (``router.adapters.table``)."""

    @property
    def is_admin_key(self) -> bool:
        return bool(self.account)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "key_sha256": self.key_sha256,
            "weight": self.weight,
            "admin": self.admin,
            "job": self.job,
            "attached_at": self.attached_at,
        }
        if self.account:
            out["account"] = self.account
        if self.adapters:
            out["adapters"] = list(self.adapters)
        return out

    @classmethod
    def from_json(cls, name: str, data: Any) -> Consumer:
        """Raises ``ValueError`` naming the first wrong field."""
        check_name(name)
        if not isinstance(data, dict):
            raise ValueError(f"consumer {name!r}: an object expected, got {type(data).__name__}")
        key = data.get("key_sha256")
        if not isinstance(key, str) or _HEX_RE.fullmatch(key) is None:
            raise ValueError(f"consumer {name!r}: key_sha256 must be 64 lowercase hex digits")
        weight = data.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not _positive(weight):
            raise ValueError(f"consumer {name!r}: weight must be a number > 0, got {weight!r}")
        admin = data.get("admin", False)
        if not isinstance(admin, bool):
            raise ValueError(f"consumer {name!r}: admin must be true or false, got {admin!r}")
        job = data.get("job", "")
        if not isinstance(job, str):
            raise ValueError(f"consumer {name!r}: job must be a string, got {job!r}")
        attached = data.get("attached_at", 0.0)
        if isinstance(attached, bool) or not isinstance(attached, int | float):
            raise ValueError(f"consumer {name!r}: attached_at must be a number, got {attached!r}")
        account = data.get("account", "")
        if account != "":
            if not isinstance(account, str) or name != f"{account}{ADMIN_SUFFIX}" or not admin:
                raise ValueError(
                    f"consumer {name!r}: account must name the consumer whose admin key this is "
                    f"(entry <account>{ADMIN_SUFFIX}, admin true), got {account!r}"
                )
            check_name(account)
        adapters = data.get("adapters", [])
        if not isinstance(adapters, list) or not all(
            isinstance(a, str) and NAME_RE.fullmatch(a) for a in adapters
        ):
            raise ValueError(f"consumer {name!r}: adapters must be a list of names of [A-Za-z0-9._-]")
        return cls(name, key, float(weight), admin, job, float(attached), account, tuple(adapters))


OWNER_CONSUMER = Consumer(OWNER, "", 1.0, True)
"""The identity of the router's own API key (and admin token): weight 1, as the brief of a fleet says."""


def _positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def _parse(text: bytes, path: Path) -> dict[str, Consumer]:
    import json

    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConsumersFileError(f"consumers file {path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("version") != VERSION:
        got = data.get("version") if isinstance(data, dict) else type(data).__name__
        raise ConsumersFileError(
            f"consumers file {path} is not version {VERSION} (got version {got!r}); "
            "this router or launcher reads only version 1"
        )
    entries = data.get("consumers", {})
    if not isinstance(entries, dict):
        raise ConsumersFileError(f"consumers file {path}: 'consumers' must be an object")
    out: dict[str, Consumer] = {}
    for name, entry in entries.items():
        try:
            out[name] = Consumer.from_json(name, entry)
        except ValueError as exc:
            raise ConsumersFileError(f"consumers file {path}: {exc}") from None
    return out


def read_consumers(path: str | os.PathLike[str]) -> dict[str, Consumer]:
    """``{name: Consumer}``; a missing file has no consumers. Raises ``ConsumersFileError`` (one line,
    naming the file) for a file that is not valid version-1 JSON, ``OSError`` for one that cannot be
    read."""
    p = Path(path)
    try:
        text = p.read_bytes()
    except FileNotFoundError:
        return {}
    return _parse(text, p)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """The file's writers, one at a time: an exclusive ``flock`` on ``<file>.lock`` beside it (not on the
    file itself, which ``os.replace`` swaps for a new inode under a waiting writer)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _write(path: Path, consumers: dict[str, Consumer]) -> None:
    import json

    body = {"version": VERSION, "consumers": {n: c.to_json() for n, c in sorted(consumers.items())}}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(body, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def add_consumer(
    path: str | os.PathLike[str],
    name: str,
    key: str,
    weight: float = 1.0,
    admin: bool = False,
    job: str = "",
    *,
    replace: bool = False,
    adapters: tuple[str, ...] = (),
) -> Consumer:
    """Register ``name`` with the hash of ``key``. Refuses (``ValueError``) a name already present
    unless ``replace``, a bad name or weight, and an empty key; returns the entry written."""
    check_name(name)
    if name.endswith(ADMIN_SUFFIX):
        raise ValueError(
            f"consumer name {name!r}: names ending {ADMIN_SUFFIX!r} are the admin keys' (add_admin_key)"
        )
    if not isinstance(key, str) or not key:
        raise ValueError("a consumer key must be a non-empty string")
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not _positive(weight):
        raise ValueError(f"consumer {name!r}: weight must be a number > 0, got {weight!r}")
    p = Path(path)
    for a in adapters:
        if NAME_RE.fullmatch(a) is None:
            raise ValueError(f"consumer {name!r}: adapter name {a!r} must be 1-128 of [A-Za-z0-9._-]")
    entry = Consumer(name, hash_key(key), float(weight), bool(admin), job, time.time(), "", tuple(adapters))
    with _locked(p):
        consumers = read_consumers(p)
        if name in consumers and not replace:
            raise ValueError(f"consumer {name!r} is already registered in {p} (revoke it first)")
        consumers[name] = entry
        _write(p, consumers)
    return entry


def add_admin_key(
    path: str | os.PathLike[str], account: str, key: str, job: str = "", weight: float = 1.0
) -> Consumer:
    """Register ``key`` as the admin key of consumer ``account`` (entry ``<account>.admin``, replacing
    one there): it opens the refit routes only (module doc). ``weight``: the account's, so the entry
    reads like it; admission counts requests under the account, never this entry."""
    if not isinstance(key, str) or not key:
        raise ValueError("an admin key must be a non-empty string")
    name = admin_entry_name(account)
    p = Path(path)
    entry = Consumer(name, hash_key(key), float(weight), True, job, time.time(), account)
    with _locked(p):
        consumers = read_consumers(p)
        consumers[name] = entry
        _write(p, consumers)
    return entry


def remove_consumer(path: str | os.PathLike[str], name: str) -> bool:
    """Revoke ``name`` and its admin key if it has one (their keys stop working within
    ``ConsumerKeys.reload_every_s``; whatever the keys held, a pause or a refit, ends with them:
    ``router.fleet.revocation``). False when it was not registered."""
    p = Path(path)
    with _locked(p):
        consumers = read_consumers(p)
        gone = [n for n, c in consumers.items() if n == name or c.account == name]
        if not gone:
            return False
        for n in gone:
            del consumers[n]
        _write(p, consumers)
    return True


class ConsumerKeys:
    """The router's live view of the consumers file: which consumer a bearer key belongs to.

    Re-reads the file when its ``(mtime_ns, size, inode)`` changed, looked at no more often than every
    ``reload_every_s``: a revoked key stops working within that, and the request path pays a stat at most
    that often (a clock read otherwise). Each process of a router keeps its own view of the same path.

    A file that disappears means no consumers. A file that cannot be read or parsed keeps the last good
    table (a launcher that crashed mid-edit must not lock every job out; the writes are atomic, so this
    is a damaged file, not a half-written one) and is logged once per distinct error, never with keys.
    """

    def __init__(self, path: str | os.PathLike[str], reload_every_s: float = 0.5) -> None:
        self.path = Path(path)
        self.reload_every_s = reload_every_s
        self._by_hash: dict[str, Consumer] = {}
        self._by_name: dict[str, Consumer] = {}
        self._signature: tuple[int, int, int] | None = None
        self._next_check = 0.0
        self._last_error: str | None = None
        self.reloads = 0
        self.refresh(force=True, strict=True)

    def refresh(self, force: bool = False, strict: bool = False) -> None:
        """Re-read the file if it changed (``force``: look now). ``strict``: raise a read error instead
        of keeping the last table (the router's start: a corrupt file there is a configuration error)."""
        now = time.monotonic()
        if not force and now < self._next_check:
            return
        self._next_check = now + self.reload_every_s
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if self._signature is not None or self._by_hash:
                self._install({}, None)
            return
        except OSError as exc:
            self._failed(exc, strict)
            return
        signature = (st.st_mtime_ns, st.st_size, st.st_ino)
        if signature == self._signature:
            return
        try:
            consumers = read_consumers(self.path)
        except (OSError, ConsumersFileError) as exc:
            self._failed(exc, strict)
            return
        self._install(consumers, signature)

    def _install(self, consumers: dict[str, Consumer], signature: tuple[int, int, int] | None) -> None:
        self._by_name = consumers
        self._by_hash = {c.key_sha256: c for c in consumers.values()}
        self._signature = signature
        self.reloads += 1
        if self._last_error is not None:
            log.warning("consumers file %s readable again: %d consumer(s)", self.path, len(consumers))
        self._last_error = None

    def _failed(self, exc: Exception, strict: bool) -> None:
        if strict:
            raise ConsumersFileError(str(exc)) if not isinstance(exc, ConsumersFileError) else exc
        message = str(exc)
        if message != self._last_error:
            log.error("%s; keeping the %d consumer(s) read before", message, len(self._by_hash))
            self._last_error = message

    def lookup(self, key: str | None) -> Consumer | None:
        """The consumer whose key is ``key``, or None. The table is indexed by the keys' hashes (a lookup
        by the hash of a 256-bit random key reveals nothing usable); the hit is confirmed in constant
        time."""
        if key is None:
            return None
        self.refresh()
        digest = hash_key(key)
        found = self._by_hash.get(digest)
        if found is None or not hmac.compare_digest(found.key_sha256, digest):
            return None
        return found

    def consumers(self) -> dict[str, Consumer]:
        """The table now, every entry (re-read first if due)."""
        self.refresh()
        return dict(self._by_name)

    def accounts(self) -> dict[str, Consumer]:
        """The consumers as the fair share counts them: the client keys' entries, each marked ``admin``
        when the account has an admin key (what "may refit" means for it), without the admin keys'
        own entries (their requests are never counted under a name of their own)."""
        self.refresh()
        with_admin = {c.account for c in self._by_name.values() if c.account and c.admin}
        return {
            n: (dataclasses.replace(c, admin=True) if n in with_admin and not c.admin else c)
            for n, c in self._by_name.items()
            if not c.account
        }

    def holds(self, consumer: Consumer) -> bool:
        """Whether ``consumer``'s key is still registered (re-read first if due): a request admitted
        with a key that has since been revoked is refused when it is dispatched (``router.http.auth``)."""
        self.refresh()
        current = self._by_hash.get(consumer.key_sha256)
        return current is not None and current.name == consumer.name
