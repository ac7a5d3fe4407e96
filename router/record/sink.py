"""The request record's own process: builds and writes the records one router process hands it.

Started by that process's ``RecordWriter`` (``router.record.writer``) as ``python -m router.record.sink``,
one per router process (the router's, or each worker's), because building a record is most of what a
record costs (``router.record.draft``) and the router's process is the one that must not pay it. It reads
frames on stdin, each ``<u32 length><marshal of (clock offset, [item, ...])>``, an item a draft's
``__dict__`` (``draft.RecordDraft``) or a ready line (bytes); builds each line (``draft.record_line``),
appends the batch to its files (``RecordFiles``), and answers every frame on stdout with its counts
(``STATUS``: written, lost, failed writes, bytes on disk), which the writer reports. It exits at the
end of stdin: when the router closes it, or dies.

``RecordFiles``, each choice against a way the record could hurt what it records:

* Size-capped: the files take at most ``max_bytes``. The current file is rotated when the next batch
  would take it past ``max_bytes / keep_files``: renamed to ``<stem>.1.jsonl``, older ones shifted up,
  the one beyond ``keep_files - 1`` deleted; so at most ``keep_files`` files of at most a
  ``keep_files``-th each. Rotation happens between whole lines, so every file holds whole records.
* A write that fails (disk full, the directory removed) is logged once, counted (``write_errors``, and
  its records as ``lost``), and never retried in a loop; the file is cut back to its last whole line, so
  a half-written batch does not leave a broken line for the next one to follow, and the next batch tries
  again.
* Files 0600 in a 0700 directory: a record says who asked what when (hashes, not text, unless
  ``record_text``), which is nobody else's business on a shared machine.
* A restarted process (a replaced worker, a restarted sink) appends to its files, counting what they
  already hold.
"""

from __future__ import annotations

import argparse
import logging
import marshal
import os
import signal
import struct
import sys
from pathlib import Path
from typing import Any

from router.record.draft import minimal_line, record_line
from router.record.format import TEXT_SHARE

log = logging.getLogger("router.record")

NICE = 10
FRAME = struct.Struct("<I")
STATUS = struct.Struct("<QQQQ")
"""Records written, records lost (not built, or their write failed), failed writes, bytes on disk."""


