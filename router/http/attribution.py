"""Whose failure a failed attempt is: the engine's, or the request's own ("health judges engines, not
requests").

Why it matters: the router's per-engine outcomes are what the fleet controller judges (an engine whose
window holds >= 3 failures and >= 50 % of its attempts is condemned and restarted) and, for a transport
failure, what takes a health-managed engine out of rotation at once. A request that fails wherever it
goes (one no engine can parse, one that outlives the backend timeout) used to be charged to every engine
it met: a dozen of them from one plain consumer restarted the whole fleet, and the restarted engines came
back STALE. So an attempt's failure is charged to its engine only where the engine is the likelier cause:

* The transport broke (``connect``, ``reset``, ``headers_too_large``, a stream cut after its head): the
  engine's, charged at once. A request cannot make an engine refuse connections.
* A 5xx, or a timeout before the answer's head: *held* until the request's next attempt answers. Another
  engine answered it below 400: the held failure was its engine's, charged then. The next engine failed it
  too (5xx or timeout): the request is **poisoned**, charged to no engine and counted against its
  consumer (``rl_router_consumer_poisoned_total``). The next engine answered 4xx (the request is bad, and
  only the first engine crashed on it), or no next attempt could be made (no other engine left, the
  client went away): not charged either. One engine alone cannot tell a bad request from a bad engine,
  and charging it would let one consumer restart the last serving engine (or a canary) at will; such an
  engine is still judged by its ``/health`` probes, and by every request another engine serves. A router
  configured for no second opinion (``max_attempts: 1``, or a timeout with ``retry_on_timeout`` off)
  charges such a failure at once, as it always did: it chose to judge by one engine's answer (a
  standalone router's passive ejection of an engine that fails every request while ``/health`` passes
  rests on it).
* A 5xx whose error body the engine attributes to the input (``input_attributed``), or a request
  carrying a malformed header (``malformed_headers``): the request's, never charged. Still retried: the
  status contract stays (5xx -> one retry elsewhere -> 500).
* A stream that outlives the backend timeout after its head: the request's length, not the engine's
  failure (the engine was answering), not charged.

Everything here is pure and per request: the forwarder asks, the routing state is told only what to
charge, so one process and worker processes (whose failures reach the routing state over the decision
channel) follow the same rule.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from http import HTTPStatus

import orjson

from router.http.upstream import UpstreamError

HELD_KINDS = frozenset({"status", "timeout"})
"""Failure kinds that may follow the request (a 5xx, a timeout before the head): held, not charged."""

# vLLM 0.32 (vllm/entrypoints/serve/exception_handling/error_response.py) names a client error by one of
# these types, or by the phrase of a 4xx status (FastAPI's HTTPException: "Bad Request", ...), with the
# status as ``code``; the older ``{"object": "error", "type": ..., "code": ...}`` shape says the same.
CLIENT_ERROR_TYPES = frozenset(
    {"BadRequestError", "UnprocessableEntityError", "NotFoundError", "NotImplementedError"}
    | {s.phrase for s in HTTPStatus if 400 <= s.value < 500}
)
# The head of an error body that is read to attribute it (the quoted part, at most).
_MAX_ATTRIBUTED_BYTES = 64 * 1024
# Anything in a header value but tab and printable ASCII.
_NOT_PRINTABLE = re.compile(rb"[^\t\x20-\x7e]")


class InputFailure(UpstreamError):
    """A 5xx attempt whose error body says the input was at fault (kind ``status``, as any 5xx)."""


def input_attributed(status: int, body: bytes) -> bool:
    """Whether a 5xx answer blames the request: 501 (the request asks for what the engine does not
    implement: vLLM's ``NotImplementedError``), or an OpenAI-style error body whose ``type`` is a client
    error's or whose ``code`` is a 4xx. A body that is not such JSON (cut, HTML, empty) blames nobody."""
    if status == 501:
        return True
    if not body or len(body) > _MAX_ATTRIBUTED_BYTES or body[:1] != b"{":
        return False
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(data, dict):
        return False
    error = data.get("error")
    info = error if isinstance(error, dict) else data if data.get("object") == "error" else None
    if info is None:
        return False
    kind, code = info.get("type"), info.get("code")
    if isinstance(kind, str) and kind in CLIENT_ERROR_TYPES:
        return True
    return type(code) is int and 400 <= code < 500


def malformed_headers(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a forwarded header value holds anything but tab and printable ASCII (obs-text, control
    bytes): an engine that chokes on it fails the request, not its own health."""
    return any(_NOT_PRINTABLE.search(value) is not None for _name, value in headers)


class Blame:
    """One request's failed attempts, as far as engine health goes (module doc). The forwarder tells it
    each failure and the head of each answer; it says what to charge, and whether the request ended
    poisoned."""

    __slots__ = ("_attributed", "_held")

    def __init__(self) -> None:
        self._held: list[tuple[str, str]] = []
        self._attributed = False

    def failed(self, url: str, kind: str, attributed: bool, retried: bool = True) -> bool:
        """An attempt on ``url`` failed with ``kind``; True when it is charged to ``url`` now (the
        transport's failures). ``attributed``: the engine's answer, or the request's headers, put it on
        the request. ``retried``: whether the router's settings allow another attempt after this one (not
        whether an engine is left for it); a first failure with none is charged at once (module doc)."""
        if attributed:
            self._attributed = True
            return False
        if kind in HELD_KINDS and (retried or self._held):
            self._held.append((url, kind))
            return False
        return True

    def answered(self, status: int) -> list[tuple[str, str]]:
        """An engine answered the request's head with ``status`` (below 500): the held failures to charge
        now, ``(url, kind)`` each. Below 400 another engine served what they failed: theirs. A 4xx says
        the request was bad: nobody's."""
        held, self._held = self._held, []
        return held if status < 400 else []

    def poisoned(self) -> bool:
        """Whether a request no engine answered failed because of itself: on two engines (5xx or
        timeout), or by the engines' own word (``input_attributed``), or with a malformed header."""
        return self._attributed or len(self._held) >= 2
