"""Writing job-directory files so that a reader on any node never sees half of one.

Every file is written to a temporary file that no other writer can share (``mkstemp`` in the same
directory, so the rename stays on one filesystem) and then renamed over the target. A fixed temporary
name (``.state.json.<pid>.tmp``) let two threads of one process write the same temporary file at once:
one rename then failed with ``FileNotFoundError`` and failed the job.

Files are 0600 (the job's user alone; the job directory is 0700 as well): ``state.json``, the listings and
the control files are trusted by the CLI and the driver, and at 0644 in a directory made from a group-
writable umask, members of the user's group could rewrite them (a listing naming their own engine). The
rename also replaces a symlink planted at the target instead of writing through it.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path


def write_text_atomic(path: Path, text: str, mode: int = 0o600) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: Path, payload: object) -> None:
    """Readers on other nodes must never see half a file: write aside (a unique name), then rename."""
    write_text_atomic(path, json.dumps(payload, indent=2, default=str))


def append_json_line(path: Path, record: dict[str, object]) -> None:
    """One JSON object per line, written with one ``write`` on an ``O_APPEND`` descriptor, so lines from
    different threads or processes never interleave within a line."""
    line = (json.dumps(record, default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_json(path: Path) -> dict[str, object] | None:
    """The JSON object in ``path``; None when it is missing, torn or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
