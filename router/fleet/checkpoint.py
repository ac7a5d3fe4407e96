"""Checks on a checkpoint directory before the fleet is paused for it.

A refit that pauses every engine and only then finds that the directory is missing, unreadable, of
another model or cut short has stopped rollouts for nothing, and on vLLM 0.32 a failed
``reload_weights`` leaves the engine without weights (its next generation step kills the engine core):
one typo in a path, or a ``model.safetensors`` a trainer killed mid-save left at half its size, would
take every engine of the fleet out at once. So the router, which runs the load, refuses such a
directory before anything is paused, naming the file and the reason.

What is read, the way vLLM 0.32's default loader (``load_format=auto``) picks its files: the path is
absolute (an engine on another node resolves a relative one elsewhere), ``config.json`` is a regular
file of at most ``MAX_CONFIG_BYTES`` holding a JSON object, and its architecture and sizes are those of
the served model. The weight files are the ``*.safetensors`` (only those ``model.safetensors.index.json``
lists, when it is there; every listed shard must exist), else the ``*.bin``, else the ``*.pt`` (less
the trainer's own ``training_args.bin``, ``optimizer.pt``...). Every safetensors header is parsed by
the parser the simulator's load uses (``router.fleet.safetensors``): dtypes, shapes, byte ranges that
tile the data region, and a data region that ends exactly at the end of the file, so a file shorter or
longer than its header says is refused with both byte counts. A ``.bin`` / ``.pt`` is checked only as
far as its container: a zip-format torch file's central directory must parse, lie inside the file and
hold a ``data.pkl``; a legacy (pre-zip) torch file only by its magic number; the pickled contents are
the engine's to read.

Who may have written it: another user's directory, or one anyone can write, lets that user choose the
weights every rollout (and so the training data) comes from, or swap files between this check and the
load. So the directory and every file read are refused, after ``realpath``, when not owned by this
process's user or writable by group or others, as is a symlink that leads out of the directory and a
path that another user can redirect (``router.fleet.trusted_path``): every directory its resolution
reads must be owned by this user or root and writable by no one else unless sticky (or out of every
other user's reach, below a 0700 directory), every symlink on the way owned by one of them (issue 38:
another user's sticky team scratch, or a group-writable one, let that user swap a checked checkpoint
before the engines loaded it). ``allow_foreign`` (the refit body's
``"allow_foreign_checkpoint": true``) lets an operator load a colleague's checkpoint anyway. Anything
that is not a regular file (a FIFO, a device, a socket) is refused always, without reading it: each
file is ``lstat``-ed, opened ``O_NONBLOCK | O_NOFOLLOW`` and ``fstat``-ed before a byte is read.

All of it is blocking file-system work, which on a stalled Lustre/NFS mount blocks for as long as the
storage does: ``CheckpointGuard`` runs it in a thread under ``CHECK_TIMEOUT_S`` so the router's loop
(every routing decision) never waits on it. What is not checked: that every node sees the same files
(the premise: storage every node sees; a node-local copy in ``from_by_engine`` is checked as the
router's node sees that path), that the tensors are the served model's parameters, and anything
written after the check; a load that fails anyway is found by the engine, and that engine is
quarantined.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO, TypeVar

from router.fleet.safetensors import HeaderError, read_header
from router.fleet.trusted_path import UntrustedPath, resolve_trusted

T = TypeVar("T")

CHECK_TIMEOUT_S = 10.0
"""How long the whole check (every file of every directory) may take. Reading headers is milliseconds
even for hundreds of shards; a check that takes longer is waiting on storage that is not answering,
and a refit that went ahead would wait on the same storage with the fleet paused."""
MAX_CONFIG_BYTES = 1 << 20
"""A model's ``config.json`` is a few KB; a larger one is not a config (and is not read into memory)."""
MAX_INDEX_BYTES = 64 << 20
"""``model.safetensors.index.json`` lists every tensor's shard: a few MB for the largest models."""
INDEX_FILE = "model.safetensors.index.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
"""What vLLM's default loader reads from a directory, in its order of preference: the first suffix
with any file is the one it loads."""
NOT_FOR_INFERENCE = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")
"""The trainer's files beside ``*.bin`` / ``*.pt`` weights that vLLM skips (so they are not checked)."""
LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
"""A pre-zip ``torch.save`` file starts with its magic number pickled (protocol 2)."""
ALLOW_FOREIGN = "allow_foreign_checkpoint"
"""The refit body's flag that loads a checkpoint another user owns or can write."""
OPT_OUT = f'to load it anyway, add "{ALLOW_FOREIGN}": true to the refit'
MATCHED_FIELDS = (
    "architectures",
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)
"""The config fields that must agree with the served model's: the shapes the engine allocated."""


