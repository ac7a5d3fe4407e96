"""The refit window for fronts without ``/fleet`` routes of their own: the same ``FleetApi``, in the driver.

vllm-router (managed or external) proxies to the launcher's own engines, which serve vLLM's dev routes
(``/pause``, ``/update_weight_version``, ``/weight_checker`` ... or the simulator's equivalents), but it has
no fleet-wide pause, no weight versions and would register a restarted engine that came back on the
checkpoint's weights: stale rollouts, silently. So the driver serves the builtin router's ``/fleet/*``
routes itself (``router.fleet_api.FleetApi`` over a ``BackendSet`` that mirrors the fleet controller's
pushes), guarded by the job's admin token, and the gateway registers with the front only the engines this
``BackendSet`` serves: an engine that joins after a stamp stays out of the front until its
``/weight_info`` shows the fleet's version, exactly the builtin router's rule (same code).

What differs from the builtin router is who holds requests during a pause: nothing passes through this
endpoint, so the engines do (vLLM and the simulator queue new requests while paused and schedule them on
resume), with no bound in count or time; the pause answer says ``router_holding: false``.

An aiohttp app on its own event loop in a daemon thread of the driver: the fleet controller's thread
hands it the serving set, and its loop owns the ``BackendSet`` (``BackendSet`` mutates on one loop only).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

from aiohttp import web

from router.auth import auth_middleware
from router.backends import BackendSet, canonical_backend_url
from router.cache_reset import VLLM_RESET_PATH, CacheResetReport, reset_engines
from router.fleet_api import FleetApi
from router.pause_gate import PauseGate
from router.policies import make_policy
from router.policies.base import LoadTracker

_CALL_TIMEOUT_S = 10.0


class FleetEndpoint:
    def __init__(self, host: str, port: int, admin_token: str, engine_api_key: str | None) -> None:
        if not admin_token:
            raise ValueError("the fleet endpoint needs the job's admin token: it is never served open")
        self.host = host
        self.port = port
        self._admin_token = admin_token
        self._engine_api_key = engine_api_key
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fleet-endpoint", daemon=True)
        self._runner: web.AppRunner | None = None
        self.backends = BackendSet(make_policy("round_robin"), LoadTracker())
        self.api: FleetApi | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> FleetEndpoint:
        self._thread.start()
        self._run(self._start())
        return self

    async def _start(self) -> None:
        # Made on the loop: the FleetApi's verification tasks and the gate belong to it.
        self.api = FleetApi(self.backends, PauseGate(), self._engine_api_key, holds_requests=False)
        app = web.Application(middlewares=[auth_middleware(None, self._admin_token)])
        self.api.add_routes(app)
        app.router.add_post("/fleet/reset_prefix_cache", self._reset_prefix_cache)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = int(self._runner.addresses[0][1])  # the OS's choice when given port 0

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        """The engines' prefix caches (vllm-router's own prefix tree has no flush: its entries then point
        at flushed caches, which costs hit rate, not correctness; ``router_entries_dropped`` is None)."""
        report = CacheResetReport(
            await reset_engines(list(self.backends.serving), VLLM_RESET_PATH, self._engine_api_key)
        )
        return web.json_response(report.to_json(), status=200 if report.ok else 500)

    def _run(self, coro: object, timeout_s: float = _CALL_TIMEOUT_S) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)  # type: ignore[arg-type]

    def serving(self, pushed: Sequence[str]) -> list[str]:
        """Make ``pushed`` the fleet's members and return those of them the front may route to (the
        pushed URLs as given, without the ones held out as stale)."""

        async def replace() -> tuple[str, ...]:
            self.backends.replace(pushed)
            return self.backends.serving

        serving = set(self._run(replace()))  # type: ignore[arg-type]
        return [u for u in pushed if canonical_backend_url(u) in serving]

    @property
    def weight_version(self) -> str | None:
        return self.api.current_version if self.api is not None else None

    def stop(self) -> None:
        """Close the listener and end the loop's thread; idempotent."""
        if not self._thread.is_alive():
            return
        if self._runner is not None:
            try:
                self._run(self._runner.cleanup())
            except Exception:  # stopping anyway: the thread is a daemon
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
