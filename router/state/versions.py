"""What weights each engine serves, as the router knows them: the version on every sample, and gates on it.

Async RL needs to know which policy produced a rollout (off-policy correction, staleness bounds), and a
trainer that just refit wants its evaluation requests served by the new weights only. The router is the one
place that sees both the requests and the refits, so it keeps here:

* **each engine's version** (``of``): set when the fleet stamps it (``router.fleet.api``: a refit
  transaction, ``POST /fleet/weight_version``) or verifies a joining engine's ``/weight_info``. A response
  carries the version of the engine that served it (``VERSION_HEADER``) as it stood when the request was
  dispatched.
* **the fleet's versions in stamp order** (``order``), the fleet's current one (``current``) and the
  version a refit in progress is moving to (``pending``): what a gated request may ask for. A request
  is held only for a version that may still come: the pending refit's target, the fleet's current
  version (an engine that restarts or joins is brought back to it), or one an engine the fleet keeps
  serves. Any other is answered at once (``WeightVersions.check``) with the version the fleet is on:
  a version never stamped, and an old one that every engine has moved past (exactly ``V`` for a
  superseded ``V`` was held for the whole hold bound, outside every consumer's share, and could never
  be served).
* **straddlers**: a request dispatched on one version whose engine was stamped with another before the
  request ended (a keep-mode refit froze it and resumed it on new weights) is counted and listed by request
  id, per step, so a trainer can drop or reweight it. The router cannot see inside one answer; what it
  knows is that the engine's version changed while the request was in flight.

Everything here runs on the loop of the process that owns the routing state (``router.state.routing``), the
one process whatever the number of worker processes, so there is no lock.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

VERSION_HEADER = "x-rl-weight-version"
"""Response header: the weight version of the engine that served the request (absent when unknown)."""
WEIGHT_VERSIONS_HEADER = "x-rl-weight-versions"
"""Response header of a continued answer (``router.continuation.spans``): which version made which of its
tokens, ``v3:0-117,v4:118-240`` (completion token indexes, inclusive)."""
WANT_HEADER = "x-rl-weight-version"
"""Request header: ``V`` (exactly V) or ``>=V`` (V or any version stamped after it)."""
REQUEST_ID_HEADER = "x-request-id"
"""The client's request id (vLLM's ``X-Request-Id``), by which straddlers are listed."""
ROUTER_REQUEST_ID_HEADER = "x-rl-request-id"
"""Response header: the id straddlers are listed by (the client's ``X-Request-Id``, else the router's)."""
MAX_STRADDLERS_LISTED = 10_000
"""Straddlers listed per step at most (the count goes on): a step's metrics must stay a small answer."""
MAX_STRADDLER_ID_BYTES = 1 << 20
"""And their ids' characters together at most (the count goes on): the router's ids are at most 128
(``router.http.forwarding``), so this binds first for long ones; without it 10,000 ids of 8 KB were ~80 MB
kept in the router and sent with every ``GET /fleet/step``."""


class UnknownVersion(ValueError):
    """A gated request asked for a version the fleet will not serve: never stamped nor being refitted
    to, or superseded (no engine the fleet keeps has it, and it is neither the fleet's current version
    nor the pending refit's target). Answered 400 at once: the fleet is healthy, the gate is what
    cannot be met, so it is the client's to change (the no-healthy status would tell the operator that
    the fleet is empty)."""


class VersionRefused(Exception):
    """A gated request no serving engine satisfied within the hold's bounds (the pause gate's
    ``max_held`` and ``max_wait_s``); the message is the client's, with the no-healthy-backend status."""


@dataclass(frozen=True)
class VersionWant:
    """A gated request's condition on the serving engine's version."""

    version: str
    at_least: bool = False

    @classmethod
    def parse(cls, value: str) -> VersionWant:
        """``"V"`` or ``">=V"``; raises ``ValueError`` naming the header."""
        text = value.strip()
        at_least = text.startswith(">=")
        if at_least:
            text = text[2:].strip()
        if not text:
            raise ValueError(f"{WANT_HEADER}: {value!r} names no version (give V or >=V)")
        return cls(text, at_least)

    def __str__(self) -> str:
        return (">=" if self.at_least else "") + self.version


