"""The router's HTTP application and how it is served, shared by every process that answers the port.

The one-process router, each worker process (``router.multiprocess.workers``) and the launcher driver's small
listeners build and serve their applications here, so the guards are one copy: the route set with each
route's access mark (``build_app``), the listening socket (``bind_listening_socket``) and the server
settings with the head deadline and the connection cap (``serve_guarded``).

Binding choices, each against a failure clients cannot recover from on their own:

* ``SO_REUSEADDR`` lets a restarted process (a Ray actor with ``max_restarts=-1``) rebind the same port
  while the old connections sit in TIME_WAIT; it does not allow two live listeners, so a real conflict
  still fails. ``retry_s`` covers the moment where the dying process still holds the socket.
* A failure raises ``RouterBindError`` naming host:port and what to do.

It imports neither the router (``router.server``) nor its worker processes
(``router.multiprocess.workers``): both build on it (before, each imported the other).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import time
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from router.consumers import ConsumerKeys
from router.http.auth import ROUTE_TABLE, Access, Credentials, RouteTable
from router.http.capability import capability_path, stripped
from router.http.connections import ConnectionGate, GuardedSockSite
from router.http.consumer_limits import ConsumerLimits
from router.http.forwarding import Forwarder
from router.http.keyed import KeyedRouteTable
from router.http.limits import HttpLimits, effective_connection_cap, raise_open_file_limit
from router.http.status import error_body
from router.state.metrics import RouterMetrics

# The OpenAI/vLLM routes Gym and similar clients use. Engines are advertised as http://h:p/v1, so the
# inbound path is appended to the backend's origin: /v1/chat/completions -> http://h:p/v1/chat/completions
# and Gym's bare /tokenize (base URL minus /v1) -> http://h:p/tokenize.
PROXIED_ROUTES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("/v1/chat/completions", ("POST",)),
    ("/v1/completions", ("POST",)),
    ("/v1/responses", ("POST",)),
    ("/v1/models", ("GET",)),
    ("/tokenize", ("POST",)),
    ("/detokenize", ("POST",)),
)


class RouterBindError(OSError):
    """The router could not bind its address; the message names host:port and what to do."""


def bind_listening_socket(
    host: str, port: int, retry_s: float = 0.0, backlog: int = 2048, reuse_port: bool = False
) -> socket.socket:
    """Bind and listen on ``host:port`` now; raise ``RouterBindError`` naming the address on failure.

    ``reuse_port``: bind beside the launcher's placeholder for this port (``RouterConfig.port_held``).
    Linux lets a second ``SO_REUSEPORT`` socket bind only for the same user, and the placeholder never
    listens, so connections reach this socket alone; another user cannot bind the port at all, also in
    the moment between a router's death and its restart (Gym's next request, with the job's key, would
    otherwise go to whoever took the port)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"router port must be in 0..65535, got {port}")
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        family = socket.AF_INET  # a host name: resolved by bind()
    deadline = time.monotonic() + retry_s
    while True:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            sock.listen(backlog)
            sock.setblocking(False)
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            reason = (
                "address already in use (another router or process holds it)"
                if exc.errno == errno.EADDRINUSE
                else exc.strerror or str(exc)
            )
            raise RouterBindError(
                exc.errno,
                f"cannot bind the generation router to {host}:{port}: {reason}; "
                "choose another port or stop the process holding it",
            ) from exc


def runner_kwargs(limits: HttpLimits) -> dict[str, Any]:
    """How every HTTP server of the router handles requests.

    handler_cancellation: a client that disconnects cancels its handler, so the upstream request is
    aborted and its slot released at once instead of running (and being retried) for nobody.
    auto_decompress off: a gzip body is forwarded as sent, with its Content-Encoding, and never
    inflated in the router's memory (58 KB of gzip can be 60 MB)."""
    return {
        "handle_signals": False,
        "handler_cancellation": True,
        **handler_kwargs(limits),
    }


def handler_kwargs(limits: HttpLimits) -> dict[str, Any]:
    """lingering_time: a body no handler read is drained (and discarded) for at most the body deadline,
    then the connection is closed (``router.http.bodies``)."""
    return {
        "access_log": None,
        "keepalive_timeout": limits.keepalive_timeout_s,
        "auto_decompress": False,
        "lingering_time": limits.body_timeout_s,
    }