class CheckpointRefused(ValueError):
    """A directory the fleet must not be paused for; the message says which and why."""


@dataclass(frozen=True)
class Candidate:
    """A directory that passed: its ``config.json`` and the weight files whose headers were read."""

    config: dict[str, Any]
    files: list[str]


@dataclass
class Checked:
    """What the check read: each candidate directory (by path) and what their configs were compared
    with (``reference``: where the served model's config came from; None, and ``note`` says why none
    was compared)."""

    candidates: dict[str, Candidate] = field(default_factory=dict)
    reference: str | None = None
    note: str = ""

    def summary(self) -> str:
        """One line for the refit's answer and the log."""
        files = sum(len(c.files) for c in self.candidates.values())
        compared = f"config compared with {self.reference}" if self.reference else self.note
        return f"{files} weight file(s) in {len(self.candidates)} directory(ies) checked; {compared}"


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISLNK, "symlink"),
    ):
        if test(mode):
            return name
    return "special file"


def _trusted(st: os.stat_result, what: str, allow_foreign: bool) -> None:
    """Refuse ``what`` (already resolved) when another user owns it or group/others can write it."""
    if allow_foreign:
        return
    me = os.geteuid()
    if st.st_uid != me:
        raise CheckpointRefused(
            f"{what} is owned by uid {st.st_uid}, not by this fleet's user (uid {me}): its owner chooses "
            f"the weights every engine serves; {OPT_OUT}"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CheckpointRefused(
            f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}): anyone who can "
            f"write it chooses the weights; chmod go-w it, or {OPT_OUT}"
        )


def _inside(directory: str, entry: str, allow_foreign: bool) -> str:
    """The real path of ``entry`` of the (real) ``directory``; a symlink out of it is refused."""
    real = os.path.realpath(entry)
    if not allow_foreign and os.path.commonpath([directory, real]) != directory:
        raise CheckpointRefused(
            f"{entry} is a symlink to {real}, outside the checkpoint directory: whoever owns the target "
            f"chooses the weights; copy the file in, or {OPT_OUT}"
        )
    return real


def _open_regular(real: str, what: str) -> tuple[BinaryIO, os.stat_result]:
    """``real`` open for reading, or refused: anything but a regular file is refused before it is
    opened (a FIFO blocks its reader until a writer chooses to write), and the file opened is the one
    that was ``lstat``-ed (``O_NOFOLLOW``, same device and inode)."""
    before = os.lstat(real)
    if not stat.S_ISREG(before.st_mode):
        raise CheckpointRefused(f"{what} is a {_kind(before.st_mode)}, not a regular file")
    fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
        os.close(fd)
        raise CheckpointRefused(f"{what} changed while it was checked; try again once it is written")
    return os.fdopen(fd, "rb"), st


def read_json(directory: str, name: str, limit: int, allow_foreign: bool) -> Any:
    """The JSON in ``directory/name`` (a regular file of at most ``limit`` bytes, trusted as above)."""
    path = os.path.join(directory, name)
    real = _inside(directory, path, allow_foreign)
    fh, st = _open_regular(real, path)
    with fh:
        _trusted(st, path, allow_foreign)
        if st.st_size > limit:
            raise CheckpointRefused(f"{path} is {st.st_size} bytes: more than {limit} is no {name}")
        raw = fh.read(limit + 1)
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointRefused(f"{path} is not JSON: {exc}") from None


def weight_files(directory: str, names: list[str], allow_foreign: bool) -> list[str]:
    """The files of ``directory`` (its entries ``names``) that vLLM's default loader reads, sorted."""
    for suffix in WEIGHT_SUFFIXES:
        found = sorted(n for n in names if n.endswith(suffix))
        if found:
            break
    else:
        return []
    if suffix != ".safetensors":
        return [n for n in found if not n.endswith(NOT_FOR_INFERENCE)]
    if INDEX_FILE not in names:
        return found
    index = read_json(directory, INDEX_FILE, MAX_INDEX_BYTES, allow_foreign)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointRefused(f"{os.path.join(directory, INDEX_FILE)} has no weight_map of file names")
    listed = set(weight_map.values())
    missing = sorted(listed - set(found))
    if missing:
        raise CheckpointRefused(
            f"{os.path.join(directory, INDEX_FILE)} lists shards that are not in the directory: {missing}"
            " (a copy still running?)"
        )
    return sorted(listed)