class WeightVersions:
    def __init__(self) -> None:
        self.of: dict[str, str] = {}
        """Engine URL (canonical) -> the version it serves, as last stamped or verified."""
        self.order: list[str] = []
        """The fleet's versions, oldest first, each once (a version stamped again keeps its place)."""
        self.pending: str | None = None
        """The version a refit in progress is moving to (a gated request for it is held, not refused)."""
        self.current: str | None = None
        """The fleet's version (the last fleet-wide move): engines that restart or join are brought back
        to it, so a request gated on it is held while none serves it, not refused."""
        # asyncio.Event binds to a loop on first wait (3.10+), so one made before serving is fine.
        self._changed = asyncio.Event()
        self._rank: dict[str, int] = {}
        """``order`` as version -> index, kept with it: ``>=V`` is two lookups."""
        self.held = 0
        """Gated requests waiting now for an engine that satisfies them (the routing state counts)."""
        self.refused_total = 0
        """Gated requests refused past the hold's bounds."""
        self.straddled_total = 0
        self._recent: deque[tuple[int, str]] = deque()
        """The latest straddlers' ids, each with its number (``straddled_total`` after it)."""
        self._recent_bytes = 0
        self.listeners: list[Callable[[str, str], None]] = []
        """Called with (url, version) when an engine's version changes (``stamped``): each forwarding
        process's requests on it start a new per-token version span there (``router.continuation``)."""

    # -- what the fleet API tells it -----------------------------------------------------------------
    def stamped(self, url: str, version: str) -> None:
        """``url`` now serves ``version`` (a stamp it accepted, or a verified ``/weight_info``)."""
        if self.of.get(url) != version:
            self.of[url] = version
            self.changed()
            for listener in self.listeners:
                listener(url, version)

    def fleet_moved_to(self, version: str) -> None:
        """The fleet's version is now ``version`` (appended to the stamp order on first use)."""
        if version not in self._rank:
            self._rank[version] = len(self.order)
            self.order.append(version)
        if self.pending == version:
            self.pending = None
        self.current = version
        self.changed()

    def announce(self, version: str | None) -> None:
        """A refit towards ``version`` began (``None``: it ended without moving the fleet)."""
        self.pending = version
        self.changed()

    def forget(self, url: str) -> None:
        """``url`` left the fleet (a restarted engine comes back with a version of its own)."""
        if self.of.pop(url, None) is not None:
            self.changed()

    def changed(self) -> None:
        """Wake every request waiting for a version (the serving set changes call this too)."""
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def wait_change(self) -> None:
        """Return at the next version or serving-set change."""
        await self._changed.wait()

    # -- what a request asks -------------------------------------------------------------------------
    def known(self) -> list[str]:
        """Every version a request may ask for: stamped ones in order, then one in progress, then any an
        engine serves that was never a fleet stamp (its checkpoint's, e.g. vLLM's ``default``)."""
        out = list(self.order)
        if self.pending is not None and self.pending not in out:
            out.append(self.pending)
        out.extend(sorted({v for v in self.of.values() if v not in out}))
        return out

    def check(self, want: VersionWant, kept: Iterable[str] | None = None) -> None:
        """Raise ``UnknownVersion`` (its message lists the known versions) for a version nobody knows.
        With ``kept`` (the engines serving now or coming back by themselves: ejected for a moment, not
        held out as stale), also for a version the fleet will not serve any more: no engine of ``kept``,
        nor the fleet's current version, nor the pending refit's target satisfies ``want`` (the message
        names the fleet's version). The caller asks this only once no serving engine satisfies ``want``,
        so the request path of a satisfiable gate pays nothing more."""
        v = want.version
        if not (v in self._rank or v == self.pending or v in self.of.values()):
            raise UnknownVersion(
                f"weight version {want.version!r} is unknown to the fleet; it knows "
                f"{self.known() or 'none yet (nothing stamped)'}"
            )
        if kept is None or self._may_come(want, kept):
            return
        on = repr(self.current) if self.current is not None else "no fleet-wide version yet"
        raise UnknownVersion(
            f"weight version {str(want)!r} is no longer served: no engine has it and no refit is moving to "
            f"it; the fleet is on {on} (gate on the fleet's version, or on >=V, not on one it has moved "
            "past)"
        )

    def _may_come(self, want: VersionWant, kept: Iterable[str]) -> bool:
        """Some engine of ``kept``, the fleet's current version or the pending refit's target satisfies
        ``want``: a request held for it can be served once that engine, or the refit, is back."""
        if any(self.satisfies(u, want) for u in kept):
            return True
        return any(self._version_satisfies(c, want) for c in (self.current, self.pending) if c is not None)

    def _version_satisfies(self, have: str, want: VersionWant) -> bool:
        """``satisfies`` for a version rather than an engine (a pending version not yet in the stamp
        order ranks after every stamped one: it is appended when the fleet moves to it)."""
        if have == want.version:
            return True
        if not want.at_least:
            return False
        wanted = self._rank.get(want.version)
        mine = self._rank.get(have, len(self.order))
        return wanted is not None and mine >= wanted

    def satisfies(self, url: str, want: VersionWant) -> bool:
        have = self.of.get(url)
        if have is None:
            return False
        if have == want.version:
            return True
        if not want.at_least:
            return False
        rank = self._rank
        mine, wanted = rank.get(have), rank.get(want.version)
        return mine is not None and wanted is not None and mine >= wanted

    def excluded_for(self, want: VersionWant | None, serving: tuple[str, ...]) -> frozenset[str]:
        """The serving engines a request gated on ``want`` must not go to."""
        if want is None:
            return frozenset()
        return frozenset(u for u in serving if not self.satisfies(u, want))

    def unsatisfied(self, want: VersionWant, serving: tuple[str, ...]) -> str:
        """Why no serving engine takes a request gated on ``want`` (the client's message)."""
        have = {u: self.of.get(u) for u in serving}
        engines = (
            ", ".join(f"{u}: {v if v is not None else 'unknown'}" for u, v in have.items())
            if have
            else "none serving"
        )
        return f"no serving engine has weight version {str(want)!r} (serving engines: {engines})"

    # -- straddlers ----------------------------------------------------------------------------------
    def ended(self, url: str, dispatched_on: str | None, request_id: str | None) -> bool:
        """A request dispatched to ``url`` on version ``dispatched_on`` ended; True (and counted) when the
        engine's version changed meanwhile."""
        if dispatched_on is None:
            return False
        now = self.of.get(url)
        if now is None or now == dispatched_on:
            return False
        self.straddled_total += 1
        if request_id:
            # The latest are listed: the oldest leave once the count or the bytes are past their bound.
            recent = self._recent
            recent.append((self.straddled_total, request_id))
            self._recent_bytes += len(request_id)
            while len(recent) > MAX_STRADDLERS_LISTED or self._recent_bytes > MAX_STRADDLER_ID_BYTES:
                self._recent_bytes -= len(recent.popleft()[1])
        return True

    def step_mark(self) -> int:
        """Where a step begins, for ``straddlers_since``. A mark, not a reset: on a fleet of several
        trainers (LoRA tenants) one trainer's new step must not empty what another's step has seen."""
        return self.straddled_total

    def straddlers_since(self, mark: int) -> dict[str, object]:
        """``{"count", "request_ids"}`` since ``mark`` (``count`` all of them; the latest ids listed, up to
        ``MAX_STRADDLERS_LISTED`` and ``MAX_STRADDLER_ID_BYTES`` of the whole fleet's)."""
        ids = [rid for n, rid in self._recent if n > mark]
        return {"count": self.straddled_total - mark, "request_ids": ids}