class RecordFiles:
    """``<directory>/<stem>.jsonl`` and its rotations, under a size cap (module doc)."""

    def __init__(self, directory: str | os.PathLike[str], stem: str, max_bytes: int, keep_files: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if (self.directory.stat().st_mode & 0o777) != 0o700:
            os.chmod(self.directory, 0o700)
        self.stem = stem
        self.path = self.directory / f"{stem}.jsonl"
        self.keep_files = keep_files
        self.file_bytes = max(1, max_bytes // keep_files)
        self.written = 0
        self.lost = 0
        self.write_errors = 0
        self._fd: int | None = None
        self._size = 0
        self._rotated: list[int] = []  # sizes of <stem>.1.jsonl, <stem>.2.jsonl ...
        self._failing = False
        self._scan_existing()

    def bytes_on_disk(self) -> int:
        return self._size + sum(self._rotated)

    def write(self, lines: list[bytes]) -> None:
        """Append ``lines`` (each one whole record), rotating between lines as the cap says."""
        batch: list[bytes] = []
        size = 0
        for line in lines:
            if batch and self._size + size + len(line) > self.file_bytes:
                self._append(batch, size)
                batch, size = [], 0
            if not batch and self._size and self._size + len(line) > self.file_bytes:
                self._rotate()
            batch.append(line)
            size += len(line)
        if batch:
            self._append(batch, size)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _append(self, batch: list[bytes], size: int) -> None:
        data = b"".join(batch)
        before = self._size
        try:
            fd = self._open()
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
        except OSError as exc:
            self.write_errors += 1
            self.lost += len(batch)
            if not self._failing:
                self._failing = True
                log.warning(
                    "request record %s: write failed (%s); records are dropped and counted "
                    "(rl_router_record_dropped_total) until writes succeed again",
                    self.path,
                    exc,
                )
            self._cut_back(before)
            return
        self._size = before + size
        self.written += len(batch)
        if self._failing:
            self._failing = False
            log.warning("request record %s: writing again", self.path)

    def _cut_back(self, size: int) -> None:
        """After a failed write: the file back to its last whole line, and closed (reopened next time)."""
        fd = self._fd
        if fd is None:
            return
        try:
            os.ftruncate(fd, size)
        except OSError:
            pass
        self.close()
        self._size = size

    def _open(self) -> int:
        if self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.fchmod(fd, 0o600)
                self._size = os.fstat(fd).st_size
                if self._size and os.pread(fd, 1, self._size - 1) != b"\n":
                    # A line cut by a killed predecessor: it stays one bad line, the next ones whole.
                    os.write(fd, b"\n")
                    self._size += 1
            except OSError:
                os.close(fd)
                raise
            self._fd = fd
        return self._fd

    def _rotated_path(self, n: int) -> Path:
        return self.directory / f"{self.stem}.{n}.jsonl"

    def _rotate(self) -> None:
        """The current file becomes ``.1``, ``.n`` becomes ``.n+1``, the one past ``keep_files - 1`` goes."""
        self.close()
        keep = self.keep_files - 1  # rotated files kept beside the current one
        try:
            if keep == 0:
                self.path.unlink(missing_ok=True)
            else:
                self._rotated_path(keep).unlink(missing_ok=True)
                for n in range(keep - 1, 0, -1):
                    src = self._rotated_path(n)
                    if src.exists():
                        src.rename(self._rotated_path(n + 1))
                if self.path.exists():
                    self.path.rename(self._rotated_path(1))
        except OSError as exc:
            log.warning("request record %s: rotation failed (%s)", self.path, exc)
        self._rotated = [self._size, *self._rotated][:keep]
        self._size = 0

    def _scan_existing(self) -> None:
        """Count what this stem's files already hold; delete rotations beyond ``keep_files`` left by a
        run that kept more."""
        try:
            self._size = self.path.stat().st_size
        except OSError:
            self._size = 0
        keep = self.keep_files - 1
        sizes: list[int] = []
        for n in range(1, keep + 1):
            try:
                sizes.append(self._rotated_path(n).stat().st_size)
            except OSError:
                sizes.append(0)
        while sizes and sizes[-1] == 0:
            sizes.pop()
        self._rotated = sizes
        for extra in self.directory.glob(f"{self.stem}.*.jsonl"):
            number = extra.name[len(self.stem) + 1 : -len(".jsonl")]
            if number.isdigit() and int(number) > keep:
                try:
                    extra.unlink()
                except OSError:
                    pass


_LOGGED: set[str] = set()
"""The kinds of build failure logged already: each once per process, not a traceback per request (a
client that found one could otherwise fill the router's log, one request at a time)."""


def build_lines(offset: float, items: list[Any], text_limit: int | None = None) -> tuple[list[bytes], int]:
    """The lines of a frame's items, and how many could not be built at all (a bug: logged, not fatal).
    A record that cannot be built whole is written as its minimal line (``draft.minimal_line``), so that
    it is in the record still; ``text_limit``: the bytes of text a line may hold."""
    lines: list[bytes] = []
    failed = 0
    for item in items:
        if isinstance(item, bytes):
            lines.append(item)
            continue
        try:
            lines.append(record_line(item, offset, text_limit))
            continue
        except Exception as exc:
            error = exc
        try:
            lines.append(minimal_line(item, offset))
            written = "its minimal line (id, status, consumer) written instead"
        except Exception:
            failed += 1
            written = "skipped"
        kind = type(error).__name__
        if kind not in _LOGGED:
            _LOGGED.add(kind)
            log.warning(
                "request record: could not build a record (%s: %.200s); %s. Logged once: another %s is not",
                kind,
                error,
                written,
                kind,
            )
    return lines, failed


def _read_exactly(fd: int, n: int) -> bytes | None:
    parts: list[bytes] = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def serve(files: RecordFiles, stdin: int = 0, stdout: int = 1) -> None:
    """Frames from ``stdin`` until it ends; counts to ``stdout`` after each."""
    lost = 0
    while True:
        head = _read_exactly(stdin, FRAME.size)
        if head is None:
            break
        payload = _read_exactly(stdin, FRAME.unpack(head)[0])
        if payload is None:
            break
        offset, items = marshal.loads(payload)
        lines, failed = build_lines(offset, items, files.file_bytes // TEXT_SHARE)
        lost += failed
        files.write(lines)
        status = STATUS.pack(files.written, files.lost + lost, files.write_errors, files.bytes_on_disk())
        try:
            os.write(stdout, status)
        except OSError:
            pass  # the router is gone; the end of stdin follows
    files.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="the request record's process (started by the router)")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--stem", required=True)
    parser.add_argument("--max-bytes", type=int, required=True)
    parser.add_argument("--keep-files", type=int, required=True)
    args = parser.parse_args(argv)
    # Ctrl-C reaches the whole process group: the router closes this process's stdin when it stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Behind the router for a core: on a busy node it is the router that must not wait. A record needs
    # ~25 us of CPU, so even a tenth of a contended core keeps up with thousands of requests a second;
    # past that the writer's queue fills and drops are counted, as designed.
    try:
        os.nice(NICE)
    except OSError:
        pass
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(levelname)s %(message)s")
    files = RecordFiles(args.dir, args.stem, args.max_bytes, args.keep_files)
    serve(files)
    sys.exit(0)


if __name__ == "__main__":
    main()
