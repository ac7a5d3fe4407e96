"""``GenerationRouter``: one stable URL in front of a fleet of OpenAI-compatible engines.

Lifecycle choices, each against a failure clients cannot recover from on their own:

* The listening socket is bound **in the constructor**, synchronously. A port conflict therefore fails
  construction loudly (naming host:port) instead of surfacing later in a background thread, and the URL
  handed to clients is never handed out before something listens on it: Gym retries a refused
  connection forever.
* The server runs on its own event loop in a background thread (``serve_in_background``), so the router
  can live inside a Ray actor whose methods are called from Ray's threads, or beside a blocking driver.
* A standing fleet's consumers (``RouterConfig.consumers_file``, ``router.consumers``) are read in the
  constructor too: a corrupt file fails construction naming it, before any client is admitted with the
  wrong keys. The consumer ledger and fair-share admission (``router.state.fair_share``) belong to the
  routing state, as the pause gate does.
* With ``RouterConfig.record_dir`` every generation request leaves one line in the request record
  (``router.record``), written off the request path by the process that proxied it; the record's
  directory is made in the constructor too, so one that cannot be made fails construction, naming it.
  The pause gate and the fair share report how long they held each request on its routing answer
  (``router.state.holds``), and its record says so (``held_s``).
* The socket is bound as ``router.http.app.bind_listening_socket`` says (``SO_REUSEADDR`` for a restarted
  process, ``bind_retry_s`` for the moment a dying one still holds it), and the application is the one
  ``router.http.app`` builds and serves for every process of the router.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

import aiohttp
import orjson
from aiohttp import web

from router.adapters.plan import LoraPlan
from router.adapters.requests import AdapterRequests
from router.adapters.table import AdapterTable
from router.config import RouterConfig
from router.consumers import OWNER, ConsumerKeys
from router.fleet import revocation
from router.fleet.adapter_refit import AdapterRefits
from router.fleet.adapter_routes import AdapterRoutes
from router.fleet.admin import AdminApi
from router.fleet.api import FleetApi
from router.http.app import bind_listening_socket, build_app, not_found, runner_kwargs, serve_guarded
from router.http.auth import Access, RouteTable, account_of
from router.http.capability import ROUTER_ADDRESS
from router.http.connections import ConnectionGate
from router.http.forwarding import Forwarder, ForwardingConfig
from router.http.limits import HttpLimits
from router.multiprocess.workers import WorkerFleet
from router.policies import LoadTracker, Policy, make_policy
from router.record.metrics import watch_record
from router.record.writer import RecordWriter
from router.state.backends import BackendSet, canonical_backend_url
from router.state.fair_share import FairShare
from router.state.metrics import RouterMetrics
from router.state.pause_gate import PauseGate
from router.state.probing import NO_BACKENDS_WARNING, HealthProber, warn_while_empty
from router.state.routing import LocalRouting

log = logging.getLogger(__name__)
T = TypeVar("T")


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


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
        self.consumer_keys: ConsumerKeys | None = None
        if config.consumers_file is not None:
            self.consumer_keys = ConsumerKeys(config.consumers_file)  # a corrupt file raises, naming it
        self.fair: FairShare | None = None
        if config.consumer_accounting:
            # Each consumer's held requests: its share of what the router holds (the pause gate's bound,
            # and the connection cap, since every held request keeps its connection).
            self.fair = FairShare(
                config.fair_share_capacity,
                config.fair_share_max_wait_s,
                max_held=min(config.pause_max_held, config.http.max_client_connections),
                max_held_per_consumer=config.max_held_per_consumer,
            )
            if self.consumer_keys is not None:
                self.fair.registered = self.consumer_keys.accounts  # admin keys count as their account
        self.workers: WorkerFleet | None = None
        if config.workers > 1:
            self.workers = WorkerFleet(config)
        self.metrics = RouterMetrics(
            self.backends, self.policy.name, self.gate, workers=self.workers, fair=self.fair
        )
        # The one gate of the router lives in its routing state, which holds requests from every worker;
        # so does the fair share of the fleet between its consumers.
        self.routing = LocalRouting(
            self.backends,
            self.policy,
            self.metrics,
            config.health_managed,
            self.gate,
            self.fair,
            version_max_wait_s=config.version_max_wait_s,
        )
        if self.workers is not None:
            self.workers.attach(self.routing)
        # The record of the requests this process proxies (none with workers: they accept every client
        # connection and write their own); a directory that cannot be made fails here, naming it.
        self.record = RecordWriter.of(config)
        watch_record(self.metrics, self.record, config.record_dir)
        self.forwarder = Forwarder(
            self.routing,
            self.policy,
            self.metrics,
            ForwardingConfig.of(config),
            self.record,
        )
        # Moves and version stamps reach the tracked requests here (workers: WorkerFleet.attach).
        self.backends.move_listeners.append(self.forwarder.engine_watch.move_off)
        self.backends.versions.listeners.append(self.forwarder.engine_watch.version_changed)
        self.fleet = FleetApi(self.backends, self.gate, self._engine_key())
        self.adapters: AdapterRoutes | None = None
        self._reserved: dict[str, str] = {}
        self._reserved_at = -1
        if config.lora is not None:
            self.adapters = self._serve_adapters(config.lora, config.version_max_wait_s)
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
        app = build_app(
            self.forwarder,
            self._api_key,
            self._admin_token,
            self._max_request_bytes,
            self.http_limits,
            self._admin_routes,
            self.consumer_keys,
            self.config.secret("registration_capability"),
        )
        app[ROUTER_ADDRESS] = (self.host, self.port)  # a registration must not name the router itself
        return app

    def _serve_adapters(self, plan: LoraPlan, max_wait_s: float) -> AdapterRoutes:
        """The fleet's LoRA adapters: their table (who owns which, which version on which engines), the
        refits that change it, the forwarder's resolution of a request's ``model``, and the restore of a
        restarted engine's adapters before any adapter request reaches it. The table is rebuilt from
        the engines and the consumers file when the router starts (``router.fleet.adapter_rebuild``):
        this router may be a restart (a Ray actor, ``max_restarts=-1``) of one whose engines still
        hold every tenant's adapters."""
        fleet = self.fleet
        table = AdapterTable(plan, self._reserved_adapters)
        refits = AdapterRefits(fleet.fleet, table, fleet.refit)  # the fleet's own guard and served root
        self.backends.serving_listeners.append(refits.on_serving)
        fleet.adapter_refits = refits  # the control URL's /v1/load_lora_adapter is this adapter transaction
        self.forwarder.adapters = AdapterRequests(table, lambda: self.backends.serving, max_wait_s)
        return AdapterRoutes(refits, self.config.no_healthy_backend_status)

    def _reserved_adapters(self) -> dict[str, str]:
        """Adapter -> the consumer the fleet's spec reserved it for (the consumers file's ``adapters``).
        Asked on every adapter request: rebuilt only when the file was re-read (``ConsumerKeys.reloads``)."""
        keys = self.consumer_keys
        if keys is None:
            return {}
        keys.refresh()
        if self._reserved_at != keys.reloads:
            self._reserved = {a: name for name, c in keys.accounts().items() for a in c.adapters}
            self._reserved_at = keys.reloads
        return self._reserved

    def _admin_routes(self, table: RouteTable) -> None:
        admin = AdminApi(
            self.backends,
            self.metrics,
            self.policy.name,
            self._session,
            worker_health_timeout_s=self.config.worker_health_timeout_s,
            max_pending=self.config.max_pending_registrations,
            backend_api_key=self._engine_key(),
            health_managed=self.config.health_managed,
            capability=self.config.registration_capability is not None,
            body_timeout_s=self.http_limits.body_timeout_s,
        )
        admin.add_routes(table)
        self.fleet.add_routes(table, tenants=self.adapters is not None)
        if self.adapters is not None:
            self.adapters.add_routes(table)
            refits = self.adapters.refits

            async def close_adapters(app: web.Application) -> None:
                await refits.close()

            table.app.on_cleanup.append(close_adapters)
        table.add("GET", "/fleet/consumers", self._consumers_view, Access.ADMIN)
        table.add("GET", "/fleet/metrics", self._consumer_metrics, Access.OWNER)
        table.add("*", "/{tail:.*}", not_found, Access.CLIENT)

    async def _consumers_view(self, request: web.Request) -> web.Response:
        """``GET /fleet/consumers``: the fair-share capacity and every consumer's weight, in flight,
        waiting, requests, completion tokens and share (``FairShare.view``), for the launcher's status.
        Without consumers nor a capacity: ``{"capacity": null, "consumers": {}}``. An admin consumer's key
        (a LoRA tenant's) sees its own row only, as on ``GET /fleet/adapters``: the other consumers' names,
        job paths and usage are the fleet owner's to see."""
        view = self.fair.view() if self.fair is not None else {"capacity": None, "consumers": {}}
        caller = account_of(request)
        if caller != OWNER:
            view["consumers"] = {n: row for n, row in view["consumers"].items() if n == caller}
        return web.Response(status=200, body=orjson.dumps(view), content_type="application/json")

    async def _consumer_metrics(self, request: web.Request) -> web.Response:
        """``GET /fleet/metrics`` (the fleet owner's): the per-consumer families (``rl_router_consumer_*``),
        which name the consumers and so are left out of the open ``/metrics`` (``RouterMetrics.render``)."""
        await self.metrics.refresh()
        body = self.metrics.render(consumers=True)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    def _engine_key(self) -> str | None:
        """The key the router's own engine calls (fleet operations) present: the backend key, else the
        clients' key, which is what the engines expect when no separate one is set (the proxied
        requests carry it through). Without it a job's engines answer the fleet routes 401. None with a
        registration capability: its engines are whatever URLs its holder registered, and every fan-out
        (the step counters behind ``GET /fleet/step`` included) handed them the job's API key."""
        if self.config.registration_capability is not None:
            return None
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
            # The workers relay what this application marked (router.multiprocess.workers.worker_routes).
            self.workers.relay_routes(RouteTable.of(app).marked())
            self._runner = web.AppRunner(app, **runner_kwargs(limits))
            await self._runner.setup()
            await web.UnixSite(self._runner, self.workers.admin_path).start()
            await self.workers.start()
        self._background.extend(asyncio.get_running_loop().create_task(c) for c in self._background_jobs())
        if self.adapters is not None:  # no adapter is served until the table holds what the engines do
            self.adapters.refits.start()

    def _background_jobs(self) -> list[Coroutine[Any, Any, None]]:
        """The prober when standalone, the no-backend warning when nothing feeds the router, and with
        consumers the end of what a revoked key held (``router.fleet.revocation``)."""
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
        if self.consumer_keys is not None:
            jobs.append(revocation.watch(self.consumer_keys, self.fleet))
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

    def move_off(self, urls: Iterable[str], reason: str) -> int:
        """Move the requests in flight on ``urls`` (those ``router.continuation`` continues) elsewhere now,
        for a drain ("drained") or restart ("restarted"); the engines leave the serving set at once, or a
        request could move to a sibling drained with it. How many here (workers count their own)."""
        canonical = [canonical_backend_url(u) for u in urls]
        return self._call(lambda: self.backends.leave_moving(canonical, reason))

    def member_backends(self) -> list[tuple[str, bool]]:
        """Every member (pushed, configured or registered) and whether it serves now (not ejected)."""

        def read() -> list[tuple[str, bool]]:
            serving = set(self.backends.serving)
            return [(u, u in serving) for u in self.backends.members]

        return self._call(read)

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
                self.backends.versions.fleet_moved_to(version)  # gated requests may ask for it

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
