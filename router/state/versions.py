"""What weights each engine serves, as the router knows them: the version on every sample, and gates on it.

Async RL needs to know which policy produced a rollout (off-policy correction, staleness bounds), and a
trainer that just refit wants its evaluation requests served by the new weights only. The router is the one
place that sees both the requests and the refits, so it keeps here:

* **each engine's version** (``of``): set when the fleet stamps it (``router.fleet.api``: a refit
  transaction, ``POST /fleet/weight_version``) or verifies a joining engine's ``/weight_info``. A response
  carries the version of the engine that served it (``VERSION_HEADER``) as it stood when the request was
  dispatched.
* **the fleet's versions in stamp order** (``order``), plus the version a refit in progress is moving to
  (``pending``): what a gated request may ask for. A version that is neither (nor served by an engine)
  is unknown, and a request gated on it is answered at once with the versions the fleet knows
  (``WeightVersions.check``), instead of being held for a version that will never come.
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
from dataclasses import dataclass

VERSION_HEADER = "x-rl-weight-version"
"""Response header: the weight version of the engine that served the request (absent when unknown)."""
WANT_HEADER = "x-rl-weight-version"
"""Request header: ``V`` (exactly V) or ``>=V`` (V or any version stamped after it)."""
REQUEST_ID_HEADER = "x-request-id"
"""The client's request id (vLLM's ``X-Request-Id``), by which straddlers are listed."""
ROUTER_REQUEST_ID_HEADER = "x-rl-request-id"
"""Response header: the id straddlers are listed by (the client's ``X-Request-Id``, else the router's)."""
MAX_STRADDLERS_LISTED = 10_000
"""Straddlers listed per step at most (the count goes on): a step's metrics must stay a small answer."""


class UnknownVersion(ValueError):
    """A gated request asked for a version the fleet has never stamped nor is refitting to."""


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
        # asyncio.Event binds to a loop on first wait (3.10+), so one made before serving is fine.
        self._changed = asyncio.Event()
        self._rank: dict[str, int] = {}
        """``order`` as version -> index, kept with it: ``>=V`` is two lookups."""
        self.held = 0
        """Gated requests waiting now for an engine that satisfies them (the routing state counts)."""
        self.refused_total = 0
        """Gated requests refused past the hold's bounds."""
        self.straddled_total = 0
        self._step_straddled = 0
        self._step_ids: deque[str] = deque(maxlen=MAX_STRADDLERS_LISTED)

    # -- what the fleet API tells it -----------------------------------------------------------------
    def stamped(self, url: str, version: str) -> None:
        """``url`` now serves ``version`` (a stamp it accepted, or a verified ``/weight_info``)."""
        if self.of.get(url) != version:
            self.of[url] = version
            self.changed()

    def fleet_moved_to(self, version: str) -> None:
        """The fleet's version is now ``version`` (appended to the stamp order on first use)."""
        if version not in self._rank:
            self._rank[version] = len(self.order)
            self.order.append(version)
        if self.pending == version:
            self.pending = None
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

    def check(self, want: VersionWant) -> None:
        """Raise ``UnknownVersion`` (its message lists the known versions) for a version nobody knows."""
        v = want.version
        if v in self._rank or v == self.pending or v in self.of.values():
            return
        raise UnknownVersion(
            f"weight version {want.version!r} is unknown to the fleet; it knows "
            f"{self.known() or 'none yet (nothing stamped)'}"
        )

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
        self._step_straddled += 1
        if request_id:
            self._step_ids.append(request_id)
        return True

    def begin_step(self) -> None:
        self._step_straddled = 0
        self._step_ids.clear()

    def step_straddlers(self) -> dict[str, object]:
        """``{"count", "request_ids"}`` since ``begin_step`` (ids listed up to ``MAX_STRADDLERS_LISTED``)."""
        return {"count": self._step_straddled, "request_ids": list(self._step_ids)}