def _check_safetensors(fh: BinaryIO, size: int, path: str) -> None:
    try:
        read_header(fh, size)
    except HeaderError as exc:
        if exc.size_said is not None:
            how = "shorter" if size < exc.size_said else "longer"
            raise CheckpointRefused(
                f"{path} is {size} bytes, {how} than the {exc.size_said} its header says ({exc}): a save "
                "cut short or a copy still running? Refit once the file is whole"
            ) from None
        raise CheckpointRefused(f"{path} is not a safetensors file the engines can load: {exc}") from None


def _check_torch(fh: BinaryIO, size: int, path: str) -> None:
    head = fh.read(len(LEGACY_TORCH_MAGIC))
    if head.startswith(LEGACY_TORCH_MAGIC):
        return  # a legacy torch file: nothing more is checked without unpickling it
    if not head.startswith(b"PK\x03\x04"):
        raise CheckpointRefused(f"{path} is neither a zip-format nor a legacy torch file")
    fh.seek(0)
    try:
        with zipfile.ZipFile(fh) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise CheckpointRefused(
            f"{path} ({size} bytes): its zip directory does not parse ({exc}): a save cut short or a copy "
            "still running?"
        ) from None
    past = [e.filename for e in entries if e.header_offset + e.compress_size > size]
    if past:
        raise CheckpointRefused(f"{path} ({size} bytes): entries end past the end of the file: {past[:3]}")
    if not any(e.filename.endswith("data.pkl") for e in entries):
        raise CheckpointRefused(f"{path} is a zip file but no torch checkpoint (it holds no data.pkl)")


def check_weight_file(directory: str, name: str, allow_foreign: bool) -> None:
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        raise CheckpointRefused(f"checkpoint directory {directory}: weight file not readable: {path}")
    real = _inside(directory, path, allow_foreign)
    fh, st = _open_regular(real, path)
    with fh:
        _trusted(st, path, allow_foreign)
        if name.endswith(".safetensors"):
            _check_safetensors(fh, st.st_size, path)
        else:
            _check_torch(fh, st.st_size, path)


def trusted_directory(path: str, allow_foreign: bool, kind: str = "checkpoint") -> tuple[str, list[str]]:
    """The real path of the directory ``path`` and its entries, after the checks on the directory
    itself (absolute, there, readable, this user's and not writable by others), or
    ``CheckpointRefused``; ``kind`` names it in the message (``checkpoint``, ``adapter``)."""
    if not isinstance(path, str) or not path:
        raise CheckpointRefused(f'"from" must name a{"n" if kind[0] in "aeiou" else ""} {kind} directory')
    if not os.path.isabs(path):
        raise CheckpointRefused(
            f"{kind} directory {path!r} is relative: give an absolute path (each engine resolves it "
            "on its own node)"
        )
    if not os.path.exists(path):
        raise CheckpointRefused(f"{kind} directory {path} does not exist")
    real = os.path.realpath(path)
    st = os.stat(real)
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointRefused(f"{kind} {path} is not a directory")
    if not os.access(real, os.R_OK | os.X_OK):
        raise CheckpointRefused(f"{kind} directory {path} is not readable (check its permissions)")
    what = f"{kind} directory {path}" + (f" ({real})" if real != path else "")
    _trusted(st, what, allow_foreign)
    if not allow_foreign:
        try:
            resolved = resolve_trusted(path, what)
        except UntrustedPath as exc:
            raise CheckpointRefused(f"{exc}, or {OPT_OUT}") from None
        if resolved != real:
            raise CheckpointRefused(f"{what} moved while it was checked; try again once it stays in place")
    return real, os.listdir(real)


def _directory(path: str, allow_foreign: bool) -> tuple[str, list[str], dict[str, Any]]:
    """The real path of the directory ``path``, its entries and its ``config.json``, after the checks
    on the directory itself, or ``CheckpointRefused``."""
    real, names = trusted_directory(path, allow_foreign)
    if "config.json" not in names:
        raise CheckpointRefused(f"checkpoint directory {path} has no config.json")
    config = read_json(real, "config.json", MAX_CONFIG_BYTES, allow_foreign)
    if not isinstance(config, dict):
        raise CheckpointRefused(f"{os.path.join(real, 'config.json')} is not a JSON object")
    return real, names, config


