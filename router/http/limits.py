"""The router's HTTP resource limits, in one frozen value, and the process's open-file limit.

Each limit closes a way for one misbehaving peer to take the router (and so every rollout) down:

* ``head_timeout_s``: a client connection whose request head is not complete this long after its first
  byte (or after the connection opened) is closed. Without it, a few hundred half-open connections
  (slowloris) are held forever and, at the open-file limit, real requests fail.
* ``keepalive_timeout_s``: an idle kept-alive client connection is closed after this long. Longer than
  the clients' own idle timeout (aiohttp's client keeps 15 s), so the client, not the router, closes
  first and never sends a request on a connection the router is just closing.
* ``max_client_connections``: client connections above this are closed on accept, so a flood cannot use
  up the descriptors the router needs for its upstream connections. The effective cap is also bounded
  by the open-file limit (see ``effective_connection_cap``): each proxied request holds two descriptors.
* ``max_backend_header_bytes``: a backend whose status line and headers exceed this is a failed attempt
  (answered 500 after the retry); the headers are not buffered past it (a 200 MB header would otherwise
  sit in the router's memory).
* ``max_error_body_bytes``: how much of a backend's 5xx body is kept to quote in the router's 500.
* ``max_connections_per_consumer`` (0: the consumer's weighted share of this process's connection cap,
  the owner counting as weight 1): client connections one consumer may hold in one process, counted
  from its first authenticated request on each; a request on one more is refused (the no-healthy
  status) and that connection closed. The cap is shared by every consumer, so without this one
  consumer's connections (held requests, idle keep-alives) closed the others' at accept.
* ``max_body_bytes_per_consumer``: request bodies of one consumer's requests that one process holds at
  once (read, being read, held or in flight), declared ``Content-Length`` counted before a byte is
  read; past it the request is refused (the no-healthy status) without reading its body. Without it a
  consumer's held requests kept their bodies in memory for as long as they were held (8 x 8 MB: router
  RSS +80 MB) with no bound but the connection cap x ``max_request_bytes``. 1 GiB is ~25,000 of Gym's
  ~40 KB conversations.
* ``keyless_share``, ``keyless_idle_timeout_s``, ``keyless_max_requests``: connections that have made no
  authenticated request (``router.http.connections``). Another local user with no key held every
  connection of the cap with idle keep-alive ``/health`` connections, and every consumer's next connection
  was closed at accept: the per-consumer caps never applied, as those connections never authenticated.
  Now a connection that has made only unauthenticated requests lives in a small pool of its own
  (``keyless_share`` of the cap, at least 4, at most half: ``keyless_pool``), is closed after
  ``keyless_idle_timeout_s`` idle (a keyed one keeps ``keepalive_timeout_s``) and after
  ``keyless_max_requests`` requests; connections that presented a key have the rest of the cap; and a
  new connection is never refused while an unauthenticated one could make room for it.
* ``body_timeout_s``: a request body the router reads must have arrived this long after its head, else
  the client gets 408 and the connection is closed; a body it does not read (a ``/health`` with a body,
  a request refused before its body) is drained and discarded for at most this long, then the
  connection is closed. Without it one connection trickling a body to a route that reads it was held
  for ever (in worker processes, every open route relayed its body that way). 10 s is what aiohttp
  already allowed for draining, and asks a body of ``max_request_bytes`` (64 MiB) for 6.4 MB/s.

They are ``RouterConfig.http`` (and a job spec's ``router.http``), validated with the other settings.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Descriptors kept for everything that is not a client connection: listening socket, health session,
# idle upstream connections, log files, Ray's own sockets in an actor.
RESERVED_FDS = 256


@dataclass(frozen=True, slots=True)
class HttpLimits:
    head_timeout_s: float = 10.0
    keepalive_timeout_s: float = 75.0
    max_client_connections: int = 8192
    max_backend_header_bytes: int = 64 * 1024
    max_error_body_bytes: int = 4096
    body_timeout_s: float = 10.0
    max_connections_per_consumer: int = 0
    max_body_bytes_per_consumer: int = 1024 * 1024 * 1024
    keyless_share: float = 0.05
    keyless_idle_timeout_s: float = 3.0
    keyless_max_requests: int = 100

    def __post_init__(self) -> None:
        for name in ("head_timeout_s", "keepalive_timeout_s", "body_timeout_s", "keyless_idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HttpLimits.{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "max_client_connections",
            "max_backend_header_bytes",
            "max_error_body_bytes",
            "max_body_bytes_per_consumer",
            "keyless_max_requests",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"HttpLimits.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.keyless_share <= 0.5:
            raise ValueError(
                "HttpLimits.keyless_share must be in [0, 0.5] (the part of the connection cap kept for "
                f"connections that have presented no key), got {self.keyless_share}"
            )
        if self.max_connections_per_consumer < 0:
            raise ValueError(
                "HttpLimits.max_connections_per_consumer must be >= 0 (0: the consumer's weighted share "
                f"of the connection cap), got {self.max_connections_per_consumer}"
            )


DEFAULT_HTTP_LIMITS = HttpLimits()


def raise_open_file_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; return the soft limit now in force.

    Distributions start processes at 1024 open files, which a router with a few hundred clients and as
    many upstream connections reaches in normal use. Raising the soft limit needs no privilege.
    """
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Linux
        return 1 << 20
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft if soft != resource.RLIM_INFINITY else 1 << 20
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:  # e.g. a container capping below the reported hard limit
        log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
        return soft
    return target


def effective_connection_cap(limits: HttpLimits, open_file_limit: int) -> int:
    """Client connections admitted at once: the configured cap, bounded so that every admitted client
    can also hold an upstream connection without reaching the open-file limit."""
    return max(1, min(limits.max_client_connections, (open_file_limit - RESERVED_FDS) // 2))


MIN_KEYLESS_POOL = 4


def keyless_pool(cap: int, share: float) -> int:
    """Connections of one process's ``cap`` kept for those that have made no authenticated request: the
    ``share`` of it, at least ``MIN_KEYLESS_POOL`` (so a few probes and scrapers keep their keep-alive on
    a small cap), at most half (so a cap of 1 or 2 still admits a keyed connection)."""
    return min(cap // 2, max(MIN_KEYLESS_POOL, math.ceil(cap * share)))
