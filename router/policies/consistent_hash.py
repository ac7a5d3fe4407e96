"""Session affinity by a client header, on a hash ring with virtual nodes.

A ring (not ``hash % n``) so that replacing one engine moves only that engine's sessions: with modulo
hashing a restarted engine on a new port would reshuffle every session and throw away every prefix cache.
Requests without the header fall back to least-outstanding rather than all mapping to one backend (the
peers' behaviour, which sends all header-less Gym traffic to a single worker).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Mapping, Sequence

from router.policies.base import LoadTracker, NoBackendAvailable, Policy, RouteRequest

DEFAULT_SESSION_HEADER = "X-Session-ID"


def stable_hash64(data: bytes) -> int:
    """A process-independent 64-bit hash (Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def session_key(
    headers: Mapping[str, str], header: str = DEFAULT_SESSION_HEADER, *, case_insensitive: bool = False
) -> str | None:
    """A request's session key: the value of its session ``header`` (any case), None when absent or
    empty. The one definition, shared by this policy's ring and the request record's session hash
    (``router.record``), so a record's sessions are the sessions the router routed by.
    ``case_insensitive``: ``headers`` is one already (aiohttp's), so one lookup is enough."""
    value = headers.get(header)
    if value is None and not case_insensitive:
        value = headers.get(header.lower())
    return value or None


class ConsistentHash(Policy):
    name = "consistent_hash"

    def __init__(self, session_header: str = DEFAULT_SESSION_HEADER, virtual_nodes: int = 64) -> None:
        self.session_header = session_header
        self.virtual_nodes = virtual_nodes
        self._ring_keys: list[int] = []
        self._ring_urls: list[str] = []
        self._members: tuple[str, ...] = ()

    def on_backends_changed(self, backends: Sequence[str]) -> None:
        self._build(tuple(backends))

    def _build(self, backends: tuple[str, ...]) -> None:
        points = sorted(
            (stable_hash64(f"{url}#{i}".encode()), url) for url in backends for i in range(self.virtual_nodes)
        )
        self._ring_keys = [k for k, _ in points]
        self._ring_urls = [u for _, u in points]
        self._members = backends

    def session_key(self, request: RouteRequest) -> str | None:
        return session_key(request.headers, self.session_header)

    def choose(self, request: RouteRequest, load: LoadTracker, exclude: frozenset[str] = frozenset()) -> str:
        if load.backends != self._members:
            self._build(load.backends)
        key = self.session_key(request)
        if key is None or not self._ring_keys:
            return load.least_loaded(exclude)
        start = bisect.bisect(self._ring_keys, stable_hash64(key.encode()))
        n = len(self._ring_keys)
        for step in range(n):
            url = self._ring_urls[(start + step) % n]
            if url not in exclude:
                return url
        raise NoBackendAvailable("every serving backend was excluded")