async def serve_guarded(
    app: web.Application,
    sock: socket.socket,
    limits: HttpLimits,
    metrics: RouterMetrics | None,
    share: int = 1,
) -> tuple[web.AppRunner, ConnectionGate]:
    """Serve ``app`` on the bound ``sock`` with the head deadline and the connection cap. ``share``: the
    number of processes accepting on ``sock``; each admits its share of the cap, so the router as a whole
    keeps the configured one. ``metrics``: where refusals and head timeouts are counted (None: nowhere;
    the launcher driver's own small listeners have no metrics). An application whose routes promote
    their connections (``build_app``'s ``KeyedRouteTable``) is served with the gate's pools: connections
    that presented no key get a small share of the cap (``router.http.connections``)."""
    runner = web.AppRunner(app, **runner_kwargs(limits))
    await runner.setup()
    cap = effective_connection_cap(limits, raise_open_file_limit())

    def count(kind: str) -> None:
        if metrics is not None:
            metrics.errors.labels(kind).inc()

    keyed = isinstance(app.get(ROUTE_TABLE), KeyedRouteTable)
    gate = ConnectionGate(max(1, -(-cap // share)), on_event=count, keyless=limits if keyed else None)
    site = GuardedSockSite(
        runner, sock, gate=gate, head_timeout_s=limits.head_timeout_s, handler_kwargs=handler_kwargs(limits)
    )
    await site.start()
    return runner, gate


def build_app(
    forwarder: Forwarder,
    api_key: str | None,
    admin_token: str | None,
    max_request_bytes: int,
    limits: HttpLimits,
    rest: Callable[[RouteTable], None],
    consumers: ConsumerKeys | None = None,
    capability: str | None = None,
) -> web.Application:
    """The proxied routes on ``forwarder`` (client routes); ``rest`` adds everything else through the
    same ``RouteTable`` (the admin API in the router that owns the routing state, ``/health`` and the
    relay to it in a worker process). Each route is checked as its mark says (``router.http.auth``), and the
    application does not start with a route registered without a mark. ``consumers``: the keys of the
    consumers file, which the routes then take too (``router.http.auth``), and each consumer's part of
    this process's connections and memory is bounded (``router.http.consumer_limits``). ``capability``:
    the proxied routes are served under ``/t/<capability>`` too (``router.http.capability``). No middleware:
    each layer costs every request a coroutine call and a handler chain."""
    app = web.Application(client_max_size=max_request_bytes)
    if consumers is not None:
        # Every process that serves the port bounds each consumer's part of its connections and memory.
        status = forwarder.config.no_healthy_backend_status
        forwarder.consumer_limits = ConsumerLimits(
            consumers, limits, max_request_bytes, status, forwarder.metrics
        )
    # Each checked route moves its connection to the keyed pool once its check passed (router.http.keyed).
    credentials = Credentials(api_key, admin_token, limits.body_timeout_s, consumers, capability)
    table = KeyedRouteTable(app, credentials, forwarder.config.no_healthy_backend_status)
    proxied = PROXIED_ROUTES
    if forwarder.adapters is not None:  # the router answers it per caller (router.fleet.adapter_routes)
        proxied = tuple(r for r in PROXIED_ROUTES if r[0] != "/v1/models")
    for path, methods in proxied:
        for method in methods:
            # The model list takes the admin keys too (``Access.LISTING``); generation, the client's.
            access = Access.LISTING if path == "/v1/models" else Access.CLIENT
            table.add(method, path, forwarder.handle, access)
    if capability is not None:
        # The same routes under the job's capability, for a trainer that sends no key of ours
        # (router.http.capability); the forwarder sees the path after the prefix.
        for path, methods in proxied:
            for method in methods:
                table.add(method, capability_path(path), stripped(forwarder.handle), Access.CAPABILITY)
    rest(table)
    return app


async def not_found(request: web.Request) -> web.Response:
    return web.Response(
        status=404,
        body=error_body(
            f"route {request.method} {request.path} is not served by the router", "not_found", 404
        ),
        content_type="application/json",
    )


HEALTH_BODY = orjson.dumps({"status": "ok", "control_fanout": True})


async def health(request: web.Request) -> web.Response:
    """Liveness: 200 whenever the process serves, whatever the backends do (``router.fleet.admin``). Each
    worker process answers it itself.

    ``"control_fanout": true``: this origin is also the fleet's control URL (``router.fleet.vllm_control``
    at its root), which sends each control call to every engine as one transaction; NeMo-RL's
    ``remote_vllm`` preflight reads this ``/health`` as its control URL's and refuses one counting several
    backends without the flag. No ``total_backends``: a worker process does not hold the serving set (only
    the router process does, a relay away), so the count is ``/control/health``'s (admin)."""
    return web.Response(status=200, body=HEALTH_BODY, content_type="application/json")
