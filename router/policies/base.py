"""The one interface every routing policy implements, and the load view they decide on.

Policies are pure objects: they see a request (path, headers, raw body) and a read-only view of the
fleet's in-flight counts, and return a backend URL. They do no I/O, so the router, the replay bench and
the tests share the very same objects, and a policy's behaviour can be checked without any server.

The load view is kept by the router (``LoadTracker``) rather than by each policy, because the in-flight
count of a backend is a fact about the proxy, not a policy opinion: every policy (and the metrics) must
see the same numbers, and the retry path must be able to exclude a failed backend whatever the policy.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may look at. ``body`` is the raw request body, never re-serialised."""

    path: str
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)
    # Policy-specific features of the body (e.g. prefix block hashes), filled by ``Policy.prepare`` so the
    # router can compute them off the event loop for large bodies and reuse them on a retry.
    features: object = None
    # The body's length when ``body`` is not carried: a router worker process sends the shared routing
    # state only the prepared features and the size, never the prompt bytes themselves.
    body_size: int = -1

    @property
    def size(self) -> int:
        return self.body_size if self.body_size >= 0 else len(self.body)


class NoBackendAvailable(Exception):
    """No backend is eligible (empty serving set, or every one excluded)."""


class LoadTracker:
    """In-flight requests per backend, with O(1) acquire/release and O(1) "least loaded".

    Backends are kept in buckets by their in-flight count, so the least-loaded choice at 1024 backends is
    a bucket lookup plus a random pick, not a scan: the per-request decision must stay in microseconds,
    and ties must be broken randomly (never by list order, which is how peers pile load on worker 0).
    """

    def __init__(self, backends: Iterable[str] = (), rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._load: dict[str, int] = {}
        # Bytes of request bodies in flight per backend: a proxy for the KV context each engine holds
        # (a multi-turn request resends its whole context), which a request count cannot see.
        self._bytes: dict[str, int] = {}
        self._total_bytes = 0
        # bucket[n] is a list of backends with n in flight; _pos[url] is its index in that list.
        self._buckets: dict[int, list[str]] = {}
        self._pos: dict[str, int] = {}
        self._min = 0
        self._total = 0
        self._order: tuple[str, ...] = ()
        self.set_backends(backends)

    # -- membership -------------------------------------------------------------------------------
    def set_backends(self, backends: Iterable[str]) -> None:
        """Replace the eligible set whole. In-flight counts of backends that stay are kept."""
        wanted = list(dict.fromkeys(backends))
        for url in list(self._load):
            if url not in wanted:
                self._bucket_remove(url)
                self._total -= self._load.pop(url)
                self._total_bytes -= self._bytes.pop(url)
        for url in wanted:
            if url not in self._load:
                self._load[url] = 0
                self._bytes[url] = 0
                self._bucket_add(url)
        self._order = tuple(wanted)
        self._recompute_min()

    @property
    def backends(self) -> tuple[str, ...]:
        return self._order

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, url: object) -> bool:
        return url in self._load

    # -- counts ---------------------------------------------------------------------------------
    def in_flight(self, url: str) -> int:
        return self._load.get(url, 0)

    @property
    def total_in_flight(self) -> int:
        return self._total

    def bytes_in_flight(self, url: str) -> int:
        return self._bytes.get(url, 0)

    @property
    def total_bytes_in_flight(self) -> int:
        return self._total_bytes

    def snapshot(self) -> dict[str, int]:
        return dict(self._load)

    def acquire(self, url: str, weight: int = 0) -> None:
        """Count one more request on ``url`` carrying ``weight`` bytes of prompt; a URL outside the set
        (removed meanwhile) is ignored. ``release`` must be given the same weight."""
        if url not in self._load:
            return
        self._bucket_remove(url)
        self._load[url] += 1
        self._total += 1
        self._bytes[url] += weight
        self._total_bytes += weight
        self._bucket_add(url)
        if self._buckets.get(self._min) is None:
            self._recompute_min()

    def release(self, url: str, weight: int = 0) -> None:
        if url not in self._load or self._load[url] == 0:
            return
        self._bucket_remove(url)
        self._load[url] -= 1
        self._total -= 1
        weight = min(weight, self._bytes[url])
        self._bytes[url] -= weight
        self._total_bytes -= weight
        self._bucket_add(url)
        if self._load[url] < self._min:
            self._min = self._load[url]

    # -- choices ----------------------------------------------------------------------------------
    @property
    def min_in_flight(self) -> int:
        return self._min

    def least_loaded(self, exclude: frozenset[str] = frozenset()) -> str:
        """A uniformly random backend among those with the fewest in flight (skipping ``exclude``)."""
        if not self._load:
            raise NoBackendAvailable("no serving backend")
        if not exclude:
            bucket = self._buckets[self._min]
            return bucket[self._rng.randrange(len(bucket))] if len(bucket) > 1 else bucket[0]
        for level in sorted(self._buckets):
            choices = [u for u in self._buckets[level] if u not in exclude]
            if choices:
                return choices[self._rng.randrange(len(choices))]
        raise NoBackendAvailable("every serving backend was excluded")

    @property
    def rng(self) -> random.Random:
        return self._rng

    # -- bucket bookkeeping -----------------------------------------------------------------------
    def _bucket_add(self, url: str) -> None:
        bucket = self._buckets.setdefault(self._load[url], [])
        self._pos[url] = len(bucket)
        bucket.append(url)

    def _bucket_remove(self, url: str) -> None:
        level = self._load[url]
        bucket = self._buckets[level]
        i = self._pos.pop(url)
        last = bucket.pop()
        if last != url:
            bucket[i] = last
            self._pos[last] = i
        if not bucket:
            del self._buckets[level]

    def _recompute_min(self) -> None:
        self._min = min(self._buckets) if self._buckets else 0


