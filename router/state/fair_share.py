"""Weighted fair share of a standing fleet's capacity between the jobs (consumers) that use it.

A standing fleet serves several jobs at once (``router.consumers``). Without admission control, the job
that sends the most concurrent requests gets the fleet: a training job with 1,024 rollouts in flight
starves an eval job with 32 however the engines schedule, because every engine serves first come first
served. So with ``RouterConfig.fair_share_capacity = C`` the router keeps at most C generation requests in
flight in all, and when requests wait, a freed slot goes to the waiting consumer with the lowest
``in_flight / weight`` (ties: the one whose oldest request has waited longest). Contending consumers
then hold slots, and with equal generation times complete requests, in proportion to their weights; a
consumer alone may use all C (no slot is ever kept idle for an absent one).

Where it lives: in the routing state (``router.state.routing.LocalRouting``), which is one per router
whatever the number of worker processes (their decisions cross to it, carrying the consumer's name and
weight: ``router.multiprocess.decisions``), so C and the shares are exact for the whole router, not per
process. A request takes its slot after the pause gate and the version gate (a request held for a weight
version must not sit on a slot others could use) and gives it back when the engine has answered in full
(the same moment its backend slot is released) or when the request ends otherwise.

A waiting request is bounded by ``max_wait_s``; past it the client gets the no-healthy-backend status with
a reason naming the capacity (``FairShareRefused``), like the pause gate's bounds. A request whose client
goes away leaves the queue at once.

Every request the router holds counts against its consumer (``hold``): held at the pause gate, held for a
weight version, or waiting here for a slot, from the moment it would wait until it has its slot or is
refused. A consumer may have at most ``held_bound`` of them at once (``max_held_per_consumer``, else its
weighted share of ``max_held``: the router's own bound on what it holds, the pause gate's and the
connection cap's smaller); one more is refused at once with the no-healthy status, which no client
retries. Without it the holds were bounded only router-wide, so one consumer that sent enough requests
while the fleet was paused (or gated on a version) filled the pause gate and the connection cap, and the
other consumers' requests were refused or their connections closed.

The same object is the per-consumer ledger behind ``/metrics`` and ``GET /fleet/consumers``: requests and
completion tokens, in flight, waiting, and ``share``: the consumer's fraction of the generation requests
completed in the last ``SHARE_WINDOW_S`` seconds (60, counted in one-second buckets). Without a capacity
(only ``consumers_file`` set) it admits everything at once and only keeps the ledger.

Everything runs on the routing state's event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypedDict

from router.consumers import OWNER, Consumer
from router.state.holds import SHARE, Holds

SHARE_WINDOW_S = 60


class FairShareRefused(Exception):
    """A generation request not admitted within ``max_wait_s``, or one more than its consumer may have
    held (the client's message; no-healthy status)."""


class Account:
    """One consumer's counts. Never deleted: its counters must not go down while the router runs."""

    __slots__ = (
        "_bucket_count",
        "_bucket_second",
        "completion_tokens",
        "held",
        "in_flight",
        "name",
        "queue",
        "refused",
        "requests",
        "waiting",
        "weight",
    )

    def __init__(self, name: str, weight: float) -> None:
        self.name = name
        self.weight = weight
        self.in_flight = 0
        self.waiting = 0
        self.held = 0
        """Requests of this consumer held now: at the pause gate, for a version, or waiting for a slot."""
        self.queue: deque[tuple[float, asyncio.Future[None]]] = deque()
        self.requests = 0
        self.completion_tokens = 0
        self.refused = 0
        self._bucket_count = [0] * SHARE_WINDOW_S
        self._bucket_second = [-1] * SHARE_WINDOW_S

    def count_completion(self, second: int) -> None:
        i = second % SHARE_WINDOW_S
        if self._bucket_second[i] != second:
            self._bucket_second[i] = second
            self._bucket_count[i] = 0
        self._bucket_count[i] += 1

    def recent(self, second: int) -> int:
        """Requests completed in the last ``SHARE_WINDOW_S`` seconds (this one included)."""
        return sum(
            n
            for n, s in zip(self._bucket_count, self._bucket_second, strict=True)
            if 0 <= second - s < SHARE_WINDOW_S
        )


class ConsumerRow(TypedDict):
    """One consumer in ``GET /fleet/consumers`` and the ``rl_router_consumer_*`` metrics."""

    weight: float
    admin: bool
    job: str
    registered: bool
    in_flight: int
    waiting: int
    held: int
    requests: int
    completion_tokens: int
    refused: int
    share: float


class FairShare:
    """``capacity``: generation requests in flight through the router at most (None: no admission
    control, the ledger only). ``registered``: the consumers in the file now, so that the views list
    those that sent nothing yet and the shares of ``max_held`` are shared among them (set by the router
    that reads the file). ``max_held``: the requests the router holds at most, all consumers together;
    ``max_held_per_consumer``: what one consumer may have held (None: its weighted share of
    ``max_held``)."""

    def __init__(
        self,
        capacity: int | None,
        max_wait_s: float = 600.0,
        max_held: int = 10_000,
        max_held_per_consumer: int | None = None,
    ) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"fair share capacity must be >= 1, got {capacity}")
        if max_wait_s <= 0:
            raise ValueError(f"fair share max_wait_s must be > 0, got {max_wait_s}")
        if max_held < 0 or (max_held_per_consumer is not None and max_held_per_consumer < 0):
            raise ValueError("fair share max_held and max_held_per_consumer must be >= 0")
        self.capacity = capacity
        self.max_wait_s = max_wait_s
        self.max_held = max_held
        self.max_held_per_consumer = max_held_per_consumer
        self.in_flight = 0
        self.waiting = 0
        self.held = 0
        self.refused_total = 0
        self.accounts: dict[str, Account] = {}
        self._contending: set[Account] = set()
        self.registered: Callable[[], dict[str, Consumer]] | None = None

    def _account(self, name: str, weight: float) -> Account:
        account = self.accounts.get(name)
        if account is None:
            account = self.accounts[name] = Account(name, weight)
        elif account.weight != weight:
            account.weight = weight  # the file changed it: the next decisions use the new weight
        return account

    def _take(self, account: Account) -> None:
        account.in_flight += 1
        self.in_flight += 1

    # -- what one consumer may have held ------------------------------------------------------------------
    def held_bound(self, name: str, weight: float) -> int:
        """The requests ``name`` may have held at once: ``max_held_per_consumer``, else its weighted share
        of ``max_held`` among the consumers in the file and the owner (weight 1), itself included when
        it is neither (a revoked consumer's last requests). Asked only when a request would be held, so
        the file's table is summed off the request path's common case."""
        if self.max_held_per_consumer is not None:
            return self.max_held_per_consumer
        registered = self.registered() if self.registered is not None else {}
        total = sum(c.weight for c in registered.values()) + (0.0 if OWNER in registered else 1.0)
        if name not in registered and name != OWNER:
            total += weight
        return max(1, int(self.max_held * weight / total)) if total > 0 else self.max_held

    def hold(self, name: str, weight: float) -> None:
        """Count a request of ``name`` the router is about to hold (``unhold`` ends it); raises
        ``FairShareRefused`` at once, counted as a refusal of ``name``, when the consumer already has
        ``held_bound`` held: the client's message names the bound and what to change."""
        account = self._account(name, weight)
        bound = self.held_bound(name, account.weight)
        if account.held >= bound:
            account.refused += 1
            self.refused_total += 1
            how = (
                "max_held_per_consumer"
                if self.max_held_per_consumer is not None
                else f"its weighted share of the {self.max_held} the router holds at most"
            )
            raise FairShareRefused(
                f"consumer {name} already has {account.held} generation requests held by the router (paused, "
                f"gated on a weight version or waiting for a fair-share slot); at most {bound} ({how}), so "
                "this one is refused at once: send fewer at a time, or ask the fleet's owner for a larger "
                "weight or router.max_held_per_consumer"
            )
        account.held += 1
        self.held += 1

    def unhold(self, name: str) -> None:
        """The request ``hold`` counted for ``name`` is no longer held (it has its slot, or was refused,
        or its client left)."""
        account = self.accounts.get(name)
        if account is not None and account.held > 0:
            account.held -= 1
            self.held -= 1

    # -- admission ----------------------------------------------------------------------------------------
    def try_enter(self, name: str, weight: float) -> bool:
        """Take a slot now if one is free and nobody waits for one (else the newcomer would overtake)."""
        account = self._account(name, weight)
        capacity = self.capacity
        if capacity is None or (self.in_flight < capacity and not self.waiting):
            self._take(account)
            return True
        return False

    async def enter(self, name: str, weight: float, held: Holds | None = None) -> None:
        """Take a slot, waiting for one at most ``max_wait_s`` (``FairShareRefused`` past it). On return
        the caller holds the slot and must give it back (``finish`` or ``leave``); a cancelled wait holds
        none. ``held``: where the seconds waited are added (``SHARE``), granted or not, for the request's
        record."""
        if self.try_enter(name, weight):
            return
        t0 = time.perf_counter()
        try:
            await self._wait(name)
        finally:
            if held is not None:
                held.add(SHARE, time.perf_counter() - t0)

    async def _wait(self, name: str) -> None:
        """``enter``'s wait for a slot once none was free."""
        account = self.accounts[name]
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        account.queue.append((loop.time(), future))
        account.waiting += 1
        self.waiting += 1
        self._contending.add(account)
        try:
            await asyncio.wait_for(asyncio.shield(future), self.max_wait_s)
        except TimeoutError:
            if future.done() and not future.cancelled():
                return  # granted at the deadline: the slot is held
            self._withdraw(account, future)
            account.refused += 1
            self.refused_total += 1
            raise FairShareRefused(
                f"the fleet is at its fair-share capacity of {self.capacity} generation requests in flight; "
                f"request not admitted within {self.max_wait_s:g} s"
            ) from None
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.leave(name)  # granted, never used
            else:
                self._withdraw(account, future)
            raise

    def _withdraw(self, account: Account, future: asyncio.Future[None]) -> None:
        """A waiter that will not be granted (timed out, client gone): no longer counted as waiting. Its
        queue entry is skipped when it reaches the head."""
        future.cancel()
        account.waiting -= 1
        self.waiting -= 1
        if not account.waiting:
            account.queue.clear()
            self._contending.discard(account)

    def _grant(self) -> None:
        """Hand free slots to waiters: each to the contending consumer lowest in ``in_flight / weight``,
        ties to the one whose oldest request has waited longest."""
        capacity = self.capacity
        while self.waiting and (capacity is None or self.in_flight < capacity):
            best: Account | None = None
            best_key = (0.0, 0.0)
            for account in self._contending:
                queue = account.queue
                while queue and queue[0][1].done():
                    queue.popleft()
                if not queue:
                    continue
                key = (account.in_flight / account.weight, queue[0][0])
                if best is None or key < best_key:
                    best, best_key = account, key
            if best is None:  # pragma: no cover - counts and queues agree by construction
                self.waiting = 0
                self._contending.clear()
                return
            _, future = best.queue.popleft()
            best.waiting -= 1
            self.waiting -= 1
            if not best.waiting:
                self._contending.discard(best)
            self._take(best)
            future.set_result(None)

    def finish(self, name: str, completion_tokens: int = 0, counted: bool = True) -> None:
        """The request that held a slot of ``name`` is over: give the slot back, and when ``counted`` (it
        reached an engine) count it with the engine's ``completion_tokens``."""
        account = self.accounts.get(name)
        if account is None or account.in_flight <= 0:
            return  # pragma: no cover - a slot is only given back by its holder
        account.in_flight -= 1
        self.in_flight -= 1
        if counted:
            account.requests += 1
            account.completion_tokens += completion_tokens
            account.count_completion(int(time.monotonic()))
        if self.waiting:
            self._grant()

    def leave(self, name: str) -> None:
        """Give a slot back uncounted (the request never reached an engine)."""
        self.finish(name, 0, counted=False)

    # -- views ---------------------------------------------------------------------------------------------
    def rows(self) -> dict[str, ConsumerRow]:
        """Per consumer: the file's consumers (those that sent nothing yet too) and every one that sent
        something (a revoked one keeps its counts, with ``registered`` false). ``owner``: the fleet
        owner's own key."""
        registered = self.registered() if self.registered is not None else {}
        second = int(time.monotonic())
        recent = {name: a.recent(second) for name, a in self.accounts.items()}
        total_recent = sum(recent.values())
        out: dict[str, ConsumerRow] = {}
        for name in sorted(set(registered) | set(self.accounts)):
            entry = registered.get(name)
            account = self.accounts.get(name)
            weight = entry.weight if entry is not None else account.weight if account is not None else 1.0
            out[name] = {
                "weight": weight,
                "admin": entry.admin if entry is not None else name == OWNER,
                "job": entry.job if entry is not None else "",
                "registered": entry is not None or name == OWNER,
                "in_flight": account.in_flight if account is not None else 0,
                "waiting": account.waiting if account is not None else 0,
                "held": account.held if account is not None else 0,
                "requests": account.requests if account is not None else 0,
                "completion_tokens": account.completion_tokens if account is not None else 0,
                "refused": account.refused if account is not None else 0,
                "share": round(recent.get(name, 0) / total_recent, 4) if total_recent else 0.0,
            }
        return out

    def view(self) -> dict[str, Any]:
        """``GET /fleet/consumers``: the capacity, what is in flight and waiting, and ``rows``."""
        return {
            "capacity": self.capacity,
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "held": self.held,
            "refused": self.refused_total,
            "share_window_s": SHARE_WINDOW_S,
            "consumers": self.rows(),
        }
