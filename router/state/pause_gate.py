"""The router's side of a fleet pause: hold new generation requests, release them in order on resume.

Without it, a request that arrives while the trainer updates weights either waits on a paused engine
with no bound (Gym has no HTTP timeout) or fails; both lose rollouts. The gate holds it in the router
instead, bounded in count (``max_held``) and time (``max_wait_s``): past either bound the request gets the
no-healthy-backend status, which no client retries, so a trainer that never resumes shows up as errors
instead of a silent hang. On resume the held requests are released first-come first-served (their
futures are completed in arrival order, and asyncio runs the waiting handlers in that order).

The request path pays one attribute read (``paused``) when the fleet is not paused. All methods run on the
router's event loop. The gate belongs to the routing state (``router.state.routing.LocalRouting``), not to the
process that parsed the request: with worker processes (``router.multiprocess.workers``) a request is held by
the parent while it waits for its routing decision, so ``max_held`` and ``max_wait_s`` bound the whole router
once instead of once per worker, and a pause closes every worker's door at the same instant.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from router.state.holds import PAUSE, Holds


class PauseRefused(Exception):
    """A generation request the gate would not hold (``max_held`` reached or ``max_wait_s`` passed); the
    message is the one the client is given, with the no-healthy-backend status."""


@dataclass
class GateStats:
    paused: bool
    mode: str
    paused_for_s: float
    held: int
    longest_wait_s: float
    """The longest wait among requests held now (0 when none)."""
    last_max_wait_s: float
    """The longest wait a held request had in the last completed pause."""
    held_total: int
    refused_total: int
    pauses_total: int
    last_pause_s: float


class PauseGate:
    def __init__(self, max_held: int = 10_000, max_wait_s: float = 600.0) -> None:
        if max_held < 0 or max_wait_s <= 0:
            raise ValueError("pause gate: max_held must be >= 0 and max_wait_s > 0")
        self.max_held = max_held
        self.max_wait_s = max_wait_s
        self.paused = False
        self.mode = ""
        self._since = 0.0
        self._waiters: deque[tuple[float, asyncio.Future[bool]]] = deque()
        self._max_wait_now = 0.0
        self.last_max_wait_s = 0.0
        self.last_pause_s = 0.0
        self.held_total = 0
        self.refused_total = 0
        self.pauses_total = 0

    def close(self, mode: str = "keep") -> None:
        """Start holding new requests (idempotent: a second pause keeps the first's start time)."""
        if not self.paused:
            self.paused = True
            self._since = time.monotonic()
            self._max_wait_now = 0.0
            self.pauses_total += 1
        self.mode = mode

    def open(self) -> int:
        """Stop holding; release every held request in arrival order. Returns how many were released."""
        now = time.monotonic()
        released = 0
        while self._waiters:
            t0, fut = self._waiters.popleft()
            if not fut.done():
                self._max_wait_now = max(self._max_wait_now, now - t0)
                fut.set_result(True)
                released += 1
        if self.paused:
            self.last_pause_s = now - self._since
            self.last_max_wait_s = self._max_wait_now
        self.paused = False
        self.mode = ""
        return released

    def release(self) -> dict[str, float]:
        """``open`` and what the pause held: ``released`` requests, the ``longest_wait_s`` of a held
        request (still held or released now), ``paused_for_s``: the figures a resume reports."""
        held = self.stats()
        released = self.open()
        after = self.stats()
        return {
            "released": released,
            "longest_wait_s": round(max(held.longest_wait_s, after.last_max_wait_s), 4),
            "paused_for_s": round(after.last_pause_s, 4),
        }

    async def hold(self) -> bool:
        """Wait until resume; False when the request must be refused (gate full, or waited too long)."""
        self._waiters = deque(w for w in self._waiters if not w[1].done())
        if len(self._waiters) >= self.max_held:
            self.refused_total += 1
            return False
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        t0 = time.monotonic()
        self._waiters.append((t0, fut))
        self.held_total += 1
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.max_wait_s)
        except TimeoutError:
            self.refused_total += 1
            self._max_wait_now = max(self._max_wait_now, time.monotonic() - t0)
            return False
        finally:
            if not fut.done():
                fut.cancel()  # timed out or the client went away: no longer held

    async def pass_through(self, held: Holds | None = None) -> None:
        """Hold until resume; raise ``PauseRefused`` (with the client's message) where ``hold`` refuses.
        ``held``: where the seconds held are added (``PAUSE``), refused or not, for the request's record."""
        t0 = time.perf_counter()
        try:
            admitted = await self.hold()
        finally:
            if held is not None:
                held.add(PAUSE, time.perf_counter() - t0)
        if not admitted:
            raise PauseRefused(
                f"fleet paused for a weight update; request not held (at most {self.max_held} held, "
                f"each at most {self.max_wait_s:g} s)"
            )

    def stats(self) -> GateStats:
        now = time.monotonic()
        live = [t0 for t0, f in self._waiters if not f.done()]
        return GateStats(
            paused=self.paused,
            mode=self.mode,
            paused_for_s=(now - self._since) if self.paused else 0.0,
            held=len(live),
            longest_wait_s=(now - min(live)) if live else 0.0,
            last_max_wait_s=self.last_max_wait_s,
            held_total=self.held_total,
            refused_total=self.refused_total,
            pauses_total=self.pauses_total,
            last_pause_s=self.last_pause_s,
        )
