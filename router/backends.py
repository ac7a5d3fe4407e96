"""The serving set and what the router saw of each backend.

``set_serving_backends`` replaces the eligible set whole: the fleet controller pushes its entire view
every tick, so a restarted router converges on the next tick and no lost delta can leave a dead engine in
rotation. Outcomes (successes and failures) are counted per backend in one window and drained together,
so a controller can tell "3 failures among 3,000 successes" from "3 failures in a row".

Backends are keyed by their canonical URL: ``http://host:port`` plus any path prefix, without a trailing
``/v1``. Engines are advertised as ``http://h:p/v1`` (what Gym is given) while vllm-router's admin API
registers ``http://h:p``; both name the same engine and must not count as two.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from urllib.parse import urlsplit

from router.policies.base import LoadTracker, Policy


def canonical_backend_url(url: str) -> str:
    """``http://h:p/v1/`` -> ``http://h:p``; raises ``ValueError`` naming a malformed URL."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"backend URL must be a non-empty string, got {url!r}")
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"backend URL {url!r} is malformed: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"backend URL {url!r} must look like http://host:port[/v1]")
    if port is None:
        raise ValueError(
            f"backend URL {url!r} has no port; engines listen on explicit ports (http://host:port/v1)"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"backend URL {url!r} must not carry a query or fragment")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    return f"{parts.scheme}://{host}:{port}{path}"


class BackendSet:
    """Serving set, in-flight counts and outcome windows. All mutation happens on the router's loop
    thread except the outcome counters, which the loop and a controller thread share under a lock."""

    def __init__(self, policy: Policy, load: LoadTracker) -> None:
        self.policy = policy
        self.load = load
        self._lock = threading.Lock()
        self._window: dict[str, list[int]] = {}
        self.totals: dict[str, list[int]] = {}

    # -- the serving set ---------------------------------------------------------------------------
    @property
    def serving(self) -> tuple[str, ...]:
        return self.load.backends

    def replace(self, urls: Iterable[str]) -> tuple[str, ...]:
        canonical = tuple(dict.fromkeys(canonical_backend_url(u) for u in urls))
        if canonical != self.load.backends:
            self.load.set_backends(canonical)
            self.policy.on_backends_changed(canonical)
        return canonical

    def add(self, url: str) -> bool:
        key = canonical_backend_url(url)
        if key in self.load:
            return False
        self.replace((*self.load.backends, key))
        return True

    def remove(self, url: str) -> bool:
        key = canonical_backend_url(url)
        if key not in self.load:
            return False
        self.replace(u for u in self.load.backends if u != key)
        return True

    # -- outcomes -----------------------------------------------------------------------------------
    def record(self, url: str, ok: bool) -> None:
        i = 0 if ok else 1
        with self._lock:
            w = self._window.get(url)
            if w is None:
                w = self._window[url] = [0, 0]
            w[i] += 1
            t = self.totals.get(url)
            if t is None:
                t = self.totals[url] = [0, 0]
            t[i] += 1

    def drain(self) -> dict[str, tuple[int, int]]:
        """``{url: (successes, failures)}`` since the last drain, both from the same window."""
        with self._lock:
            window, self._window = self._window, {}
        return {url: (s, f) for url, (s, f) in window.items()}
