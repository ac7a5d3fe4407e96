"""The status-code contract with the client's retry logic, and the router's own error bodies.

NeMo-Gym 0.7.0 retries 429, 500, 502, 503, 504, 520, 404 and 408 three times, 0.5 s apart; older Gym
builds (still pinned by some NeMo-RL versions) retry 429/502/503/504/520 *forever* and 500 three times.
So, for every proxied request:

=====================================================  ===========================================
what happened upstream                                 what the client gets
=====================================================  ===========================================
backend refuses the connection, resets it, hangs       a failed attempt: retried once on a
past the timeout, sends more header bytes than the     *different* backend; if that fails too,
cap, or answers any 5xx (500, 502, 503, 504, 520, …)   **500** with the last backend's error (its
                                                       5xx body quoted) in the router's error body
backend answers 2xx, 3xx or 4xx                        that answer, unchanged, never retried
no serving backend (or none left to retry on)          409 by default (``no_healthy_backend``)
the stream breaks after its first byte                 an SSE ``error`` event (status already sent)
=====================================================  ===========================================

* 500 and never 502/503/504: 500 is in every client's *bounded* retry set, so the client retries a few
  times (landing on another engine through the router) and then fails loudly, instead of spinning
  forever on a gateway status. A backend's own 502/503/504 is rewritten for the same reason.
* "no healthy backend" gets its own status, 409 by default, which no client retries: an empty fleet is
  a condition for the launcher's health controller to fix, and a retry storm would only hide it. Any
  status some client retries (404, 408, 429 and every 5xx) is refused at construction, as is anything
  outside 4xx (a 2xx would read as success, a 3xx as a redirect). When a first attempt failed and no
  other backend is left, the failure (500) is reported, not the empty fleet.
"""

from __future__ import annotations

import orjson

BACKEND_FAILURE_STATUS = 500
DEFAULT_NO_HEALTHY_BACKEND_STATUS = 409
# Statuses some client version retries (boundedly or forever): never usable for "no healthy backend".
CLIENT_RETRIED_STATUSES = frozenset({404, 408, 429, 500, 502, 503, 504, 520})


def validate_no_healthy_status(status: int) -> int:
    """Return ``status`` if it is a 4xx that no client retries; raise ``ValueError`` naming it otherwise."""
    if not isinstance(status, int) or isinstance(status, bool):
        raise ValueError(f"no_healthy_backend_status must be an integer, got {status!r}")
    if status in CLIENT_RETRIED_STATUSES:
        raise ValueError(
            f"no_healthy_backend_status={status} is retried by clients (Gym retries 404, 408, 429, 500, 502, "
            "503, 504 and 520; some versions forever); use a 4xx outside that set, e.g. 409"
        )
    if not 400 <= status < 500:  # also every other 5xx: a server error reads as one the client may retry
        raise ValueError(f"no_healthy_backend_status={status} must be a 4xx client error (e.g. 409)")
    return status


def error_body(message: str, kind: str, status: int) -> bytes:
    """An OpenAI-style error object, so clients that parse ``error.message`` show the router's reason."""
    return orjson.dumps({"error": {"message": message, "type": kind, "code": status}, "router": True})


def sse_error_event(message: str, kind: str) -> bytes:
    """The event that ends a stream broken after its first byte: a named ``error`` event, then the
    ``data: {"error": ...}`` line that OpenAI-compatible streaming clients already check for."""
    payload = orjson.dumps({"error": {"message": message, "type": kind, "code": BACKEND_FAILURE_STATUS}})
    return b"event: error\ndata: " + payload + b"\n\n"
