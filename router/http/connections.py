"""Client connections of the router's HTTP server: a cap on how many are open, a deadline per head, and a
small pool for the connections that have presented no key.

aiohttp's server has neither: a connection that opens and then sends a request head one byte a minute
(or nothing at all) is held until its keep-alive timer, and nothing bounds how many are open. A few
hundred such connections exhaust the process's descriptors and real requests fail (slowloris).

The cap alone was not enough: any local user, with no key, held every connection of it with idle
keep-alive ``/health`` connections, and every consumer's next connection was closed at accept (issue 38).
So where the application checks keys (``router.http.keyed.KeyedRouteTable``) the gate keeps three pools:

* *pending*: admitted, no request ended yet. Every connection starts here: at accept nobody knows whether
  it will authenticate.
* *keyless*: it has made requests, none authenticated (``/health``, ``/metrics``, a 401). At most
  ``keyless_pool(cap)`` of them (5 %, at least 4); one more is answered and closed. Closed after
  ``keyless_idle_timeout_s`` idle (aiohttp's keep-alive timer) and after ``keyless_max_requests``.
* *keyed*: a request on it passed its route's check (``promote``); the rest of the cap, with the full
  keep-alive. A promotion past it is refused (the no-healthy status) and that connection closed.

A new connection is never refused while an unauthenticated one could make room: at the cap, the oldest
idle keyless connection is closed for it, else the oldest idle pending one, else the oldest unauthenticated
one (``keyless_evicted``). A connection that has sent its first head is not idle, so a consumer's new
connection is closed only if as many unauthenticated connections as the cap leaves them arrive before its
first head does; keyed connections are never closed for another. Any 401 closes its connection: a bad
key gets one answer per connection.

``GuardedRequestHandler`` is aiohttp's own ``RequestHandler`` with these additions; ``GuardedSockSite``
serves the already-bound listening socket with it. Both read aiohttp internals (``_request_count``,
``_request_in_progress``, ``_messages``, ``_next_keepalive_close_time``, ``finish_response``), which is why
tests/component/test_router_hardening_http.py and test_keyless_connections.py pin the behaviour with real
sockets: an aiohttp upgrade that changes them fails those tests instead of silently removing the guard.
Without key checks (the driver's own listeners) every admitted connection is keyed, as before.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from router.http.limits import HttpLimits, keyless_pool

PENDING = "pending"
KEYLESS = "keyless"
KEYED = "keyed"
EVICTION_SCAN = 64
"""How many of a pool's oldest connections are looked at for an idle one before taking the oldest."""


