"""A lean HTTP/1.1 keep-alive client for the router's upstream side (engines).

Why not aiohttp's ``ClientSession`` here: on the proxy's hot path it costs more CPU per request than the
whole rest of the router (request objects, cookie jars, redirect and auth machinery, URL objects), and
on a 2-core head node that decides whether the router keeps up with 64 concurrent rollout workers. The
engines speak plain HTTP/1.1 on a private network, so a small client suffices: one pipelined-free
connection per in-flight request, an unlimited pool of idle connections per backend, request line,
headers and body written in one ``write``, responses parsed by ``httptools`` (llhttp, the parser Node.js
and uvicorn use) with chunked bodies decoded and everything else passed through untouched.

Failure shapes are reported as the kinds the status contract needs: ``connect`` (refused, no route,
connect timeout), ``reset`` (the connection broke, or the answer was not HTTP), ``timeout`` (the total
deadline passed, e.g. a wedged engine that accepts and never answers), ``headers_too_large`` (status line
and headers beyond ``max_header_bytes``: not buffered further, since a backend could otherwise make the
router hold hundreds of MB). Interim ``1xx`` responses (``100 Continue``, ``103 Early Hints``) are skipped:
only the final response is ever handed to the caller, because a relayed 100 would reach the client as
the answer and leave it waiting forever. A ``101`` (the router never asks for an upgrade) is a failure.
A reused idle connection that turns out to be closed by the server before any response byte is retried
once on a fresh connection: that is the pool's staleness, not the backend's failure.

Streaming bodies are delivered chunk by chunk with flow control: reading from the engine pauses while
more than ``HIGH_WATER`` bytes wait for a slow client.

A response ends where its framing says (``Content-Length``, the last chunk, or no body at all for a 204,
304 or 1xx). A byte beyond that end, in the same read or arriving later while the connection waits in
the pool, closes the connection: it is never reused, and the byte is never parsed as the answer to the
next request on it. Before, those bytes were parsed as a further response: appended to the body the
current client got (a 204 was even answered with them), or, arriving just after the pool handed the
connection to the next request, given to that request's client as its answer. What HTTP/1.1 cannot tell
apart remains: bytes a backend sends after the router wrote the next request are that request's answer.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
from collections.abc import AsyncIterator, Iterable
from urllib.parse import urlsplit

import httptools

log = logging.getLogger(__name__)

HIGH_WATER = 1 << 20
LOW_WATER = 1 << 18


class _Overrun(Exception):
    """Raised from the parser's callback when bytes follow the end of the final response."""


class UpstreamError(Exception):
    """A backend attempt failed. ``kind`` is ``connect``, ``reset`` or ``timeout``; ``started`` tells
    whether any response byte had arrived (after that, the attempt cannot be repeated silently)."""

    def __init__(self, kind: str, detail: str, started: bool = False) -> None:
        super().__init__(detail)
        self.kind = kind
        self.started = started


# Status line and headers of one backend answer, interim 1xx included, above which the attempt fails.
DEFAULT_MAX_HEADER_BYTES = 64 * 1024


