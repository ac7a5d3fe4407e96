"""Request bodies the router reads: every read has a size cap and a deadline.

Without a deadline a client that sends a head and then trickles its body holds its connection (and
whatever was read so far) for as long as it likes: with a connection cap, a handful of them lock every
real client out. Without a cap a route that reads bodies lets anyone park ``max_request_bytes`` of memory
per connection. So:

* the proxied routes read at most ``max_request_bytes`` (``read_body``), admin routes at most
  ``ADMIN_MAX_BODY_BYTES`` (``read_admin_body``): a ``Content-Length`` above the cap is refused (413)
  before a byte is read, a body without one when it passes the cap;
* either must be complete within ``HttpLimits.body_timeout_s``, else 408 and the connection is closed;
* a body no handler reads (``/health`` with a body, a request refused before its body) is drained by
  aiohttp for at most the same time (``lingering_time``, see ``router.http.app.handler_kwargs``) and
  never buffered.

The 408 answer closes the connection once sent; aiohttp still drains what the client sends meanwhile for
at most ``body_timeout_s``, so a slow body holds a connection at most twice the deadline.
"""

from __future__ import annotations

import asyncio

from aiohttp import StreamReader, web

from router.http.status import error_body

LARGE_BODY_BYTES = 256 * 1024
"""Bodies above this size are digested off the event loop (the policy's ``prepare``, the record's block
hashes), in a worker thread: hashing megabytes on the loop would stall every other request."""
ADMIN_MAX_BODY_BYTES = 1024 * 1024
"""The largest body an admin route accepts: a small JSON document (``/fleet/abort`` with ~20k request
ids fits)."""


def body_timeout(timeout_s: float) -> web.HTTPRequestTimeout:
    """The 408 for a body not received within the deadline; the connection is closed after it."""
    exc = web.HTTPRequestTimeout(
        body=error_body(f"request body not received within {timeout_s:g} s", "body_timeout", 408),
        content_type="application/json",
    )
    exc.force_close()
    return exc


def _refuse_declared_length(request: web.Request, limit: int) -> None:
    length = request.content_length
    if limit and length is not None and length > limit:
        raise web.HTTPRequestEntityTooLarge(limit, length)


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """The request body, copied at most once (not at all when it arrived in one chunk): aiohttp's
    ``Request.read`` copies every body twice (into a bytearray, then into bytes), which for Gym's
    ~40 KB conversations is two needless copies per request. 413 above ``limit``; 408 when it is not
    complete within ``timeout_s``. A body that arrived with its head (the common case) is read without
    arming a timer."""
    _refuse_declared_length(request, limit)
    payload = request.content
    if limit and hasattr(payload, "set_read_chunk_size"):
        payload.set_read_chunk_size(limit)
    if payload.is_eof():
        return await _read_capped(payload, limit)
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_capped(payload, limit)
    except TimeoutError:
        raise body_timeout(timeout_s) from None


async def _read_capped(payload: StreamReader, limit: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    while chunk := await payload.readany():
        size += len(chunk)
        if limit and size > limit:
            raise web.HTTPRequestEntityTooLarge(limit, size)
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def read_admin_body(request: web.Request, timeout_s: float) -> web.Request:
    """``request`` with its body read (at most ``ADMIN_MAX_BODY_BYTES``, within ``timeout_s``); its
    ``read()`` then returns those bytes. 413 / 408 as ``read_body``."""
    if not request.body_exists:
        return request
    _refuse_declared_length(request, ADMIN_MAX_BODY_BYTES)
    capped = request.clone(client_max_size=ADMIN_MAX_BODY_BYTES)
    try:
        async with asyncio.timeout(timeout_s):
            await capped.read()  # kept by the request
    except TimeoutError:
        raise body_timeout(timeout_s) from None
    return capped
