"""The decision channel between a router's worker processes and its one routing state (the parent).

Why a channel at all: affinity and the load bound are only as good as the state they read. Worker
processes that each kept their own prefix index and in-flight counts would each see a fraction of the
fleet: a session's next turn parsed by another worker would find no affinity, and N workers would each
let a backend reach the load cap. So the state stays in one process (the parent, which also owns the
serving set, the prober and the admin API) and every worker asks it.

What crosses, and what does not: a worker parses the request, hashes the prompt (``Policy.prepare``) and
relays the bytes; only the decision's inputs cross (the block hashes as packed 64-bit integers, the body's
size, the backends already tried, the session header when the policy keys on one) and one URL comes back.
Release, success and failure are one-way messages on the same ordered stream, so a worker never waits for
them. A 20 KB prompt is ~20 hashes: ~200 bytes each way instead of the prompt.

The frame: ``<u32 payload length><u8 kind><payload>``; every payload layout is defined in
``router.multiprocess.wire`` and nowhere else (one module owns the shape of what two processes exchange).
This module is the parent's side (``WorkerChannel``, ``DecisionService``: the decisions are made here);
``router.multiprocess.remote.RemoteRouting`` is the worker's.

The fleet pause: a generation request's DISPATCH carries the ``HOLD`` flag, and while the parent's
``PauseGate`` is closed the parent delays its answer until resume (one gate for the whole router: its
``max_held`` and ``max_wait_s`` count every worker's requests together). Past either bound it answers
``PAUSE_REFUSED`` with the client's message, which the worker's forwarder turns into the same response a
one-process router gives. A held request whose client goes away is withdrawn (``CANCEL``), so it stops
counting against ``max_held`` at once, as it would in one process.

Weight versions (``router.state.versions``, kept by the parent): an ``OK`` answer carries the chosen
engine's version as the parent knew it then, and the worker's ``RELEASE`` gives that version back with the
request's id, so the parent counts and lists the request if the engine's version changed meanwhile (a
straddler); a release with no version costs nothing more. A DISPATCH gated on a version carries it (flags
``WANT`` and ``AT_LEAST``, the version after the hashes) and the parent decides, holds (after the pause
gate; ``CANCEL`` withdraws it as it does at the gate) or refuses (``UNKNOWN_VERSION`` at once,
``VERSION_REFUSED`` past the bounds), each answered as a one-process router would.

Consumers and fair share (``router.state.fair_share``, kept by the parent): a generation request's DISPATCH
carries its consumer's name and weight (flag ``CONSUMER``, after the hashes), and where the parent keeps a
consumer ledger it takes the consumer's fair-share slot after the pause and version holds, holding the
answer while the fleet is at capacity (``CANCEL`` withdraws it; ``FAIR_SHARE_REFUSED`` past the bound). An
``OK`` answer to such a dispatch means the worker holds a slot, which its ``FINISH`` (one-way, with the
engine's completion tokens) gives back. So the capacity and the shares are those of one router, whatever
the number of workers.

Holds, for the request record (``router.state.holds``): a request the parent held answers ``OK_HELD``
instead of ``OK``, with the seconds it waited at the pause gate and for a fair-share slot (two f32 before
the URL), which the worker puts on its answer (``Chosen.held``) as a one-process router does; a decision
that did not wait is a plain ``OK``, as before.

Moves and version stamps (``router.continuation.moves``): the fleet's side acts on the parent's
``BackendSet`` (an engine drained, held out, removed, restarted; a version stamped), and the parent tells
every worker at once (``MOVE_OFF``, ``VERSION``, one-way, written without waiting for the end of the
turn), whose forwarder moves its requests on that engine or opens a new version span for them, as the
parent's own forwarder does.

A worker that dies leaves requests counted in flight; the parent keeps a ledger per channel and releases
whatever a closed channel still held (backend slots and fair-share slots), so a crashed worker cannot
inflate the load bound, or keep the fleet at capacity, for good. A worker whose channel closes (the parent
died) stops serving and exits: no orphan keeps the port.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from router.consumers import Consumer
from router.multiprocess.wire import (
    CANCEL,
    DISPATCH,
    FAILED,
    FINISH,
    HELLO,
    READY,
    RELEASE,
    STATS,
    SUCCEEDED,
    Framed,
    chosen_frame,
    move_off_frame,
    read_dispatch,
    read_failed,
    read_finish,
    read_hello,
    read_id,
    read_release,
    read_stats,
    read_succeeded,
    refusal_frame,
    stats_ask_frame,
    version_frame,
    withdrawn_frame,
)
from router.policies.base import NoBackendAvailable, RouteRequest
from router.state.fair_share import FairShareRefused
from router.state.holds import Holds
from router.state.pause_gate import PauseRefused
from router.state.routing import LocalRouting
from router.state.versions import UnknownVersion, VersionRefused, VersionWant

log = logging.getLogger(__name__)


# -- the parent's side -------------------------------------------------------------------------------------
class WorkerChannel(Framed):
    """One worker's connection to the routing state, on the parent's loop."""

    def __init__(self, service: DecisionService) -> None:
        super().__init__()
        self.service = service
        self.index = -1
        self.pid = 0
        self.ready = False
        # url -> [requests, body bytes] this worker holds in flight; released if the worker dies.
        self.ledger: dict[str, list[int]] = {}
        self._stats: dict[int, asyncio.Future[bytes]] = {}
        self._next = 0
        # request id -> the task holding that request at the pause gate
        self._held: dict[int, asyncio.Task[None]] = {}
        # consumer -> fair-share slots this worker holds; given back if the worker dies
        self.slots: dict[str, int] = {}

    def on_frame(self, kind: int, payload: bytes) -> None:
        routing = self.service.routing
        if kind == DISPATCH:
            d = read_dispatch(payload)
            rid, exclude, hold, want = d.rid, d.excluded, d.hold, d.want
            header = self.service.session_header
            headers = {header: d.key} if d.key is not None and header is not None else {}
            request = RouteRequest("", b"", headers, d.hashes, d.size)
            consumer = None
            if d.consumer is not None and hold and routing.fair is not None:
                consumer = Consumer(d.consumer[0], "", d.consumer[1])
            if consumer is not None:
                try:
                    admitted = routing.enter_now(exclude, want, consumer)
                except (UnknownVersion, NoBackendAvailable) as exc:
                    self._refuse(rid, exc)
                    return
                if admitted is None:
                    self._hold_task(rid, self._enter(rid, request, exclude, want, consumer))
                    return
                self._decide(rid, request, admitted, consumer.name)
                return
            if want is not None or (hold and routing.gate.paused):  # the one check when neither
                try:
                    admitted = routing.admit_now(exclude, hold, want)
                except (UnknownVersion, NoBackendAvailable) as exc:
                    self._refuse(rid, exc)
                    return
                if admitted is None:
                    self._hold_task(rid, self._hold(rid, request, exclude, hold, want))
                    return
                exclude = admitted
            self._decide(rid, request, exclude)
        elif kind == CANCEL:
            rid = read_id(payload)
            task = self._held.pop(rid, None)
            if task is not None:  # else answered already: the worker gives that answer back
                task.cancel()
                self.send(withdrawn_frame(rid))
        elif kind == RELEASE:
            size, url, version, request_id = read_release(payload)
            if version is not None:
                routing.release(url, size, version, request_id)
            else:
                routing.release(url, size)
            held = self.ledger.get(url)
            if held is not None:
                held[0] -= 1
                held[1] -= size
                if held[0] <= 0:
                    del self.ledger[url]
        elif kind == FINISH:
            tokens, counted, name = read_finish(payload)
            held_slots = self.slots.get(name, 0)
            if held_slots > 0:  # only a slot this worker holds (a stray frame frees nobody else's)
                if held_slots == 1:
                    del self.slots[name]
                else:
                    self.slots[name] = held_slots - 1
                routing.finish(name, tokens, counted)
        elif kind == SUCCEEDED:
            routing.succeeded(read_succeeded(payload))
        elif kind == FAILED:
            url, failure, hashes = read_failed(payload)
            request = RouteRequest("", b"", {}, hashes, 0)
            if failure:
                routing.failed(request, url, failure)
            else:
                routing.policy.retract(request, url)
        elif kind == STATS:
            rid, samples = read_stats(payload)
            future = self._stats.pop(rid, None)
            if future is not None and not future.done():
                future.set_result(samples)
        elif kind == HELLO:
            self.index, self.pid = read_hello(payload)
        elif kind == READY:
            self.ready = True
            self.service.on_ready(self)
        else:
            log.error("router worker %d sent an unknown frame kind %d; closing its channel", self.index, kind)
            if self.transport is not None:
                self.transport.close()

    def _hold_task(self, rid: int, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._held[rid] = task
        task.add_done_callback(lambda _t, rid=rid: self._held.pop(rid, None))

    def _decide(
        self,
        rid: int,
        request: RouteRequest,
        exclude: frozenset[str],
        consumer: str | None = None,
        holds: dict[str, float] | None = None,
    ) -> None:
        """Choose and answer. ``consumer``: the request holds that consumer's fair-share slot, which
        becomes this worker's (given back by its FINISH), or is given back here with no backend.
        ``holds``: what held the request before this decision (answered ``OK_HELD``)."""
        routing = self.service.routing
        try:
            url = routing.dispatch_now(request, exclude)
        except NoBackendAvailable as exc:
            if consumer is not None:
                routing.finish(consumer, 0, counted=False)
            self.send(refusal_frame(rid, exc))
            return
        if consumer is not None:
            self.slots[consumer] = self.slots.get(consumer, 0) + 1
        held = self.ledger.get(url)
        if held is None:
            self.ledger[url] = [1, request.size]
        else:
            held[0] += 1
            held[1] += request.size
        self.send(chosen_frame(rid, url, routing.versions.of.get(url), holds))

    def _refuse(self, rid: int, exc: Exception) -> None:
        self.send(refusal_frame(rid, exc))

    async def _hold(
        self, rid: int, request: RouteRequest, exclude: frozenset[str], hold: bool, want: VersionWant | None
    ) -> None:
        """Answer once the fleet resumes (in arrival order across all workers) and an engine has the
        wanted version, or refuse past the bounds; cancelled by the worker's CANCEL or when its channel
        closes."""
        holds = Holds()  # the seconds the gate held it, answered with the decision
        try:
            exclude = await self.service.routing.admit(exclude, hold, want, holds)
        except (PauseRefused, UnknownVersion, VersionRefused, NoBackendAvailable) as exc:
            self._refuse(rid, exc)
            return
        self._decide(rid, request, exclude, None, holds)

    async def _enter(
        self,
        rid: int,
        request: RouteRequest,
        exclude: frozenset[str],
        want: VersionWant | None,
        consumer: Consumer,
    ) -> None:
        """``_hold`` for a request of a consumer: the holds, then its fair-share slot (in the order the
        fair share grants slots across all workers), or a refusal past the bounds."""
        holds = Holds()  # the seconds the gate and the fair share held it, answered with the decision
        try:
            exclude = await self.service.routing.enter(exclude, want, consumer, holds)
        except (PauseRefused, UnknownVersion, VersionRefused, NoBackendAvailable, FairShareRefused) as exc:
            self._refuse(rid, exc)
            return
        self._decide(rid, request, exclude, consumer.name, holds)

    def cancel_held(self) -> None:
        """Stop holding this worker's requests (its channel closed, or the router stops)."""
        for task in list(self._held.values()):
            task.cancel()
        self._held.clear()

    async def ask_stats(self, timeout_s: float) -> bytes | None:
        """The worker's own metric samples (``router.state.metrics.per_request_snapshot``), or None."""
        self._next += 1
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._stats[self._next] = future
        self.send(stats_ask_frame(self._next))
        try:
            return await asyncio.wait_for(future, timeout_s)
        except (TimeoutError, ConnectionError):
            return None
        finally:
            self._stats.pop(self._next, None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_held()
        routing = self.service.routing
        for url, (count, size) in self.ledger.items():
            routing.release(url, size)
            for _ in range(count - 1):
                routing.release(url, 0)
        self.ledger.clear()
        for name, count in self.slots.items():
            for _ in range(count):
                routing.finish(name, 0, counted=False)
        self.slots.clear()
        for future in self._stats.values():
            if not future.done():
                future.set_exception(ConnectionError("worker channel closed"))
        self.service.on_lost(self)


class DecisionService:
    """The routing state served to worker processes over a Unix socket (on the parent's loop)."""

    def __init__(self, routing: LocalRouting) -> None:
        self.routing = routing
        self.session_header: str | None = getattr(routing.policy, "session_header", None)
        self.channels: set[WorkerChannel] = set()
        self._ready_waiters: list[Callable[[WorkerChannel], None]] = []

    def channel(self) -> WorkerChannel:
        ch = WorkerChannel(self)
        self.channels.add(ch)
        return ch

    def on_ready(self, channel: WorkerChannel) -> None:
        for waiter in list(self._ready_waiters):
            waiter(channel)

    def watch_ready(self, callback: Callable[[WorkerChannel], None]) -> None:
        self._ready_waiters.append(callback)

    def on_lost(self, channel: WorkerChannel) -> None:
        self.channels.discard(channel)

    def ready_channels(self) -> list[WorkerChannel]:
        return sorted((c for c in self.channels if c.ready), key=lambda c: c.index)

    def move_off(self, url: str, reason: str) -> int:
        """Tell every worker to move its requests off ``url`` (``router.continuation.moves``), written at
        once: a drain does not wait for the next turn. The workers count their own; 0 here."""
        self._broadcast(move_off_frame(url, reason))
        return 0

    def version_changed(self, url: str, version: str) -> None:
        """Tell every worker ``url`` now serves ``version`` (its requests' per-token version spans)."""
        self._broadcast(version_frame(url, version))

    def _broadcast(self, data: bytes) -> None:
        for channel in self.channels:
            channel.send_now(data)

    def close(self) -> None:
        """Stop holding requests at the pause gate: the router is stopping."""
        for channel in list(self.channels):
            channel.cancel_held()