class Policy(ABC):
    """Chooses a backend for one request.

    ``choose`` must not block: it runs on the event loop for every request. ``exclude`` holds backends that
    already failed this request (the retry must land elsewhere). ``choose`` only decides; what a policy
    learns from a decision is told to it separately, per attempt, by whoever sends the request:

    * ``commit(request, url)`` when the request is sent to ``url``;
    * ``retract(request, url)`` when that attempt failed (refused, reset, timed out, 5xx, broken stream).

    So affinity follows the backend that served (the retry target on a retry) and never stays with one
    that failed. Learning at dispatch rather than at completion is deliberate: concurrent identical
    requests (a GRPO group's first turns) must find each other while the first is still generating.
    A caller that only simulates (the bench) and never fails calls ``choose`` then ``commit``.
    ``on_backends_changed`` is called whenever the serving set is replaced, so a policy can drop state for
    URLs that left (a restarted engine comes back on a new port and must not inherit a ghost's affinity).
    """

    name: str = "base"

    @abstractmethod
    def choose(
        self, request: RouteRequest, load: LoadTracker, exclude: frozenset[str] = frozenset()
    ) -> str: ...

    def commit(self, request: RouteRequest, url: str) -> None:  # noqa: B027 - optional hook
        """Optional: ``request`` (as returned by ``choose``'s caller's ``prepare``) was sent to ``url``."""

    def retract(self, request: RouteRequest, url: str) -> None:  # noqa: B027 - optional hook
        """Optional: the attempt of ``request`` on ``url`` failed; forget what ``commit`` learned from it."""

    def prepare(self, request: RouteRequest) -> RouteRequest:
        """Return ``request`` with ``features`` filled. Pure and thread-safe: the router runs it in a
        worker thread for large bodies, so hashing a 1 MiB prompt never stalls other requests."""
        return request

    def scope(self, request: RouteRequest, key: str) -> RouteRequest:
        """``request`` (prepared) with its features made distinct per ``key``: two requests with the same
        prompt for different LoRA adapters (or versions) share no KV on an engine, since vLLM keys its
        prefix cache by the adapter's name, so the cache-aware affinity must not treat them as one
        prefix either. Chained block hashes are salted with the key; other features pass unchanged."""
        features = request.features
        if not isinstance(features, list) or not features or not isinstance(features[0], int):
            return request
        salt = hash(key)
        scoped = [hash((salt, h)) for h in features]
        return RouteRequest(request.path, request.body, request.headers, scoped, request.body_size)

    def on_backends_changed(self, backends: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """Optional: forget state about backends that left the serving set."""

    def reset_cache_state(self) -> int:
        """Forget what the policy believes about engine caches (after a fleet-wide cache reset); returns
        how many entries were dropped. Policies without such state have nothing to forget."""
        return 0

    def stats(self) -> dict[str, float]:
        """Optional numbers for /metrics (e.g. index size)."""
        return {}

    @staticmethod
    def eligible(load: LoadTracker, exclude: frozenset[str]) -> Sequence[str]:
        if not exclude:
            return load.backends
        return [u for u in load.backends if u not in exclude]
