"""``GenerationRouter``: one stable URL in front of a fleet of OpenAI-compatible engines.

Lifecycle choices, each against a failure clients cannot recover from on their own:

* The listening socket is bound **in the constructor**, synchronously. A port conflict therefore fails
  construction loudly (naming host:port) instead of surfacing later in a background thread, and the URL
  handed to clients is never handed out before something listens on it: Gym retries a refused
  connection forever.
* The server runs on its own event loop in a background thread (``serve_in_background``), so the router
  can live inside a Ray actor whose methods are called from Ray's threads, or beside a blocking driver.
* ``SO_REUSEADDR`` lets a restarted process (a Ray actor with ``max_restarts=-1``) rebind the same port
  while the old connections sit in TIME_WAIT; it does not allow two live listeners, so a real conflict
  still fails. ``bind_retry_s`` covers the moment where the dying process still holds the socket.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
from aiohttp import web

from router.admin import AdminApi
from router.auth import Access, Credentials, RouteTable
from router.backends import BackendSet, canonical_backend_url
from router.config import RouterConfig
from router.connections import ConnectionGate, GuardedSockSite
from router.fleet_api import FleetApi
from router.forwarding import Forwarder, ForwardingConfig
from router.limits import HttpLimits, effective_connection_cap, raise_open_file_limit
from router.metrics import RouterMetrics
from router.pause_gate import PauseGate
from router.policies import LoadTracker, Policy, make_policy
from router.probing import NO_BACKENDS_WARNING, HealthProber, warn_while_empty
from router.routing import LocalRouting
from router.status import error_body

if TYPE_CHECKING:
    from router.workers import WorkerFleet

log = logging.getLogger(__name__)
T = TypeVar("T")

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


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


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


class GenerationRouter:
    """An aiohttp reverse proxy with pluggable routing policies and a health-managed serving set."""

    def __init__(
        self, config: RouterConfig, backend_urls: Iterable[str] = (), *, policy: Policy | None = None
    ) -> None:
        """Validation lives in ``RouterConfig`` alone; here only the backend URLs are canonicalised
        (a malformed one raises ``ValueError`` naming it). ``policy``: a policy object used instead of
        the one ``config`` names (tests inject misbehaving ones); ``config.policy`` then only labels it."""
        if not isinstance(config, RouterConfig):
            raise TypeError(f"GenerationRouter takes a RouterConfig, got {type(config).__name__}")
        self.config = config
        if policy is not None and config.workers > 1:
            # Worker processes build their own policy object from the config to hash prompts with.
            raise ValueError("a policy object can only be injected into a one-process router (workers=1)")
        configured = tuple(dict.fromkeys(canonical_backend_url(u) for u in backend_urls))
        self.policy: Policy = policy or make_policy(config.policy, **config.policy_options)
        self.host = config.host
        self.backends = BackendSet(self.policy, LoadTracker())
        self.backends.replace(configured)
        self.gate = PauseGate(config.pause_max_held, config.pause_max_wait_s)
        self.workers: WorkerFleet | None = None
        if config.workers > 1:
            from router.workers import WorkerFleet  # the worker module imports this one

            self.workers = WorkerFleet(config)
        self.metrics = RouterMetrics(self.backends, self.policy.name, self.gate, workers=self.workers)
        # The one gate of the router lives in its routing state, which holds requests from every worker.
        self.routing = LocalRouting(
            self.backends, self.policy, self.metrics, config.health_managed, self.gate
        )
        if self.workers is not None:
            self.workers.attach(self.routing)
        self.forwarder = Forwarder(
            self.routing,
            self.policy,
            self.metrics,
            ForwardingConfig.of(config),
        )
        self.fleet = FleetApi(self.backends, self.gate, self._engine_key())
        self._api_key = config.secret("api_key")
        self._admin_token = config.admin_secret
        self._max_request_bytes = config.max_request_bytes
        if self._admin_token is None:
            # RouterConfig refused this unless insecure_admin was given.
            log.warning(
                "the admin routes (/workers, /fleet/*) on %s are open (no admin token or API key, "
                "--insecure-admin): any process that can reach them can add, remove, pause or refit engines",
                config.host,
            )
        if not configured and not config.health_managed:
            log.warning(NO_BACKENDS_WARNING)
        # Bound now: a conflict raises here, and the URL is valid from this line on.
        self._socket = bind_listening_socket(
            config.host, config.port, retry_s=config.bind_retry_s, reuse_port=config.port_held
        )
        self.port: int = self._socket.getsockname()[1]
        if self.workers is not None:
            self.workers.listen_on(self._socket)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._serving = threading.Event()
        self._stopped = False
        self._startup_error: BaseException | None = None
        self._background: list[asyncio.Task[None]] = []
        self._health_session: aiohttp.ClientSession | None = None
        self.http_limits: HttpLimits = config.http
        self.connections: ConnectionGate | None = None

    # -- identity ----------------------------------------------------------------------------------------
    def base_url(self) -> str:
        """``http://host:port``, fixed for the life of the router (clients use ``base_url() + "/v1"``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # -- application ---------------------------------------------------------------------------------------
    def _build_app(self) -> web.Application:
        return build_app(
            self.forwarder,
            self._api_key,
            self._admin_token,
            self._max_request_bytes,
            self.http_limits,
            self._admin_routes,
        )

    def _admin_routes(self, table: RouteTable) -> None:
        admin = AdminApi(
            self.backends,
            self.metrics,
            self.policy.name,
            self._session,
            worker_health_timeout_s=self.config.worker_health_timeout_s,
            max_pending=self.config.max_pending_registrations,
            backend_api_key=self._engine_key(),
        )
        admin.add_routes(table)
        self.fleet.add_routes(table)
        table.add("*", "/{tail:.*}", not_found, Access.CLIENT)

    def _engine_key(self) -> str | None:
        """The key the router's own engine calls (fleet operations) present: the backend key, else the
        clients' key, which is what the engines expect when no separate one is set (the proxied
        requests carry it through). Without it a job's engines answer the fleet routes 401."""
        return self.config.secret("backend_api_key") or self.config.secret("api_key")

    def _session(self) -> aiohttp.ClientSession:
        """A plain aiohttp session for the router's own health checks (admin API, prober): not on the
        request path, so convenience beats the lean upstream client there."""
        assert self._health_session is not None
        return self._health_session

    async def _start(self) -> None:
        limits = self.http_limits
        self.forwarder.use_limits(limits)
        self._health_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        if self.workers is None:
            self._runner, self.connections = await serve_guarded(
                self._build_app(), self._socket, limits, self.metrics
            )
        else:
            # The parent of worker processes serves the same application (admin API, metrics) on a
            # private Unix socket the workers relay to; the public socket is accepted on by the workers.
            self.workers.open()
            app = self._build_app()
            # The workers relay what this application marked (router.workers.worker_routes).
            self.workers.relay_routes(RouteTable.of(app).marked())
            self._runner = web.AppRunner(app, **runner_kwargs(limits))
            await self._runner.setup()
            await web.UnixSite(self._runner, self.workers.admin_path).start()
            await self.workers.start()
        self._background.extend(asyncio.get_running_loop().create_task(c) for c in self._background_jobs())

    def _background_jobs(self) -> list[Coroutine[Any, Any, None]]:
        """The prober when standalone, and the no-backend warning when nothing feeds the router."""
        c = self.config
        jobs: list[Coroutine[Any, Any, None]] = []
        if c.probing:
            prober = HealthProber(
                self.backends,
                self._session,
                c.probe_interval_s,
                timeout_s=c.probe_timeout_s,
                failures_to_eject=c.probe_failures_to_eject,
                successes_to_readmit=c.probe_successes_to_readmit,
            )
            jobs.append(prober.run())
        if not c.health_managed:
            jobs.append(warn_while_empty(self.backends))
        return jobs

    async def _shutdown(self) -> None:
        if self.workers is not None:
            await self.workers.stop()
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        await self.forwarder.close()
        if self._health_session is not None:
            await self._health_session.close()

    # -- lifecycle ----------------------------------------------------------------------------------------
    def serve_in_background(self, timeout_s: float = 30.0) -> str:
        """Start serving on a background thread; return once requests are accepted. Returns base_url()."""
        if self._stopped:
            raise RuntimeError("this router was stopped; build a new one")
        if self._thread is not None:
            return self.base_url()
        self._thread = threading.Thread(target=self._thread_main, name=f"router-{self.port}", daemon=True)
        self._thread.start()
        if self.workers is not None:
            timeout_s = max(timeout_s, self.workers.start_timeout_s)
        if not self._serving.wait(timeout_s) or self._startup_error is not None:
            error = self._startup_error
            self.stop()
            raise RuntimeError(f"router on {self.base_url()} failed to start: {error!r}") from error
        return self.base_url()

    def _thread_main(self) -> None:
        loop = _new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._start())
        except BaseException as exc:  # reported to serve_in_background's caller
            self._startup_error = exc
            try:  # nothing half-started stays behind (worker processes, sessions)
                loop.run_until_complete(self._shutdown())
            except Exception:
                log.exception("cleaning up after a failed router start")
            self._serving.set()
            loop.close()
            return
        self._serving.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._shutdown())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def is_serving(self) -> bool:
        return (
            self._serving.is_set()
            and self._startup_error is None
            and self._thread is not None
            and self._thread.is_alive()
            and not self._stopped
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving, close the socket and upstream connections; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            # After a failed start the thread closes its loop on its own, and may be between that and
            # its return: there is then nothing to stop, only a thread to join.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout_s)
        self._socket.close()

    def __enter__(self) -> GenerationRouter:
        self.serve_in_background()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- thread-safe control ---------------------------------------------------------------------------------
    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the router's loop thread (policies and load counts are loop-owned)."""
        loop = self._loop
        if loop is None or not loop.is_running() or threading.current_thread() is self._thread:
            return fn()

        async def run() -> T:
            return fn()

        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(run(), loop)
        return future.result(timeout=30)

    def set_serving_backends(self, urls: Iterable[str]) -> list[str]:
        """Replace the serving set whole (new URLs welcome: a restarted engine returns on a new port)."""
        canonical = tuple(dict.fromkeys(canonical_backend_url(u) for u in urls))
        return list(self._call(lambda: self.backends.replace(canonical)))

    def serving_backends(self) -> list[str]:
        return list(self._call(lambda: self.backends.serving))

    def drain_backend_outcomes(self) -> dict[str, tuple[int, int]]:
        """``{url: (successes, failures)}`` since the previous drain; resets both together."""
        return self.backends.drain()

    def in_flight(self) -> dict[str, int]:
        return self._call(self.backends.load.snapshot)

    def worker_pids(self) -> list[int]:
        """Process ids of the worker processes serving the port, by worker index (empty with one)."""
        workers = self.workers
        return [] if workers is None else self._call(workers.pids)


    def current_weight_version(self) -> str | None:
        """The fleet's weight version as last stamped through ``/fleet/weight_version`` (None: never)."""
        return self.fleet.current_version

    def restore_weight_version(self, version: str) -> None:
        """Seed the version after a restart of this router (the fleet controller remembers it), so a
        restarted router does not admit stale engines; engines are not called."""
        def seed() -> None:
            if self.fleet.current_version is None:
                self.fleet.current_version = version

        self._call(seed)

    def stale_backends(self) -> dict[str, str]:
        return dict(self._call(lambda: self.backends.stale))

    def restore_pause(self, mode: str = "keep") -> bool:
        """Hold new requests again after a restart of this router in the middle of a pause (the fleet
        controller found the engines paused); engines are not called. True if the gate was open."""

        def close() -> bool:
            if self.gate.paused:
                return False
            self.gate.close(mode)
            return True

        return bool(self._call(close))


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
    then the connection is closed (``router.bodies``)."""
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
    the launcher driver's own small listeners have no metrics)."""
    runner = web.AppRunner(app, **runner_kwargs(limits))
    await runner.setup()
    cap = effective_connection_cap(limits, raise_open_file_limit())

    def count(kind: str) -> None:
        if metrics is not None:
            metrics.errors.labels(kind).inc()

    gate = ConnectionGate(max(1, -(-cap // share)), on_event=count)
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
) -> web.Application:
    """The proxied routes on ``forwarder`` (client routes); ``rest`` adds everything else through the
    same ``RouteTable`` (the admin API in the router that owns the routing state, ``/health`` and the
    relay to it in a worker process). Each route is checked as its mark says (``router.auth``), and the
    application does not start with a route registered without a mark. No middleware: each layer costs
    every request a coroutine call and a handler chain."""
    app = web.Application(client_max_size=max_request_bytes)
    table = RouteTable(app, Credentials(api_key, admin_token, limits.body_timeout_s))
    for path, methods in PROXIED_ROUTES:
        for method in methods:
            table.add(method, path, forwarder.handle, Access.CLIENT)
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
