"""A checkpoint's tensors against the served model's, and what its files were when they were verified.

Two holes this closes, both measured on real vLLM 0.32 CPU engines (issue 38, finding 11):

* **A missing or extra tensor.** vLLM's in-place ``reload_weights`` loads what the directory holds and
  keeps the old values of every parameter it does not find: a checkpoint missing one linear tensor
  refitted with exit 0 and the engines served a hybrid under the new version (vLLM itself refuses to
  *start* from such a directory). So before anything pauses, every tensor's name, dtype and shape in the
  checkpoint's safetensors headers (``router.fleet.safetensors``) must equal the served model's: the
  headers of the directory the engines were started from (the ``/v1/models`` root), else of the last
  refit's. A difference is refused (400) naming the tensors. Not compared, and said so in the check's
  summary: a served model that is no absolute directory of this user's (a hub name), or weights that are
  not all ``*.safetensors`` on either side (a ``.bin`` is a pickle the router does not open).
* **Files changed after their version was verified.** A restore reloads the fleet's current version from
  the directory its refit verified; a directory rewritten since (the next step saved over it, or anyone
  who can write it) was loaded into a restarted engine under the old version. So the check records each
  weight file's ``FileStamp`` (size, mtime, ctime, inode, device and the SHA-256 of its safetensors
  header), the refit re-reads them after its engines loaded (a file changed during the load fails the
  refit for the engines that read it), the fleet keeps the record with the version it verified
  (``router.fleet.refit.WeightSource``), and a restore refuses files whose stamp differs, before it loads
  anything, and again after its load. Why a stamp and not a digest of every byte: the check runs under a
  10 s deadline on checkpoints of hundreds of GB; and no write leaves a file's ctime as it was (the kernel
  sets it on every change of content, size or name, and no user can set it back), while a replacement
  by rename changes the inode. What it cannot see: a file system that does not keep ctime.

Blocking file-system work: run by ``router.fleet.checkpoint.CheckpointGuard`` off the loop, as the rest
of the check is.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

from router.fleet.checkpoint import (
    Checked,
    CheckpointRefused,
    check_directories,
    reference_config,
    trusted_directory,
    weight_files,
)
from router.fleet.safetensors import HeaderError, read_header

Tensors = dict[str, tuple[str, tuple[int, ...]]]
"""Each tensor's ``(dtype, shape)`` by name, over every weight file of a directory."""
SHOWN = 6
"""Names listed per kind of difference in a refusal (the count says how many more)."""


@dataclass(frozen=True)
class FileStamp:
    """One weight file as it was read: any change of its content, size or identity changes this."""

    name: str
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int
    header: str
    """SHA-256 of its safetensors header ("" for a ``.bin`` / ``.pt``)."""

    def differences(self, now: FileStamp) -> list[str]:
        out = []
        if (self.device, self.inode) != (now.device, now.inode):
            out.append("replaced by another file")
        if self.size != now.size:
            out.append(f"size {self.size} -> {now.size} bytes")
        if self.mtime_ns != now.mtime_ns:
            out.append("modified (mtime)")
        elif self.ctime_ns != now.ctime_ns:
            out.append("changed (ctime; mtime was set back)")
        if self.header != now.header:
            out.append("its tensors' header differs")
        return out


@dataclass(frozen=True)
class DirectoryRecord:
    """What a checkpoint directory held when it was checked: its weight files and their tensors."""

    path: str
    files: tuple[FileStamp, ...]
    tensors: Tensors | None
    """``None`` when not every weight file is a safetensors file (no header to read the names from)."""
    allow_foreign: bool = False
    """Read as the refit allowed it (``allow_foreign_checkpoint``), and so read again."""

    def again(self) -> DirectoryRecord:
        """The same directory read now (blocking), to compare with ``changes``."""
        return read_record(self.path, self.allow_foreign)

    def changes(self, now: DirectoryRecord) -> list[str]:
        """``name: what changed`` for each weight file that differs from ``now`` (or came or went)."""
        before = {f.name: f for f in self.files}
        after = {f.name: f for f in now.files}
        out = [f"{n}: removed" for n in sorted(before.keys() - after.keys())]
        out += [f"{n}: added" for n in sorted(after.keys() - before.keys())]
        for name in sorted(before.keys() & after.keys()):
            diff = before[name].differences(after[name])
            if diff:
                out.append(f"{name}: {', '.join(diff)}")
        return out


