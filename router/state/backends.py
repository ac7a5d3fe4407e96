"""The serving set and what the router saw of each backend.

``set_serving_backends`` replaces the eligible set whole: the fleet controller pushes its entire view
every tick, so a restarted router converges on the next tick and no lost delta can leave a dead engine in
rotation. Outcomes (successes and failures) are counted per backend in one window and drained together,
so a controller can tell "3 failures among 3,000 successes" from "3 failures in a row".

Backends are keyed by their canonical URL: ``http://host:port`` plus any path prefix, without a trailing
``/v1``. Engines are advertised as ``http://h:p/v1`` (what Gym is given) while vllm-router's admin API
registers ``http://h:p``; both name the same engine and must not count as two.

Two sets, because a standalone router ejects and re-admits on its own: the *members* (what was
configured, pushed or registered, in order) and the *serving* set (members not currently ejected).
Ejection never forgets a member, so the prober keeps probing it and can bring it back; removal
(``DELETE /workers``, a pushed set without it) forgets it. Under a fleet controller nothing is ejected
and the two sets are the same.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from router.policies.base import LoadTracker, Policy
from router.state.versions import WeightVersions


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


def registered_backend_url(url: str) -> str:
    """``canonical_backend_url`` for a URL registered through ``POST /workers``, which must name an
    engine by its address alone (``http://host:port``, or with ``/v1``). Raises ``ValueError`` naming
    the URL for any other path: the router sends ``<path>/v1/...`` there, so a path prefix reaches
    whatever serves under it, the router's own capability prefix included (a request then recurses
    into the router until its connection cap)."""
    canonical = canonical_backend_url(url)
    path = urlsplit(canonical).path
    if path:
        raise ValueError(
            f"worker URL {url!r} has the path {path!r}: register an engine by its address alone, "
            "http://host:port or http://host:port/v1"
        )
    return canonical


class BackendSet:
    """Serving set, in-flight counts and outcome windows. All mutation happens on the router's loop
    thread except the outcome counters, which the loop and a controller thread share under a lock."""

    def __init__(self, policy: Policy, load: LoadTracker) -> None:
        self.policy = policy
        self.load = load
        self._lock = threading.Lock()
        self._window: dict[str, list[int]] = {}
        self.totals: dict[str, list[int]] = {}
        self._members: tuple[str, ...] = ()
        self._ejected: set[str] = set()
        # Members kept out of rotation because their weights are not the fleet's current version (see
        # router.fleet.api): unlike ejection, a pushed set does not clear it, since the controller
        # cannot know an engine's weight version.
        self._stale: dict[str, str] = {}
        # Called with each URL that becomes a member; True holds it out as stale until verified.
        self.admission: Callable[[str], bool] | None = None
        # Called with (url, ok) on every recorded outcome, on the recording thread (the router's loop):
        # the prober counts proxied attempts as evidence between its probes.
        self.outcome_listener: Callable[[str, bool], None] | None = None
        # Each member's weight version and the fleet's stamp order (router.state.versions): the response
        # header, gated requests and straddlers read it; the fleet API writes it.
        self.versions = WeightVersions()
        # Called with each URL that (re)enters the serving set, on the loop: an engine that restarted
        # comes back without its LoRA adapters (router.fleet.adapter_refit restores them before routing any).
        self.serving_listeners: list[Callable[[str], None]] = []
        # Called with (url, reason) when the requests in flight on an engine must move off it (each
        # forwarding process's ``router.continuation.moves.EngineWatch``, and the worker processes'
        # broadcast): it left the members ("removed": a push without it, a removal), was held out
        # ("quarantined": a refit that could not verify it, wrong weights), or the fleet asked
        # (``move_off``: "drained" by an elastic shrink, "restarted"). Returns how many it asked.
        self.move_listeners: list[Callable[[str, str], int | None]] = []

    # -- members and the serving set ---------------------------------------------------------------
    @property
    def serving(self) -> tuple[str, ...]:
        return self.load.backends

    @property
    def members(self) -> tuple[str, ...]:
        return self._members

    @property
    def ejected(self) -> frozenset[str]:
        return frozenset(self._ejected)

    @property
    def stale(self) -> dict[str, str]:
        """``{url: why}`` for members held out until they serve the current weight version."""
        return dict(self._stale)

    def hold_out_stale(self, url: str, why: str) -> bool:
        """Keep a member out of rotation until ``clear_stale``; False if it is not a member. A member
        that was serving has its requests moved ("quarantined"): they would go on generating on weights
        the fleet does not vouch for, or, frozen by a refit's pause, be aborted."""
        if url not in self._members:
            return False
        was_serving = url in self.load
        self._stale[url] = why
        self._sync()
        if was_serving:
            self.move_off(url, "quarantined")
        return True

    def leave_moving(self, urls: Iterable[str], reason: str) -> int:
        """``move_off`` each of ``urls`` with ``reason``, then remove them: the moved requests are sent
        elsewhere after this returns, so none lands on one of ``urls`` (siblings drained together)."""
        urls = list(urls)
        n = sum(self.move_off(u, reason) for u in urls)
        for u in urls:
            self.remove(u, move=False)  # moved just now, with the reason
        return n

    def move_off(self, url: str, reason: str) -> int:
        """Ask every forwarding process to move the requests in flight on ``url`` to other engines
        (those it can continue; see ``move_listeners``); how many this process's listeners asked."""
        n = 0
        for listener in self.move_listeners:
            n += listener(url, reason) or 0
        return n

    def clear_stale(self, url: str) -> bool:
        if self._stale.pop(url, None) is None:
            return False
        self._sync()
        return True

    def _admit(self, new: Iterable[str]) -> None:
        check = self.admission
        if check is None:
            return
        for url in new:
            if check(url):
                self._stale.setdefault(url, "weight version not verified yet")

    def _sync(self) -> None:
        for url in [u for u in self._stale if u not in self._members]:
            del self._stale[url]
        for url in [u for u in self.versions.of if u not in self._members]:
            self.versions.forget(url)
        serving = tuple(u for u in self._members if u not in self._ejected and u not in self._stale)
        if serving != self.load.backends:
            entered = [u for u in serving if u not in self.load]
            self.load.set_backends(serving)
            for url in entered:
                for listener in self.serving_listeners:
                    listener(url)
            self.policy.on_backends_changed(serving)
            self.versions.changed()  # a request gated on a version may now have an engine

    def replace(self, urls: Iterable[str]) -> tuple[str, ...]:
        """Make ``urls`` the members, serving at once (a pushed set is the controller's verdict)."""
        canonical = tuple(dict.fromkeys(canonical_backend_url(u) for u in urls))
        before = self._members
        self._members = canonical
        self._ejected.clear()
        self._admit(u for u in canonical if u not in before)
        self._sync()
        for url in before:
            if url not in canonical:
                self.move_off(url, "removed")
        return canonical

    def add(self, url: str) -> bool:
        key = canonical_backend_url(url)
        if key in self._members:
            return False
        self._members = (*self._members, key)
        self._admit((key,))
        self._sync()
        return True

    def remove(self, url: str, move: bool = True) -> bool:
        """Forget a member; its requests in flight are moved ("removed") unless ``move`` is False (a
        failed attempt's engine: its other streams break on their own if it died, and a timeout or an
        oversized header of one request says nothing about the others)."""
        key = canonical_backend_url(url)
        if key not in self._members:
            return False
        self._members = tuple(u for u in self._members if u != key)
        self._ejected.discard(key)
        self._sync()
        if move:
            self.move_off(key, "removed")
        return True

    def eject(self, url: str) -> bool:
        """Take a member out of rotation without forgetting it; False if it was not serving."""
        if url not in self._members or url in self._ejected:
            return False
        self._ejected.add(url)
        self._sync()
        return True

    def readmit(self, url: str) -> bool:
        """Put an ejected member back in rotation; False if it was not ejected."""
        if url not in self._ejected:
            return False
        self._ejected.discard(url)
        self._sync()
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
        listener = self.outcome_listener
        if listener is not None:
            listener(url, ok)

    def drain(self) -> dict[str, tuple[int, int]]:
        """``{url: (successes, failures)}`` since the last drain, both from the same window."""
        with self._lock:
            window, self._window = self._window, {}
        return {url: (s, f) for url, (s, f) in window.items()}
