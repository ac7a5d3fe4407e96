"""The fleet's side of a move: which tracked requests must leave an engine now, and weight-version news.

Why: a request streaming from an engine that is being drained (an elastic shrink), quarantined (a refit
canary or an engine the refit could not verify), removed from the fleet or restarted would otherwise
either hold the drain until it ends (the node-seconds the tail policy wants back) or be aborted and
retried from its first token. The router's fleet side knows when that happens; the request's
continuation loop (``router.continuation.loop``) knows what it produced. ``EngineWatch`` joins the two in
one process: each tracked attempt registers a ``Watch`` for its engine, and the fleet side's
``move_off(url, reason)`` sets every such watch's ``moved`` event; the loop then leaves the engine and
continues the request elsewhere. ``version_changed`` tells each attempt on an engine that its weights
changed under it (a keep-mode refit), so the answer's per-token version spans are exact.

One ``EngineWatch`` per process that forwards: the router process's, and one in each worker process
(``router.multiprocess``), which hears of moves and stamps from the parent over its decision channel.
Everything here runs on that process's event loop; nothing blocks, and an engine with no watch costs a
dict lookup. A watch registered after ``move_off`` is not moved (the engine's later requests are the
routing state's business: a drained engine leaves the serving set).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

MOVE_REASONS = frozenset({"drained", "quarantined", "removed", "restarted"})
"""What ``move_off`` may give as the reason (recorded with the move)."""


class Watch:
    """One tracked request attempt on one engine (``url``)."""

    __slots__ = ("moved", "on_version", "reason", "url")

    def __init__(self, url: str) -> None:
        self.url = url
        self.moved = asyncio.Event()
        """Set when the router is asked to move this engine's requests (``reason`` says why)."""
        self.reason: str | None = None
        self.on_version: Callable[[str], None] | None = None
        """Called with the engine's new weight version (set by the continuation loop)."""


class EngineWatch:
    """The tracked attempts of one process, by engine URL."""

    def __init__(self) -> None:
        self._by_url: dict[str, set[Watch]] = {}
        self.moves_total = 0
        """Attempts asked to move, over this watch's life (for tests and metrics)."""

    def watch(self, url: str) -> Watch:
        """Register an attempt on ``url``; ``unwatch`` it when the attempt ends, however it ends."""
        w = Watch(url)
        self._by_url.setdefault(url, set()).add(w)
        return w

    def unwatch(self, w: Watch) -> None:
        watches = self._by_url.get(w.url)
        if watches is None:
            return
        watches.discard(w)
        if not watches:
            del self._by_url[w.url]

    def watching(self, url: str | None = None) -> int:
        """How many attempts are registered (on ``url``, or in all)."""
        if url is not None:
            return len(self._by_url.get(url, ()))
        return sum(len(ws) for ws in self._by_url.values())

    def move_off(self, url: str, reason: str) -> int:
        """Ask every attempt on ``url`` to move; returns how many were asked (already-moved ones not
        counted twice). An unknown reason is kept as given (the record shows it), and logged."""
        if reason not in MOVE_REASONS:
            log.warning("move_off(%s) with an unknown reason %r", url, reason)
        n = 0
        for w in self._by_url.get(url, ()):
            if not w.moved.is_set():
                w.reason = reason
                w.moved.set()
                n += 1
        self.moves_total += n
        return n

    def version_changed(self, url: str, version: str) -> None:
        """``url`` now serves ``version``: tell each attempt on it that follows versions. A callback that
        raises is logged and skipped: one request's bookkeeping must not stop another's."""
        for w in list(self._by_url.get(url, ())):
            if w.on_version is None:
                continue
            try:
                w.on_version(version)
            except Exception:
                log.exception("version callback of a request on %s failed", url)