class _Connection(asyncio.Protocol):
    """One TCP connection to a backend, carrying one request at a time."""

    def __init__(
        self, pool_key: tuple[str, int], loop: asyncio.AbstractEventLoop, max_header_bytes: int
    ) -> None:
        self.key = pool_key
        self.loop = loop
        self.max_header_bytes = max_header_bytes
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self._reset_exchange()

    # -- per-exchange state -------------------------------------------------------------------------------
    def _reset_exchange(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done: asyncio.Future[None] = self.loop.create_future()
        self.body: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.error: UpstreamError | None = None
        self.got_bytes = False
        self.body_waiter: asyncio.Future[None] | None = None
        self.paused = False
        self.head_bytes = 0
        self.interim = False

    def new_exchange(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self._reset_exchange()

    # -- asyncio.Protocol --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.complete:  # the answer ended: nothing more may come until the next request is written
            self._overrun(len(data))
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # after a 101 head (already failed in on_headers_complete)
            self.abort()
            return
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _Overrun):  # bytes after the final response in this read
                self._overrun(None)
                return
            self._fail(UpstreamError("reset", f"malformed response: {exc}", started=True))
            self.abort()
            return
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError("reset", f"malformed response: {exc}", started=True))
            self.abort()
            return
        if not self.headers_done.done():
            # Counted after feeding: the parser holds at most one read's worth beyond the cap.
            self.head_bytes += len(data)
            if self.head_bytes > self.max_header_bytes:
                self._fail(
                    UpstreamError(
                        "headers_too_large",
                        f"backend response head exceeds {self.max_header_bytes} bytes",
                        started=True,
                    )
                )
                self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.complete:
            return
        if self.headers_done.done() and not self._framed():
            # A body delimited by the connection's end (no length, not chunked): EOF ends the message.
            self.on_message_complete()
            return
        self._fail(UpstreamError("reset", f"connection closed by backend ({exc or 'EOF'})", self.got_bytes))

    def pause_writing(self) -> None:  # pragma: no cover - request bodies are small next to socket buffers
        pass

    def resume_writing(self) -> None:  # pragma: no cover
        pass

    def _overrun(self, extra: int | None) -> None:
        """Bytes beyond the final response: the exchange stays as it was (complete), the connection is
        closed so that no later request reads them."""
        host, port = self.key
        more = "" if extra is None else f" ({extra} bytes)"
        log.warning(
            "backend %s:%d sent bytes after a complete response%s: connection closed", host, port, more
        )
        self.abort()

    # -- httptools callbacks -----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:
            raise _Overrun  # stops the parser: what follows is not this exchange's

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status == 101:  # the parser stops after this head; the request never asked for it
            self._fail(UpstreamError("reset", "backend switched protocols (101) unasked", started=True))
            return
        if 100 <= self.status < 200:
            # An interim response: forget it and wait for the final one on the same connection.
            self.interim = True
            self.headers = []
            return
        # Read now: llhttp resets its flags once the message completes, and would then say "close".
        self.keep_alive = self.parser.should_keep_alive()
        if not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True
        if not self.headers_done.done():
            self.headers_done.set_result(None)
        self._wake()

    # -- helpers -----------------------------------------------------------------------------------
    def _framed(self) -> bool:
        for name, value in self.headers:
            lower = name.lower()
            if lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower()):
                return True
        return False

    def _wake(self) -> None:
        waiter = self.body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        if not self.headers_done.done():
            self.headers_done.set_exception(error)
            self.headers_done.exception()  # mark retrieved: the waiter may already be gone
        self._wake()

    def fail_timeout(self, detail: str) -> None:
        self._fail(UpstreamError("timeout", detail, self.got_bytes))
        self.abort()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and self.error is None

    async def next_chunk(self) -> bytes | None:
        """The next piece of body, ``None`` at the end; raises ``UpstreamError`` if the body breaks."""
        while True:
            if self.body:
                chunk = self.body.popleft()
                self.buffered -= len(chunk)
                if self.paused and self.buffered < LOW_WATER and self.transport is not None:
                    self.paused = False
                    self.transport.resume_reading()
                return chunk
            if self.error is not None:
                raise self.error
            if self.complete:
                return None
            self.body_waiter = self.loop.create_future()
            await self.body_waiter
            self.body_waiter = None


class UpstreamResponse:
    """Status and raw headers of a backend's answer, and its body (whole or chunk by chunk)."""

    def __init__(self, pool: UpstreamPool, conn: _Connection, timer: asyncio.TimerHandle) -> None:
        self._pool = pool
        self._conn = conn
        self._timer = timer
        self.status = conn.status
        self.raw_headers = conn.headers
        self._released = False

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.raw_headers:
            if key.lower() == name:
                return value
        return None

    @property
    def content_length(self) -> int | None:
        value = self.header(b"content-length")
        return int(value) if value is not None and value.strip().isdigit() else None

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self._conn.next_chunk()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    async def read_at_most(self, limit: int) -> bytes:
        """Up to ``limit`` bytes of the body (an error page to quote); stops early, leaving the exchange
        incomplete (``release`` then closes the connection), and returns what arrived if it breaks."""
        parts: list[bytes] = []
        size = 0
        try:
            while size < limit and (chunk := await self._conn.next_chunk()) is not None:
                parts.append(chunk)
                size += len(chunk)
        except UpstreamError:
            pass
        return b"".join(parts)[:limit]

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        while (chunk := await self._conn.next_chunk()) is not None:
            yield chunk

    def release(self) -> None:
        """Return the connection to the pool if the exchange completed cleanly, else close it."""
        if self._released:
            return
        self._released = True
        self._timer.cancel()
        self._pool._give_back(self._conn)


