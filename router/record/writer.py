"""``RecordWriter``: a router process's request record, written off the request path.

Choices, each against a way a record could hurt what it records:

* The request path only appends the request's draft (``router.record.draft``) to a bounded queue
  (``submit``: a length check and a ``deque.append``; no lock, no I/O, no serialization). A thread sends
  them in batches (each draft its ``__dict__``, the whole batch one ``marshal`` call), every
  ``FLUSH_INTERVAL_S`` (and early when the queue is half full), to the record's own process
  (``router.record.sink``), which builds the records and writes them: built in the router's process, a
  record cost a fifth of what proxying its request does (valgrind: +145k instructions on 567k per
  request, bench/proxy_bench.py's small requests), and a thread there takes that from the router (one
  core, one GIL); sent, it costs ~5%. So a record is on disk within about half a second, and neither a
  slow disk nor the records' CPU holds an answer back.
* A full queue drops the record and counts it (``dropped``, ``rl_router_record_dropped_total``) instead
  of blocking the request; so does a record the sink could not write (its failed writes are counted in
  ``write_errors`` and logged once, by the sink). Drafts that carry text (``record_text``) are bounded
  by bytes too (``QUEUE_TEXT_BYTES``): a burst of 60 MB prompts must not pile up behind a slow disk.
* One sink per router process, each with its own file (``process_tag``: ``requests.jsonl`` for the
  router's process, ``requests-w<k>.jsonl`` for worker process k): no two processes append to one file.
  A sink that dies is started again for the next batch (the batch it held is counted as dropped), at
  most ``MAX_RESTARTS`` times; it exits by itself when its router process dies (the end of its stdin).
* The directory is made (0700) in the constructor, so one that cannot be made fails the router's
  construction, naming it; the sink and its thread start with the first record.
* ``close`` sends what is queued, ends the sink's input and waits for it, within ``CLOSE_TIMEOUT_S``;
  the router's shutdown (and each worker's) calls it through ``Forwarder.close``.
"""

from __future__ import annotations

import logging
import marshal
import os
import select
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from router.record.draft import RecordDraft
from router.record.format import RECORD_FILE, RequestRecord
from router.record.sink import FRAME, STATUS

if TYPE_CHECKING:
    from router.config import RouterConfig

log = logging.getLogger(__name__)

QUEUE_RECORDS = 4096
"""Drafts waiting for the thread at most: ~1 s of a busy router; each holds at most the answer's last
16 KB and the body's ends (4 KB), so a full queue is at most ~80 MB."""
QUEUE_TEXT_BYTES = 64 * 1024 * 1024
FLUSH_INTERVAL_S = 0.25
CLOSE_TIMEOUT_S = 3.0
BATCH_RECORDS = 2048

