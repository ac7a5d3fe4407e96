"""An HTTP listener of the driver's own: an aiohttp app on its own event loop thread, behind the router's
connection guards.

The driver's listeners (``status_server``; the fleet endpoint beside vllm-router) bind the node's address,
so anyone on the cluster reaches them. A listener with one thread per connection and no timeout
(``http.server``) was held by 300 idle connections (300 threads, still there 30 s later), and an aiohttp
``TCPSite`` by as many descriptors, for as long as the peer liked. So these serve with the router's own
guards, not a second copy of them (``router.http.app.serve_guarded``: a request head not complete
``head_timeout_s`` after the connection opened closes it, and connections above the cap are closed on
accept), on one event loop (an idle connection costs a descriptor, never a thread), with limits sized for
a handful of callers: a deadline no real client needs, a keep-alive long enough for a poller, and a cap
well above a few hundred (a flood of idle connections below it does not refuse real requests) yet far
below the descriptors the driver needs for Ray and its engines.

The socket is bound in the constructor: a port conflict fails there, naming the address, and the URL is
never handed out before something listens on it.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from aiohttp import web

from router.http.app import bind_listening_socket, serve_guarded
from router.http.connections import ConnectionGate
from router.http.limits import HttpLimits

T = TypeVar("T")

LISTENER_LIMITS = HttpLimits(head_timeout_s=5.0, keepalive_timeout_s=15.0, max_client_connections=512)
_CALL_TIMEOUT_S = 10.0


class DriverListener:
    """``start(make_app)`` serves the app ``make_app`` builds (on the listener's loop, so whatever the app
    creates belongs to it); ``run(coro)`` runs a coroutine there from any thread; ``stop`` is idempotent."""

    def __init__(self, name: str, host: str, port: int, limits: HttpLimits = LISTENER_LIMITS) -> None:
        self.name = name
        self.host = host
        self.limits = limits
        try:
            self._sock = bind_listening_socket(host, port)
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise OSError(exc.errno, f"{name}: cannot listen on {host}:{port}: {reason}") from None
        self.port = int(self._sock.getsockname()[1])  # the OS's choice when given port 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._runner: web.AppRunner | None = None
        self.gate: ConnectionGate | None = None
        """Open client connections (``gate.open``) against the cap, once started."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, make_app: Callable[[], web.Application]) -> None:
        self._thread.start()
        try:
            self.run(self._serve(make_app))
        except BaseException:
            self.stop()
            raise

    async def _serve(self, make_app: Callable[[], web.Application]) -> None:
        self._runner, self.gate = await serve_guarded(make_app(), self._sock, self.limits, None)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = _CALL_TIMEOUT_S) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def stop(self) -> None:
        """Close the listener and its connections and end the loop's thread."""
        if self._thread.is_alive():
            if self._runner is not None:
                try:
                    self.run(self._runner.cleanup())
                except Exception:  # stopping anyway: the thread is a daemon
                    pass
                self._runner = None
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()
        self._sock.close()