class UpstreamPool:
    """Keep-alive connections per backend origin, without any cap (see ``Forwarder``)."""

    def __init__(
        self,
        connect_timeout_s: float,
        total_timeout_s: float,
        max_idle_per_backend: int = 1024,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.total_timeout_s = total_timeout_s
        self.max_header_bytes = max_header_bytes
        self.max_idle_per_backend = max_idle_per_backend
        self._idle: dict[tuple[str, int], collections.deque[_Connection]] = {}
        self._origins: dict[str, tuple[str, int, bytes]] = {}
        self._busy: set[_Connection] = set()

    def _origin(self, base_url: str) -> tuple[str, int, bytes]:
        origin = self._origins.get(base_url)
        if origin is None:
            parts = urlsplit(base_url)
            if parts.scheme != "http":
                raise UpstreamError("connect", f"{base_url}: only http:// backends are supported upstream")
            host, port = parts.hostname or "", parts.port or 80
            origin = (host, port, f"{host}:{port}".encode())
            self._origins[base_url] = origin
        return origin

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        cap = self.max_header_bytes
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                transport, conn = await loop.create_connection(
                    lambda: _Connection(key, loop, cap), key[0], key[1]
                )
        except TimeoutError as exc:
            raise UpstreamError("connect", f"connect to {key[0]}:{key[1]} timed out") from exc
        except OSError as exc:
            raise UpstreamError(
                "connect", f"cannot connect to {key[0]}:{key[1]}: {exc.strerror or exc}"
            ) from exc
        conn.transport = transport  # uvloop may call connection_made after create_connection returns
        return conn

    def _take_idle(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    def _give_back(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        if conn.reusable():
            idle = self._idle.setdefault(conn.key, collections.deque())
            if len(idle) < self.max_idle_per_backend:
                idle.append(conn)
                return
        conn.abort()

    async def request(
        self,
        base_url: str,
        method: str,
        path_qs: str,
        headers: Iterable[tuple[bytes, bytes]],
        body: bytes,
    ) -> UpstreamResponse:
        """Send one request; return once the status line and headers arrived (body still to read).

        The total deadline (``total_timeout_s``) covers the whole exchange, body included: when it passes,
        the connection is aborted and any pending read raises ``UpstreamError("timeout")``.
        """
        host, port, host_header = self._origin(base_url)
        key = (host, port)
        head = [f"{method} {path_qs} HTTP/1.1\r\n".encode("latin-1"), b"Host: ", host_header, b"\r\n"]
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        if body or method in ("POST", "PUT", "PATCH"):
            head += (b"Content-Length: ", str(len(body)).encode(), b"\r\n")
        head.append(b"\r\n")
        # Head and body go out in one vectored write: joining them would copy the whole body.
        payload = (b"".join(head), body)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.total_timeout_s
        for fresh in (False, True):
            conn = None if fresh else self._take_idle(key)
            reused = conn is not None
            if conn is None:
                if loop.time() >= deadline:
                    raise UpstreamError("timeout", f"{base_url} did not answer in time")
                conn = await self._connect(key)
            else:
                conn.max_header_bytes = self.max_header_bytes
                conn.new_exchange()
            self._busy.add(conn)
            timer = loop.call_at(deadline, conn.fail_timeout, f"{base_url} did not answer in time")
            assert conn.transport is not None
            conn.transport.writelines(payload)
            try:
                await conn.headers_done
            except UpstreamError as exc:
                timer.cancel()
                self._busy.discard(conn)
                conn.abort()
                if reused and exc.kind == "reset" and not exc.started:
                    continue  # the pool's stale connection, not the backend's fault: once more, fresh
                raise
            except BaseException:
                timer.cancel()
                self._busy.discard(conn)
                conn.abort()
                raise
            return UpstreamResponse(self, conn, timer)
        raise AssertionError("unreachable")  # pragma: no cover

    async def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()
        for conn in list(self._busy):
            conn.abort()
        self._busy.clear()