def read_checkpoint(path: str, allow_foreign: bool = False) -> Candidate:
    """The directory's ``config.json`` and weight files after every check above, or
    ``CheckpointRefused`` naming what is wrong. Blocking: ``CheckpointGuard`` runs it off the loop."""
    try:
        real, names, config = _directory(path, allow_foreign)
        weights = weight_files(real, names, allow_foreign)
        if not weights:
            raise CheckpointRefused(
                f"checkpoint directory {path} holds no weight files "
                f"({', '.join('*' + s for s in WEIGHT_SUFFIXES)})"
            )
        for name in weights:
            check_weight_file(real, name, allow_foreign)
    except OSError as exc:  # a race with a writer, EIO from the storage, EACCES on a file
        raise CheckpointRefused(f"checkpoint directory {path}: {exc}") from None
    return Candidate(config, weights)


def mismatches(served: dict[str, Any], candidate: dict[str, Any]) -> list[str]:
    """``field: served != candidate`` for each matched field the two configs disagree on."""
    out = []
    for name in MATCHED_FIELDS:
        if name in served or name in candidate:
            a, b = served.get(name), candidate.get(name)
            if a != b:
                out.append(f"{name}: served {a!r}, checkpoint {b!r}")
    return out


def reference_config(root: str | None) -> tuple[dict[str, Any] | None, str]:
    """The served model's ``config.json`` from ``root`` (``None`` and why not, when it cannot be used).

    Only an absolute directory of this user's, checked as a candidate is (never ``allow_foreign``):
    a hub name, or the simulator's ``sim-8b``, read as a path would be read relative to the router's
    working directory, where another user's planted ``config.json`` would decide which checkpoints are
    refused."""
    if not root:
        return None, "no served model directory"
    if not os.path.isabs(root):
        return None, f"the served model {root!r} is no absolute directory (a hub name?)"
    try:
        return _directory(root, allow_foreign=False)[2], ""
    except (CheckpointRefused, OSError) as exc:
        return None, f"the served model's directory is not used: {exc}"


def check_directories(
    paths: list[str], served_root: str | None, last_path: str | None, allow_foreign: bool = False
) -> Checked:
    """Every directory in ``paths`` checked, and compared with the served model's config: from
    ``served_root`` (the engines' ``/v1/models`` root), else from ``last_path`` (the directory the last
    refit that moved the fleet loaded), else not compared (``note`` says why). Blocking."""
    out = Checked()
    reference, why = reference_config(served_root)
    if reference is not None:
        out.reference = f"{served_root} (the served model's)"
    elif last_path:
        reference, why_last = reference_config(last_path)
        if reference is not None:
            out.reference = f"{last_path} (the last refit's)"
        else:
            why = f"{why}; the last refit's: {why_last}"
    if reference is None:
        out.note = f"architecture and sizes not compared: {why}"
    for path in paths:
        candidate = read_checkpoint(path, allow_foreign)
        if reference is not None:
            bad = mismatches(reference, candidate.config)
            if bad:
                raise CheckpointRefused(
                    f"checkpoint directory {path} does not match the served model ({out.reference}): "
                    + "; ".join(bad)
                )
        out.candidates[path] = candidate
    return out


class CheckpointGuard:
    """Runs the blocking check in a thread under a deadline, one at a time.

    A thread blocked on storage cannot be cancelled; a refit retried against the same stalled mount
    would add one stuck thread per try until the default executor (which also resolves host names for
    the router's connections) had none left. So while a timed-out check's thread still runs, the next
    check is refused at once, naming it."""

    def __init__(self, timeout_s: float = CHECK_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._stuck: tuple[asyncio.Future[Any], float] | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a thread; ``CheckpointRefused`` when it takes longer than the deadline."""
        if self._stuck is not None:
            task, since = self._stuck
            if not task.done():
                waited = time.monotonic() - since
                raise CheckpointRefused(
                    f"the previous checkpoint check has waited on storage for {waited:.0f} s and still has "
                    "not returned: storage not answering? Try again when it answers"
                )
            self._stuck = None
        task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        try:
            return await asyncio.wait_for(asyncio.shield(task), self.timeout_s)
        except TimeoutError:
            self._stuck = (task, time.monotonic() - self.timeout_s)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # never "never retrieved"
            raise CheckpointRefused(
                f"checkpoint check timed out after {self.timeout_s:g} s: storage not answering?"
            ) from None