class ConnectionGate:
    """Counts open client connections against a cap, in pools (module doc); reports refusals, evictions
    and head timeouts by kind. And per consumer (``by_consumer``), the connections each has made an
    authenticated request on (``GuardedRequestHandler.claim``): the keyed part of the cap is one for every
    consumer, so ``router.http.consumer_limits`` bounds each one's part of it.

    ``keyless``: the limits whose ``keyless_*`` settings apply; None where nothing checks keys (every
    admitted connection is keyed, as before the pools)."""

    def __init__(
        self, cap: int, on_event: Callable[[str], None] = lambda kind: None, keyless: HttpLimits | None = None
    ) -> None:
        self.cap = cap
        self.on_event = on_event
        self.by_consumer: dict[str, int] = {}
        self.pools = keyless is not None
        self.keyless_cap = keyless_pool(cap, keyless.keyless_share) if keyless is not None else 0
        self.keyed_cap = cap - self.keyless_cap
        self.keyless_idle_s = keyless.keyless_idle_timeout_s if keyless is not None else None
        self.keyless_max_requests = keyless.keyless_max_requests if keyless is not None else 0
        self.keyed = 0
        # Insertion-ordered: the oldest first.
        self.pending: dict[GuardedRequestHandler, None] = {}
        self.keyless: dict[GuardedRequestHandler, None] = {}

    @property
    def open(self) -> int:
        return self.keyed + len(self.pending) + len(self.keyless)

    def admit(self, handler: GuardedRequestHandler) -> bool:
        """A new connection: in (pending; keyed without pools), making room if it must; False: refused."""
        if not self.pools:
            if self.keyed >= self.cap:
                self.on_event("connection_cap")
                return False
            self.keyed += 1
            handler._pool = KEYED
            return True
        if self.open >= self.cap and not self._evict():
            self.on_event("connection_cap")
            return False
        self.pending[handler] = None
        handler._pool = PENDING
        return True

    def promote(self, handler: GuardedRequestHandler) -> bool:
        """``handler``'s request passed its check: into the keyed pool; False (nothing moved) when full."""
        if handler._pool == KEYED:
            return True
        if self.keyed >= self.keyed_cap:
            self.on_event("connection_cap")
            return False
        self._forget(handler)
        self.keyed += 1
        handler._pool = KEYED
        return True

    def ended_unauthenticated(self, handler: GuardedRequestHandler) -> bool:
        """A request that authenticated nothing ends on ``handler``'s connection (not keyed): whether the
        connection may be kept alive after it (False: the answer closes it)."""
        if handler._pool == PENDING:
            if len(self.keyless) >= self.keyless_cap:
                return False
            del self.pending[handler]
            self.keyless[handler] = None
            handler._pool = KEYLESS
        handler._keyless_requests += 1
        return handler._keyless_requests < self.keyless_max_requests

    def leave(self, handler: GuardedRequestHandler) -> None:
        self._forget(handler)
        handler._pool = None

    def _forget(self, handler: GuardedRequestHandler) -> None:
        if handler._pool == KEYED:
            self.keyed -= 1
        elif handler._pool == PENDING:
            self.pending.pop(handler, None)
        elif handler._pool == KEYLESS:
            self.keyless.pop(handler, None)

    def _evict(self) -> bool:
        """Close one unauthenticated connection to make room (module doc for which); False: none."""
        victim = (
            _first_idle(self.keyless)
            or _first_idle(self.pending)
            or next(iter(self.pending), None)
            or next(iter(self.keyless), None)
        )
        if victim is None:
            return False
        self.leave(victim)
        victim.force_close()
        self.on_event("keyless_evicted")
        return True

    def disown(self, consumer: str) -> None:
        n = self.by_consumer.get(consumer, 0) - 1
        if n > 0:
            self.by_consumer[consumer] = n
        else:
            self.by_consumer.pop(consumer, None)


def _first_idle(pool: dict[GuardedRequestHandler, None]) -> GuardedRequestHandler | None:
    for i, handler in enumerate(pool):
        if i >= EVICTION_SCAN:
            return None
        if handler.idle:
            return handler
    return None


