"""The baseline policies: round-robin and least-outstanding.

They are the comparison arms of the replay bench and the fallbacks of the smarter policies, so they are
kept minimal and exact.
"""

from __future__ import annotations

from router.policies.base import LoadTracker, NoBackendAvailable, Policy, RouteRequest


class RoundRobin(Policy):
    """Cycles through the serving set in order, skipping excluded backends."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, load: LoadTracker, exclude: frozenset[str] = frozenset()) -> str:
        backends = load.backends
        n = len(backends)
        for _ in range(n):
            url = backends[self._next % n]
            self._next = (self._next + 1) % n
            if url not in exclude:
                return url
        raise NoBackendAvailable("no serving backend" if n == 0 else "every serving backend was excluded")


class LeastOutstanding(Policy):
    """Fewest requests in flight, ties broken at random (the seed behaviour).

    Random ties matter: choosing the first of equally idle backends sends every burst's first request to
    the same engine.
    """

    name = "least_outstanding"

    def choose(self, request: RouteRequest, load: LoadTracker, exclude: frozenset[str] = frozenset()) -> str:
        return load.least_loaded(exclude)
