"""The refit window for fronts without ``/fleet`` routes of their own: the same ``FleetApi``, in the driver.

It belongs to no one kind (hence ``launcher.gateways``, not a kind's package): a front kind whose engines
are the launcher's own but whose front has no refit window starts one. vllm-router (managed or external)
proxies to the launcher's own engines, which serve vLLM's dev routes (``/pause``,
``/update_weight_version``, ``/weight_checker`` ... or the simulator's equivalents), but it has no
fleet-wide pause, no weight versions and would register a restarted engine that came back on the
checkpoint's weights: stale rollouts, silently. Ray Serve (``router.kind: ray-serve``) is the same case
with the engines inside its replicas. So the driver serves the builtin router's ``/fleet/*`` routes
itself (``router.fleet.api.FleetApi`` over a ``BackendSet`` that mirrors the engines the job runs),
guarded by the job's admin token, and the gateway lets its front route only to the engines this
``BackendSet`` serves: an engine that joins after a stamp stays out of the front until its
``/weight_info`` shows the fleet's version, exactly the builtin router's rule (same code). vllm-router
registers only those (``serving``); Ray Serve's routing reads the endpoint's verdict per engine, which
``watch`` hands the gateway as it changes (``launcher.gateways.ray_serve.fleet_state``).

What differs from the builtin router is who holds requests during a pause: nothing passes through this
endpoint, so the engines do (vLLM and the simulator queue new requests while paused and schedule them on
resume), with no bound in count or time; the pause answer says ``router_holding: false``.

An aiohttp app on its own event loop in a daemon thread of the driver (``launcher.net.listener``, with
the router's head deadline and connection cap: it listens on the node's address, open to the cluster):
the fleet controller's thread (vllm-router) or the gateway fleet watcher's (Ray Serve) hands it the
engines, and its loop owns the ``BackendSet`` (``BackendSet`` mutates on one loop only).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiohttp import web

from launcher.net.listener import LISTENER_LIMITS, DriverListener
from router.fleet.api import FleetApi
from router.fleet.cache_reset import CacheResetReport, reset_engines
from router.fleet.engine import VLLM_RESET_PATH
from router.http.auth import Access, Credentials, RouteTable
from router.http.limits import HttpLimits
from router.policies import make_policy
from router.policies.base import LoadTracker
from router.state.backends import BackendSet, canonical_backend_url
from router.state.pause_gate import PauseGate

log = logging.getLogger(__name__)

WATCH_PERIOD_S = 1.0
"""The longest ``watch`` goes without comparing the members (it wakes at once on a version or serving-set
change; this bounds a change that wakes nothing, e.g. a stale engine's reason rewritten)."""


@dataclass(frozen=True)
class MemberState:
    """One engine as the endpoint judges it."""

    url: str
    """Canonical (``router.state.backends.canonical_backend_url``: no ``/v1``)."""
    version: str | None
    """The weight version the endpoint last recorded for it (a stamp it took, or its ``/weight_info``
    read when it joined after a stamp); ``None``: unknown, e.g. before anything was stamped."""
    held_out: str | None
    """Why it is held out of routing (stale: joined on another version, or quarantined by a refit);
    ``None``: it serves."""


@dataclass(frozen=True)
class FleetMembers:
    """Every member and the fleet's current version, read at one moment on the endpoint's loop."""

    version: str | None
    members: tuple[MemberState, ...] = ()


class FleetEndpoint:
    def __init__(
        self,
        host: str,
        port: int,
        admin_token: str,
        engine_api_key: str | None,
        limits: HttpLimits = LISTENER_LIMITS,
    ) -> None:
        if not admin_token:
            raise ValueError("the fleet endpoint needs the job's admin token: it is never served open")
        self._admin_token = admin_token
        self._engine_api_key = engine_api_key
        self.listener = DriverListener("fleet-endpoint", host, port, limits)
        self.backends = BackendSet(make_policy("round_robin"), LoadTracker())
        self.api: FleetApi | None = None
        self._watcher: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return self.listener.url

    def start(self) -> FleetEndpoint:
        self.listener.start(self._app)
        return self

    def _app(self) -> web.Application:
        # Built on the listener's loop: the FleetApi's verification tasks and the gate belong to it.
        self.api = FleetApi(self.backends, PauseGate(), self._engine_api_key, holds_requests=False)
        app = web.Application()
        # The builtin router's marks and checks (every route here is an admin route), bound at
        # registration; an unmarked route keeps the app from starting.
        routes = RouteTable(app, Credentials(None, self._admin_token, self.listener.limits.body_timeout_s))
        self.api.add_routes(routes)
        # Nothing else serves this origin's /health and /v1/models: the control URL's, at the root too.
        self.api.control.add_root_reads(routes)
        routes.add("POST", "/fleet/reset_prefix_cache", self._reset_prefix_cache, Access.ADMIN)
        return app

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        """The engines' prefix caches (vllm-router's own prefix tree has no flush: its entries then point
        at flushed caches, which costs hit rate, not correctness; ``router_entries_dropped`` is None)."""
        report = CacheResetReport(
            await reset_engines(list(self.backends.serving), VLLM_RESET_PATH, self._engine_api_key)
        )
        return web.json_response(report.to_json(), status=200 if report.ok else 500)

    def serving(self, pushed: Sequence[str]) -> list[str]:
        """Make ``pushed`` the fleet's members and return those of them the front may route to (the
        pushed URLs as given, without the ones held out as stale)."""

        async def replace() -> tuple[str, ...]:
            self.backends.replace(pushed)
            return self.backends.serving

        serving = set(self.listener.run(replace()))
        return [u for u in pushed if canonical_backend_url(u) in serving]

    @property
    def weight_version(self) -> str | None:
        return self.api.current_version if self.api is not None else None

    def stale(self) -> dict[str, str]:
        """``{url: why}`` for the members held out as stale, read on the listener's loop (which owns the
        ``BackendSet``: a read from the controller's thread could meet the dict mid-change)."""

        async def read() -> dict[str, str]:
            return self.backends.stale

        return dict(self.listener.run(read()))

    def _members_now(self) -> FleetMembers:
        """On the listener's loop only (the ``BackendSet`` is mid-change anywhere else)."""
        stale, of = self.backends.stale, self.backends.versions.of
        serving = set(self.backends.serving)
        members = tuple(
            MemberState(u, of.get(u), stale.get(u) or (None if u in serving else "not serving"))
            for u in self.backends.members
        )
        return FleetMembers(self.weight_version, members)

    def watch(self, on_change: Callable[[FleetMembers], None]) -> None:
        """Call ``on_change`` with the members each time their versions or hold-outs change (and once now),
        in a worker thread, one call at a time. Why not leave it to the caller's poll: a refit quarantines an
        engine and resumes it within milliseconds, and a front that reads the verdict elsewhere (Ray
        Serve's replicas read a file) must get it as soon as it is made, not at the caller's next tick."""

        async def start() -> None:
            if self._watcher is None:
                self._watcher = asyncio.get_running_loop().create_task(self._watch(on_change))

        self.listener.run(start())

    async def _watch(self, on_change: Callable[[FleetMembers], None]) -> None:
        last: FleetMembers | None = None
        while True:
            # Taken before the snapshot: a change made while on_change runs wakes the next wait.
            changed = asyncio.ensure_future(self.backends.versions.wait_change())
            try:
                now = self._members_now()
                if now != last:
                    try:
                        await asyncio.to_thread(on_change, now)
                        last = now
                    except Exception:  # tried again at the next change or period
                        log.exception("fleet endpoint: the members' listener failed")
                await asyncio.wait([changed], timeout=WATCH_PERIOD_S)
            finally:
                changed.cancel()

    def stop(self) -> None:
        """Close the listener and end the loop's thread; idempotent."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None:

            async def cancel() -> None:
                watcher.cancel()

            try:
                self.listener.run(cancel())
            except Exception:  # the loop is gone already
                pass
        self.listener.stop()
