"""The headers that cross the proxy, and the router's own: what is dropped each way, the request id.

Apart from the forwarder so that both directions (the request's headers in ``router.http.forwarding``,
the answer's in ``router.http.relay``) and the worker processes (``router.multiprocess.workers`` drops
the same hop-by-hop set) read one list, and the request id's rule is stated once:

* Hop-by-hop headers (RFC 9110 §7.6.1, plus those named in ``Connection``) are dropped both ways, and so
  is ``Expect``: the router itself answers ``100-continue``.
* The router's own headers on an answer (``VERSION_HEADER``, ``ROUTER_REQUEST_ID_HEADER``) are the
  router's: an engine's would otherwise pass for them.
* A client's ``X-Request-Id`` is used only when it is one value of at most ``MAX_REQUEST_ID_CHARS``
  printable ASCII characters; any other is replaced by the router's own and not forwarded.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from router.state.versions import REQUEST_ID_HEADER, ROUTER_REQUEST_ID_HEADER, VERSION_HEADER

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Recomputed for the upstream request (Host from the backend URL, length from the body); Expect is the
# router's own business (see module doc).
REQUEST_DROP = HOP_BY_HOP | {b"host", b"content-length", b"expect"}
# Content-Length is set from the bytes actually relayed; the router's own headers are the router's (an
# engine's would otherwise pass for them).
RESPONSE_DROP = HOP_BY_HOP | {
    b"content-length",
    VERSION_HEADER.encode(),
    ROUTER_REQUEST_ID_HEADER.encode(),
}
# A client's X-Request-Id longer than this (or not printable ASCII) is replaced by the router's own.
MAX_REQUEST_ID_CHARS = 128
REQUEST_ID = REQUEST_ID_HEADER.encode()


def filter_raw_headers(
    raw: Iterable[tuple[bytes, bytes]], drop: frozenset[bytes]
) -> list[tuple[bytes, bytes]]:
    """Copy raw headers without hop-by-hop ones and without any header that ``Connection`` names."""
    raw = list(raw)
    extra: set[bytes] = set()
    for name, value in raw:
        if name.lower() == b"connection":
            extra.update(token.strip().lower() for token in value.split(b","))
    return [(n, v) for n, v in raw if (low := n.lower()) not in drop and low not in extra]


def new_request_id() -> str:
    """16 hex digits of randomness (a short uuid4; ``uuid.uuid4().hex`` costs five times as much)."""
    return os.urandom(8).hex()


def valid_request_id(value: str) -> bool:
    """Whether a client's ``X-Request-Id`` (as aiohttp decoded it: UTF-8, undecodable bytes escaped) is
    one the router keeps and forwards: 1 to ``MAX_REQUEST_ID_CHARS`` printable ASCII characters."""
    return 0 < len(value) <= MAX_REQUEST_ID_CHARS and value.isascii() and value.isprintable()


def request_id_of(headers: Any) -> str | None:
    """The client's request id when it sent exactly one valid one, else None (none sent, or one to
    replace: see ``valid_request_id``; two ids would let the engine and the router disagree)."""
    given = headers.getall(REQUEST_ID_HEADER, ())
    if len(given) == 1 and valid_request_id(given[0]):
        return given[0]  # type: ignore[no-any-return]
    return None


def header_safe(value: str) -> str:
    """``value`` as a header value: a version with control or non-ASCII characters is percent-encoded
    (a stamp is any string; a CR or LF in a header would fail every answer)."""
    if value.isascii() and value.isprintable():
        return value
    from urllib.parse import quote

    return quote(value, safe="", errors="surrogateescape")
