"""The worker's side of the decision channel: ``RemoteRouting``, the routing state a worker routes with.

A worker process's ``Forwarder`` asks its ``RoutingState`` where to, and here the answer comes from the
router's parent process (``router.multiprocess.decisions``, which tells why the state lives there), over
the frames of ``router.multiprocess.wire``. It answers as ``LocalRouting`` would: the same ``Chosen``
(what held the request included, from an ``OK_HELD``), the same refusals, raised from the parent's
message. Release, success, failure and finish are one-way frames; release and failure are written at
once rather than batched, because the client may send its next request through another worker the
moment it has this answer. A client that goes away while its request is held sends ``CANCEL``. A closed
channel (the parent died) fails every pending dispatch and tells the worker to stop (``on_lost``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from router.consumers import Consumer
from router.multiprocess.wire import (
    CHOSEN,
    MOVE_OFF,
    STATS_ASK,
    VERSION,
    Framed,
    cancel_frame,
    chose,
    dispatch_frame,
    failed_frame,
    finish_frame,
    hello_frame,
    read_choice,
    read_chosen,
    read_id,
    read_move_off,
    read_refusal,
    read_version,
    ready_frame,
    release_frame,
    stats_frame,
    succeeded_frame,
)
from router.policies.base import NoBackendAvailable, Policy, RouteRequest
from router.state.routing import Chosen
from router.state.versions import VersionWant

if TYPE_CHECKING:
    from router.continuation.moves import EngineWatch


class RemoteRouting(Framed):
    """``RoutingState`` answered by the parent: what a worker process's ``Forwarder`` routes with."""

    def __init__(self, policy: Policy, on_lost: Callable[[], None], stats: Callable[[], Any]) -> None:
        super().__init__()
        self._session_header: str | None = getattr(policy, "session_header", None)
        self._on_lost = on_lost
        self._stats = stats
        # request id -> (its answer, the request, the consumer whose fair-share slot an OK answer holds)
        self._pending: dict[int, tuple[asyncio.Future[Chosen], RouteRequest, str | None]] = {}
        self._next = 0
        self.closed = False
        self.engine_watch: EngineWatch | None = None
        """The worker's forwarder's tracked attempts: the parent's ``MOVE_OFF`` and ``VERSION`` reach them."""

    def hello(self, index: int, pid: int) -> None:
        self.send(hello_frame(index, pid))

    def ready(self) -> None:
        self.send(ready_frame())

    async def dispatch(
        self,
        request: RouteRequest,
        exclude: frozenset[str],
        hold: bool = False,
        want: VersionWant | None = None,
        consumer: Consumer | None = None,
    ) -> Chosen:
        if self.closed:
            raise NoBackendAvailable("the router's routing state is gone (parent process stopped)")
        self._next = rid = (self._next + 1) & 0xFFFFFFFF
        key = b""
        if self._session_header is not None:
            value = request.headers.get(self._session_header)
            key = value.encode() if value else b""
        sent = (consumer.name, consumer.weight) if hold and consumer is not None else None
        future: asyncio.Future[Chosen] = asyncio.get_running_loop().create_future()
        self._pending[rid] = (future, request, sent[0] if sent is not None else None)
        self.send(dispatch_frame(rid, request.size, exclude, key, request.features, hold, sent, want))
        if not hold:
            return await future
            # A cancelled wait leaves the entry: its answer is then released at once (see on_frame).
        try:
            return await future
        except asyncio.CancelledError:
            # The client went away, perhaps while held at the pause gate: withdraw it there (the parent
            # answers WITHDRAWN, or has answered already and that answer is given back in on_frame).
            if rid in self._pending:
                self.send(cancel_frame(rid))
            raise

    def release(
        self, url: str, weight: int, dispatched_on: str | None = None, request_id: str | None = None
    ) -> None:
        # Written at once, not at the end of the loop turn: the forwarder releases before the client
        # gets the end of its answer, and this frame must be on its way before the client's next turn
        # can reach the routing state through another worker (see router.http.slots.Slot).
        self.send(release_frame(weight, url, dispatched_on, request_id))
        self._flush()

    def succeeded(self, url: str) -> None:
        self.send(succeeded_frame(url))

    def finish(self, consumer: str, completion_tokens: int = 0, counted: bool = True) -> None:
        # Batched with the release that follows it on the success path (which flushes at once).
        self.send(finish_frame(consumer, completion_tokens, counted))

    def failed(self, request: RouteRequest, url: str, kind: str) -> None:
        # Written at once, like a release: a broken answer is cut right after this call, and the failure
        # must be on its way to the routing state (health counts, ejection, forgotten affinity) before the
        # client can see the cut and retry through another worker.
        self._send_failed(request, url, kind)
        self._flush()

    def _send_failed(self, request: RouteRequest, url: str, kind: str) -> None:
        self.send(failed_frame(url, kind, request.features))

    def on_frame(self, kind: int, payload: bytes) -> None:
        if kind == CHOSEN:
            rid, ok = read_chosen(payload)
            entry = self._pending.pop(rid, None)
            if entry is None:
                return
            future, request, consumer = entry
            if chose(ok):
                chosen = read_choice(payload, ok)
                url = chosen.url
                if future.cancelled():
                    # The client went away while the parent decided: the slot it counted is given back
                    # and the affinity it recorded is forgotten (nothing was sent to that backend).
                    if consumer is not None:
                        self.finish(consumer, 0, counted=False)
                    self.release(url, request.size)
                    self._send_failed(request, url, "")
                else:
                    future.set_result(chosen)
                return
            if future.cancelled():
                return
            future.set_exception(read_refusal(payload, ok))
        elif kind == STATS_ASK:
            rid = read_id(payload)
            self.send(stats_frame(rid, orjson.dumps(self._stats())))
        elif kind == MOVE_OFF:
            if self.engine_watch is not None:
                self.engine_watch.move_off(*read_move_off(payload))
        elif kind == VERSION:
            if self.engine_watch is not None:
                self.engine_watch.version_changed(*read_version(payload))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        for future, _request, _consumer in self._pending.values():
            if not future.done():
                future.set_exception(NoBackendAvailable("the router's routing state is gone"))
        self._pending.clear()
        self._on_lost()
