"""Client connections of the router's HTTP server: a cap on how many are open and a deadline per head.

aiohttp's server has neither: a connection that opens and then sends a request head one byte a minute
(or nothing at all) is held until its keep-alive timer, and nothing bounds how many are open. A few
hundred such connections exhaust the process's descriptors and real requests fail (slowloris).

``GuardedRequestHandler`` is aiohttp's own ``RequestHandler`` with two additions; ``GuardedSockSite``
serves the already-bound listening socket with it. Both read aiohttp internals (``_request_count``,
``_request_in_progress``, ``_messages``), which is why tests/component/test_router_hardening.py pins the
behaviour with real sockets: an aiohttp upgrade that changes them fails those tests instead of silently
removing the guard.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler


class ConnectionGate:
    """Counts open client connections against a cap; reports refusals and head timeouts by kind. And
    per consumer (``by_consumer``), the connections each has made an authenticated request on
    (``GuardedRequestHandler.claim``): the cap is one for every consumer, so ``router.http.consumer_limits``
    bounds each one's part of it."""

    def __init__(self, cap: int, on_event: Callable[[str], None] = lambda kind: None) -> None:
        self.cap = cap
        self.open = 0
        self.on_event = on_event
        self.by_consumer: dict[str, int] = {}

    def admit(self) -> bool:
        if self.open >= self.cap:
            self.on_event("connection_cap")
            return False
        self.open += 1
        return True

    def leave(self) -> None:
        self.open -= 1

    def disown(self, consumer: str) -> None:
        n = self.by_consumer.get(consumer, 0) - 1
        if n > 0:
            self.by_consumer[consumer] = n
        else:
            self.by_consumer.pop(consumer, None)


class GuardedRequestHandler(RequestHandler):
    """aiohttp's request handler, plus: refused above the gate's cap, closed when a request head is not
    complete ``head_timeout_s`` after its first byte (or after the connection opened)."""

    def __init__(self, manager: web.Server, *, gate: ConnectionGate, head_timeout_s: float, **kwargs: Any):
        super().__init__(manager, **kwargs)
        self._gate = gate
        self._head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._admitted = False
        self._consumer: str | None = None

    @property
    def gate(self) -> ConnectionGate:
        return self._gate

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
        if not self._gate.admit():
            self.force_close()
            return
        self._admitted = True
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        before = self._request_count
        super().data_received(data)
        if self._request_count != before:
            if self._head_timer is not None:
                self._head_timer.cancel()  # a complete head was parsed
                self._head_timer = None
        elif self._head_timer is None and not self._request_in_progress and not self._messages:
            # A head begun and not finished on a kept-alive connection. Armed only now, so the common
            # case (a whole head in one read) costs no timer at all.
            self._arm_head_deadline()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._admitted:
            self._admitted = False
            self._gate.leave()
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