class GuardedRequestHandler(RequestHandler):
    """aiohttp's request handler, plus: refused above the gate's cap (or admitted by closing an
    unauthenticated connection), closed when a request head is not complete ``head_timeout_s`` after its
    first byte (or after the connection opened), the gate's pools (module doc)."""

    def __init__(self, manager: web.Server, *, gate: ConnectionGate, head_timeout_s: float, **kwargs: Any):
        keepalive_s = float(kwargs.get("keepalive_timeout", 75.0))
        if gate.keyless_idle_s is not None:
            # aiohttp reads its keep-alive once per connection: it is the keyless deadline, and a keyed
            # connection's timer is pushed back by the difference (``_process_keepalive``).
            kwargs["keepalive_timeout"] = min(keepalive_s, gate.keyless_idle_s)
        super().__init__(manager, **kwargs)
        self._keyed_extra_s = keepalive_s - self._keepalive_timeout
        self._gate = gate
        self._head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._last_body: Any = None  # the payload of the last request parsed (its body, as it arrives)
        self._pool: str | None = None  # set by the gate; None: not (or no longer) counted
        self._keyless_requests = 0
        self._consumer: str | None = None

    @property
    def gate(self) -> ConnectionGate:
        return self._gate

    @property
    def idle(self) -> bool:
        """No request being handled nor parsed and waiting: what may be closed for a new connection."""
        return not self._request_in_progress and not self._messages

    def promote(self) -> bool:
        """This connection's request passed its route's check (``router.http.keyed``): keyed from now on;
        False when the keyed pool is full (the caller refuses the request and closes the connection)."""
        return self._pool is None or self._gate.promote(self)

    def claim(self, consumer: str, cap: int) -> bool:
        """Count this connection as ``consumer``'s (its request just authenticated as that consumer);
        False, counting nothing, when the consumer already has ``cap`` connections in this process."""
        if self._consumer == consumer:
            return True
        gate = self._gate
        if gate.by_consumer.get(consumer, 0) >= cap:
            return False
        if self._consumer is not None:
            gate.disown(self._consumer)
        self._consumer = consumer
        gate.by_consumer[consumer] = gate.by_consumer.get(consumer, 0) + 1
        return True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if not self._gate.admit(self):
            self.force_close()
            return
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        before = self._request_count
        in_body = self._last_body is not None and not self._last_body.is_eof()
        super().data_received(data)
        if self._request_count != before:
            if self._messages:
                self._last_body = self._messages[-1][1]  # start() pops it only after this call
            if self._head_timer is not None:
                self._head_timer.cancel()  # a complete head was parsed
                self._head_timer = None
        elif (
            self._head_timer is None and not self._request_in_progress and not self._messages and not in_body
        ):
            # A head begun and not finished on a kept-alive connection. Armed only now, so the common
            # case (a whole head in one read) costs no timer at all. Not for the rest of the last
            # request's body: between start() taking a request off the queue and its handler starting,
            # neither is in progress, and a body read then armed a deadline nothing cancelled, closing
            # the connection mid-answer head_timeout_s later (CI: two 800-token generations cut at 10 s).
            self._arm_head_deadline()

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        pool = self._pool
        if pool is not None and self._gate.pools:
            close = resp.status == 401  # a bad or missing key: one answer per connection
            if not close and pool != KEYED:
                close = not self._gate.ended_unauthenticated(self)
            if close:
                resp.force_close()
        return await super().finish_response(request, resp, start_time)

    def _process_keepalive(self) -> None:
        if self._pool == KEYED and self._keyed_extra_s > 0:
            late = self._next_keepalive_close_time + self._keyed_extra_s
            if self._loop.time() < late:
                self._keepalive_handle = self._loop.call_at(late, self._process_keepalive)
                return
        super()._process_keepalive()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._pool is not None:
            self._gate.leave(self)
        if self._consumer is not None:
            self._gate.disown(self._consumer)
            self._consumer = None
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        self._head_timer = self._loop.call_later(self._head_timeout_s, self._head_deadline_passed)

    def _head_deadline_passed(self) -> None:
        self._head_timer = None
        self._gate.on_event("head_timeout")
        self.force_close()


class GuardedSockSite(web.SockSite):
    """``web.SockSite`` whose connections are ``GuardedRequestHandler``s built with ``handler_kwargs``
    (the same keyword arguments the runner was given, which aiohttp's own factory would pass)."""

    def __init__(
        self,
        runner: web.BaseRunner,
        sock: socket.socket,
        *,
        gate: ConnectionGate,
        head_timeout_s: float,
        handler_kwargs: dict[str, Any],
        shutdown_timeout: float = 1.0,
        backlog: int = 2048,
    ) -> None:
        super().__init__(runner, sock, shutdown_timeout=shutdown_timeout, backlog=backlog)
        self._gate = gate
        self._head_timeout_s = head_timeout_s
        self._handler_kwargs = handler_kwargs

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        gate, head_timeout_s, kwargs = self._gate, self._head_timeout_s, self._handler_kwargs

        def factory() -> GuardedRequestHandler:
            return GuardedRequestHandler(
                server, loop=loop, gate=gate, head_timeout_s=head_timeout_s, **kwargs
            )

        self._server = await loop.create_server(factory, sock=self._sock, backlog=self._backlog)