def _stamp(real: str, name: str) -> tuple[FileStamp, Tensors | None]:
    """Stamp one weight file (a regular file, opened without following a link) and read its header."""
    path = os.path.join(real, name)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointRefused(f"{path} is not a regular file")
        header, tensors = "", None
        if name.endswith(".safetensors"):
            try:
                parsed = read_header(fh, st.st_size)
            except HeaderError as exc:
                raise CheckpointRefused(f"{path}: {exc}") from None
            header, tensors = parsed.digest, parsed.tensors_of
    stamp = FileStamp(name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev, header)
    return stamp, tensors


def read_record(path: str, allow_foreign: bool = False) -> DirectoryRecord:
    """The record of the checkpoint directory ``path`` (its weight files as vLLM's loader picks them).
    Blocking; ``CheckpointRefused`` for a directory or file that cannot be read as checked."""
    try:
        real, names = trusted_directory(path, allow_foreign)
        files = weight_files(real, names, allow_foreign)
        stamps, tensors, every = [], {}, True
        for name in files:
            stamp, found = _stamp(real, name)
            stamps.append(stamp)
            if found is None:
                every = False
            else:
                tensors.update(found)
    except OSError as exc:
        raise CheckpointRefused(f"checkpoint directory {path}: {exc}") from None
    return DirectoryRecord(path, tuple(stamps), tensors if every and files else None, allow_foreign)


def tensor_mismatches(served: Tensors, candidate: Tensors) -> list[str]:
    """What differs between the served model's tensors and a checkpoint's, one line per kind."""
    missing = sorted(served.keys() - candidate.keys())
    extra = sorted(candidate.keys() - served.keys())
    other = [
        f"{n} ({served[n][0]} {list(served[n][1])} served, {candidate[n][0]} {list(candidate[n][1])} here)"
        for n in sorted(served.keys() & candidate.keys())
        if served[n] != candidate[n]
    ]

    def listed(verb: str, what: str, names: list[str]) -> str:
        more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
        return f"{verb} {len(names)} {what}: {', '.join(names[:SHOWN])}{more}"

    out = []
    if missing:
        out.append(listed("lacks", "of the served model's tensors", missing))
    if extra:
        out.append(listed("has", "tensor(s) the served model does not have", extra))
    if other:
        out.append(listed("has", "tensor(s) of another dtype or shape", other))
    return out


def _reference(served_root: str | None, last_path: str | None) -> tuple[DirectoryRecord | None, str, str]:
    """The served model's record (from ``served_root``, else ``last_path``), its label, or why none."""
    whys = []
    for where, label in ((served_root, "the served model's"), (last_path, "the last refit's")):
        if not where:
            continue
        config, why = reference_config(where)
        if config is None:
            whys.append(f"{label}: {why}")
            continue
        try:
            record = read_record(where)
        except CheckpointRefused as exc:
            whys.append(f"{label}: {exc}")
            continue
        if record.tensors is None:
            whys.append(f"{label} ({where}) holds weights other than *.safetensors")
            continue
        return record, f"{where} ({label})", ""
    return None, "", "; ".join(whys) or "no served model directory"


@dataclass
class CheckedTensors:
    """``router.fleet.checkpoint.check_directories``' result, plus each directory's record and how its
    tensors compared (``reference``: whose; ``note``: why they were not)."""

    checked: Checked
    records: dict[str, DirectoryRecord] = field(default_factory=dict)
    reference: str = ""
    note: str = ""

    def summary(self) -> str:
        """One line for the refit's answer and the log."""
        if self.reference:
            count = len(next(iter(self.records.values())).tensors or {}) if self.records else 0
            tensors = f"{count} tensors' names, dtypes and shapes compared with {self.reference}"
        else:
            tensors = f"tensors not compared: {self.note}"
        return f"{self.checked.summary()}; {tensors}"


def check_checkpoints(
    paths: list[str], served_root: str | None, last_path: str | None, allow_foreign: bool = False
) -> CheckedTensors:
    """``check_directories`` (files, ownership, config), then every directory's record, its tensors
    compared with the served model's: ``CheckpointRefused`` naming the tensors that differ. Blocking."""
    out = CheckedTensors(check_directories(paths, served_root, last_path, allow_foreign))
    reference, out.reference, out.note = _reference(served_root, last_path)
    for path in paths:
        record = read_record(path, allow_foreign)
        out.records[path] = record
        if reference is None or reference.tensors is None:
            continue
        if record.tensors is None:
            out.reference, out.note = "", f"{path} holds weights other than *.safetensors"
            continue
        bad = tensor_mismatches(reference.tensors, record.tensors)
        if bad:
            raise CheckpointRefused(
                f"checkpoint {path} {'; '.join(bad)} (the served model's are {out.reference}): vLLM's "
                "reload keeps its old values of a tensor it does not find, so the engines would serve a "
                "mix; save every tensor of the model, as it is served"
            )
    return out