MAX_RESTARTS = 10


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class RecordWriter:
    """Records of one router process, to ``<directory>/requests[-<process_tag>].jsonl`` (module doc)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_bytes: int,
        keep_files: int,
        process_tag: str | None = None,
        queue_records: int | None = None,
        flush_interval_s: float | None = None,
    ) -> None:
        """``max_bytes``: what this process's files take at most, over ``keep_files`` files.
        ``queue_records`` / ``flush_interval_s``: the module's defaults unless given (tests)."""
        if keep_files < 1:
            raise ValueError(f"record keep_files must be >= 1, got {keep_files}")
        if max_bytes < 1:
            raise ValueError(f"record max_bytes must be >= 1, got {max_bytes}")
        self.directory = Path(directory)
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if (self.directory.stat().st_mode & 0o777) != 0o700:
                os.chmod(self.directory, 0o700)
        except OSError as exc:
            raise ValueError(f"cannot use {self.directory} as the request record directory: {exc}") from None
        stem = RECORD_FILE.removesuffix(".jsonl")
        self.stem = f"{stem}-{process_tag}" if process_tag else stem
        self.path = self.directory / f"{self.stem}.jsonl"
        self.max_bytes = max_bytes
        self.keep_files = keep_files
        self._capacity = queue_records if queue_records is not None else QUEUE_RECORDS
        self._half = max(1, self._capacity // 2)
        self._interval = flush_interval_s if flush_interval_s is not None else FLUSH_INTERVAL_S
        # Each counter is written by one thread only (no lock): the request path's, or the writer's.
        self._refused = 0  # request path: queue full, or closed
        self._text_in = 0  # request path: text bytes queued
        self._text_out = 0  # writer thread: text bytes taken off the queue
        self._lost = 0  # writer thread: records of batches the sink never took
        self._sink_status = (0, 0, 0, 0)  # writer thread: the sink's last counts (written, lost, ...)
        self._sink_base = (0, 0, 0)  # counts of sinks that died before this one
        self._pending: deque[Any] = deque()  # drafts, or lines (bytes)
        self._sink: subprocess.Popen[bytes] | None = None
        self._status_buf = b""
        self._restarts = 0
        self._gave_up = False
        self._closed = False
        self._stop = False
        self._wake = threading.Event()
        self._close_by = 0.0  # set by close: when the sink must have exited
        # Started by the first submit: a router that fails to start after this leaves nothing behind.
        self._thread: threading.Thread | None = None

    @classmethod
    def of(cls, config: RouterConfig, worker: int | None = None) -> RecordWriter | None:
        """The writer of the router's process (``worker`` None) or of worker process ``worker``; None
        when the record is off. With worker processes each process may take ``record_max_bytes /
        workers`` (the router's process proxies nothing then: its workers accept every connection), so
        the directory stays under ``record_max_bytes``."""
        if config.record_dir is None:
            return None
        return cls(
            config.record_dir,
            max_bytes=config.record_max_bytes // max(config.workers, 1),
            keep_files=config.record_keep_files,
            process_tag=None if worker is None else f"w{worker}",
        )

    # -- the request path ---------------------------------------------------------------------------------
    def submit(self, item: Any, text_bytes: int = 0) -> bool:
        """Queue a ``RecordDraft`` (or a ``RequestRecord``, or a line) to be written; never blocks. False
        (and counted in ``dropped``) when the queue is full or the writer closed. ``text_bytes``: bytes of
        text a draft holds until written (``RecordDraft.text_bytes``), bounded by ``QUEUE_TEXT_BYTES``."""
        pending = self._pending
        if (
            self._closed
            or len(pending) >= self._capacity
            or (text_bytes and self._text_in - self._text_out + text_bytes > QUEUE_TEXT_BYTES)
        ):
            self._refused += 1
            return False
        if text_bytes:
            self._text_in += text_bytes
        elif type(item) is RequestRecord:
            item = item.line()
        pending.append(item)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"record-{self.stem}", daemon=True)
            self._thread.start()
        elif len(pending) == self._half:
            self._wake.set()  # a burst: send now rather than at the next tick
        return True

    # -- counts (rl_router_record_*) ------------------------------------------------------------------------
    @property
    def written(self) -> int:
        return self._sink_base[0] + self._sink_status[0]

    @property
    def dropped(self) -> int:
        """Records not written: refused by a full queue (or a closed writer), or lost on the way or in
        a failed write."""
        return self._refused + self._lost + self._sink_base[1] + self._sink_status[1]

    @property
    def write_errors(self) -> int:
        return self._sink_base[2] + self._sink_status[2]

    @property
    def queued(self) -> int:
        return len(self._pending)

    def bytes_on_disk(self) -> int:
        """Bytes of this process's files, as its sink last counted them."""
        return self._sink_status[3]

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Write what is queued and stop, within ``timeout_s``; idempotent. Later submits are dropped."""
        if self._closed:
            return
        self._closed = True
        self._stop = True
        self._wake.set()
        thread = self._thread
        if thread is None:
            return
        self._close_by = time.monotonic() + timeout_s
        thread.join(timeout_s + 0.5)
        if thread.is_alive():
            log.warning(
                "request record %s: %d record(s) still queued after %.3g s at shutdown; not waiting longer",
                self.path,
                len(self._pending),
                timeout_s,
            )
            sink = self._sink
            if sink is not None:
                sink.kill()

    # -- the writer's thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                self._wake.wait(self._interval)
                self._wake.clear()
                self._send()
                self._read_status()  # the counts of the last batch, answered since
            self._send()
        finally:
            self._end_sink()

    def _send(self) -> None:
        pending = self._pending
        popleft = pending.popleft
        while pending:
            batch = [popleft() for _ in range(min(len(pending), BATCH_RECORDS))]
            if self._text_in != self._text_out:
                self._text_out += sum(x.text_bytes() for x in batch if type(x) is RecordDraft)
            # A draft goes as its __dict__ (only what the request set), a line as it is.
            items = [getattr(x, "__dict__", x) for x in batch]
            offset = time.time() - time.perf_counter()
            try:
                payload = marshal.dumps((offset, items))
            except ValueError:  # a value marshal cannot send (a str subclass...): send the others
                items = self._sendable(items)
                payload = marshal.dumps((offset, items))
            self._deliver(payload, len(items))

    def _sendable(self, items: list[Any]) -> list[Any]:
        kept = []
        for item in items:
            try:
                marshal.dumps(item)
            except ValueError:
                self._lost += 1
                log.warning("request record %s: a record held a value it cannot send; dropped", self.path)
                continue
            kept.append(item)
        return kept

    def _deliver(self, payload: bytes, n: int) -> None:
        sink = self._ensure_sink()
        if sink is None:
            self._lost += n
            return
        assert sink.stdin is not None
        try:
            fd = sink.stdin.fileno()
            _write_all(fd, FRAME.pack(len(payload)))
            _write_all(fd, payload)  # straight to the pipe: no copy into a buffer first
        except (BrokenPipeError, OSError, ValueError):
            self._lost += n
            self._sink_died()
            return
        self._read_status()

    def _ensure_sink(self) -> subprocess.Popen[bytes] | None:
        if self._sink is not None or self._gave_up:
            return self._sink
        # The directory that holds the router package (record/ -> router/ -> it), so the sink process
        # imports this very copy of router/ whatever its working directory.
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path}
        try:
            self._sink = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "router.record.sink",
                    "--dir",
                    str(self.directory),
                    "--stem",
                    self.stem,
                    "--max-bytes",
                    str(self.max_bytes),
                    "--keep-files",
                    str(self.keep_files),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                bufsize=0,
                env=env,
                close_fds=True,
            )
        except OSError as exc:
            self._gave_up = True
            log.warning("request record %s: cannot start its process (%s); records dropped", self.path, exc)
            return None
        assert self._sink.stdout is not None
        os.set_blocking(self._sink.stdout.fileno(), False)
        self._status_buf = b""
        return self._sink

    def _read_status(self) -> None:
        """The sink's latest counts, from what it has answered so far (without waiting)."""
        sink = self._sink
        if sink is None or sink.stdout is None:
            return
        try:
            chunk = os.read(sink.stdout.fileno(), 1 << 16)
        except OSError:  # BlockingIOError: nothing new yet
            return
        buf = self._status_buf + chunk
        whole = len(buf) - len(buf) % STATUS.size
        if whole:
            self._sink_status = STATUS.unpack_from(buf, whole - STATUS.size)
        self._status_buf = buf[whole:]

    def _sink_died(self) -> None:
        sink, self._sink = self._sink, None
        if sink is None:
            return
        code = sink.poll()
        if code is None:
            sink.kill()
            code = sink.wait()
        w, lost, errors, _ = self._sink_status
        self._sink_base = (self._sink_base[0] + w, self._sink_base[1] + lost, self._sink_base[2] + errors)
        self._sink_status = (0, 0, 0, self._sink_status[3])
        self._restarts += 1
        if self._restarts > MAX_RESTARTS:
            self._gave_up = True
            log.warning("request record %s: its process exited (%s), too often: dropping", self.path, code)
        else:
            log.warning("request record %s: its process exited (%s); starting another", self.path, code)

    def _end_sink(self) -> None:
        """The end of the sink's input, then its last counts and its exit, within what ``close`` allows
        (its counts are read until its stdout ends, so it never blocks on them while it is waited for)."""
        sink = self._sink
        if sink is None:
            return
        assert sink.stdin is not None and sink.stdout is not None
        try:
            sink.stdin.close()
        except OSError:
            pass
        fd = sink.stdout.fileno()
        while (left := self._close_by - time.monotonic()) > 0:
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                break
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                break
            if not chunk:
                break
            buf = self._status_buf + chunk
            whole = len(buf) - len(buf) % STATUS.size
            if whole:
                self._sink_status = STATUS.unpack_from(buf, whole - STATUS.size)
            self._status_buf = buf[whole:]
        try:
            sink.wait(max(0.1, self._close_by - time.monotonic()))
        except subprocess.TimeoutExpired:
            sink.kill()
            sink.wait()
        sink.stdout.close()
