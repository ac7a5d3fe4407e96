"""The router's own endpoints: liveness, readiness, metrics, and vllm-router's ``/workers`` admin API.

``/health`` answers 200 whenever the router process serves, whatever the backends do: it is a liveness
probe, and the peers' "503 if any worker is down" makes a supervisor restart a healthy router for an
engine's fault. ``/readiness`` is the "can it route at all" question (at least one serving backend).

``/workers`` matches vllm-router's API so scripts written for it (NeMo-RL registers each replica this way)
drive this router unchanged: ``POST /workers {"url": ...}`` blocks until the worker's ``GET /health`` is
2xx, then admits it; a timeout or a duplicate is a 400 with ``"code": "ADD_WORKER_FAILED"``.

``/workers`` is the fleet owner's (``Access.OWNER``: the admin token, never a consumer's key): the serving
set decides where the engine key goes, since every fan-out (pause, refit, reset) presents it to every
member. Where a fleet controller owns the serving set (``health_managed``: a job's router, which the
controller pushes the engines it started to), ``POST /workers`` is refused outright, without a probe: an
engine the controller did not start would get the engine key on the next fan-out and be routed to until
the controller's next push removed it; engines join such a fleet through the controller (``rl-launch
fleet grow``). ``GET`` and ``DELETE`` stay (a removed engine comes back with the controller's next push).

A trainer that starts its own engines registers them under the job's capability instead
(``POST /t/<capability>/workers``, no header: ``router.http.capability``), on a router that is not
health-managed: its prober holds out an engine that stops answering and readmits it when it returns.

A registration that waits is an outbound probe loop the caller started, so it lives only as long as some
caller waits for it: when every caller of a pending URL has disconnected the loop is cancelled (before,
a stranger's URL was probed for 300 s after the caller left). Callers of the same pending URL share one
loop, and at most ``max_pending`` distinct URLs wait at once (429 above: a flood of registrations must
not become a flood of outbound probes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp
import orjson
from aiohttp import web

from router.fleet.cache_reset import CacheResetReport, reset_engines
from router.fleet.engine import VLLM_RESET_PATH
from router.http.app import health
from router.http.auth import Access, RouteTable
from router.http.capability import bounded_body, capability_path, refusing_bad_urls
from router.state.backends import BackendSet, canonical_backend_url
from router.state.metrics import RouterMetrics

ADD_WORKER_FAILED = "ADD_WORKER_FAILED"


def _json(status: int, payload: object) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


def _add_failed(message: str) -> web.Response:
    return _json(400, {"success": False, "code": ADD_WORKER_FAILED, "message": message})


class AdminApi:
    def __init__(
        self,
        backends: BackendSet,
        metrics: RouterMetrics,
        policy_name: str,
        session_getter: Callable[[], aiohttp.ClientSession],
        worker_health_timeout_s: float = 300.0,
        worker_health_interval_s: float = 0.5,
        max_pending: int = 64,
        disconnect_poll_s: float = 0.2,
        backend_api_key: str | None = None,
        health_managed: bool = False,
        capability: bool = False,
        body_timeout_s: float = 10.0,
    ) -> None:
        """``health_managed``: a fleet controller owns the serving set (module doc). ``capability``: the
        router has a registration capability, so ``/workers`` is served under it too."""
        self.capability = capability
        self.body_timeout_s = body_timeout_s
        self.backend_api_key = backend_api_key
        self.health_managed = health_managed
        self.backends = backends
        self.metrics = metrics
        self.policy_name = policy_name
        self._session_getter = session_getter
        self.worker_health_timeout_s = worker_health_timeout_s
        self.worker_health_interval_s = worker_health_interval_s
        self.max_pending = max_pending
        self.disconnect_poll_s = disconnect_poll_s
        # url -> (the shared health wait, how many callers are waiting on it)
        self._pending: dict[str, tuple[asyncio.Task[bool], int]] = {}

    def add_routes(self, table: RouteTable) -> None:
        table.add("GET", "/health", health, Access.OPEN)
        table.add("GET", "/readiness", self.readiness, Access.OPEN)
        table.add("GET", "/metrics", self.metrics_endpoint, Access.OPEN)
        table.add("GET", "/workers", self.list_workers, Access.OWNER)
        table.add("POST", "/workers", refusing_bad_urls(self.add_worker), Access.OWNER)
        table.add("DELETE", "/workers/{url:.+}", self.delete_worker, Access.OWNER)
        if self.capability:
            # The trainer's registrations (router.http.capability): the same answers as the owner's.
            register = bounded_body(self.add_worker, self.body_timeout_s)
            table.add("POST", capability_path("/workers"), register, Access.CAPABILITY)
            table.add("GET", capability_path("/workers"), self.list_workers, Access.CAPABILITY)
        table.add("POST", "/fleet/reset_prefix_cache", self.reset_prefix_cache, Access.ADMIN)

    async def readiness(self, request: web.Request) -> web.Response:
        n = len(self.backends.serving)
        return _json(200 if n else 503, {"ready": n > 0, "serving_backends": n})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        await self.metrics.refresh()
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def list_workers(self, request: web.Request) -> web.Response:
        load = self.backends.load
        serving = set(self.backends.serving)
        workers = [
            {"url": u, "in_flight": load.in_flight(u) if u in serving else 0, "healthy": u in serving}
            for u in self.backends.members
        ]
        return _json(
            200, {"workers": workers, "urls": list(self.backends.serving), "policy": self.policy_name}
        )

    async def add_worker(self, request: web.Request) -> web.Response:
        if self.health_managed:
            return _json(
                403,
                {
                    "success": False,
                    "code": ADD_WORKER_FAILED,
                    "message": "this router's serving set is its fleet controller's: it admits only the "
                    "engines the controller started (grow the fleet with `rl-launch fleet grow`); the "
                    "engine key is never sent to a worker added here",
                },
            )
        try:
            payload = orjson.loads(await request.read())
            raw = payload["url"]
            url = canonical_backend_url(raw)
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return _add_failed('body must be JSON like {"url": "http://host:port"}')
        except ValueError as exc:
            return _add_failed(str(exc))
        if url in self.backends.members:
            return _add_failed(f"worker {url} is already registered")
        if url not in self._pending and len(self._pending) >= self.max_pending:
            return _json(
                429,
                {
                    "success": False,
                    "code": ADD_WORKER_FAILED,
                    "message": f"{len(self._pending)} registrations are already waiting for health; "
                    "retry when some have finished",
                },
            )
        healthy = await self._join_wait(request, url)
        if healthy is None:  # the caller went away; nobody reads this answer
            return _json(499, {"success": False, "message": "client disconnected"})
        if not healthy:
            return _add_failed(
                f"worker {url} did not answer GET /health with 2xx within {self.worker_health_timeout_s:g} s"
            )
        # A caller that shared another's wait finds the URL added already: the same registration.
        self.backends.add(url)
        return _json(200, {"success": True, "message": f"worker {url} added", "url": url})

    async def _join_wait(self, request: web.Request, url: str) -> bool | None:
        """Wait on ``url``'s shared health loop until it ends or this caller disconnects (then ``None``).
        The loop is cancelled when its last caller leaves."""
        entry = self._pending.get(url)
        task = entry[0] if entry else asyncio.get_running_loop().create_task(self._wait_healthy(url))
        self._pending[url] = (task, (entry[1] if entry else 0) + 1)
        gone = asyncio.get_running_loop().create_task(self._caller_gone(request))
        try:
            await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Also reached when aiohttp cancels this handler because the client went away.
            gone.cancel()
            current = self._pending.get(url)
            if current is not None and current[0] is task:
                if current[1] <= 1:
                    del self._pending[url]
                    if not task.done():
                        task.cancel()
                else:
                    self._pending[url] = (task, current[1] - 1)
        if not task.done() or task.cancelled():
            return None
        return task.result()

    async def _caller_gone(self, request: web.Request) -> None:
        """Return once the caller's connection is closed (aiohttp does not cancel handlers by default)."""
        while True:
            transport = request.transport
            if transport is None or transport.is_closing():
                return
            await asyncio.sleep(self.disconnect_poll_s)

    async def _wait_healthy(self, url: str) -> bool:
        session = self._session_getter()
        deadline = time.monotonic() + self.worker_health_timeout_s
        timeout = aiohttp.ClientTimeout(total=min(5.0, self.worker_health_timeout_s))
        while True:
            try:
                async with session.get(url + "/health", timeout=timeout, allow_redirects=False) as r:
                    if 200 <= r.status < 300:
                        return True
            except (TimeoutError, aiohttp.ClientError):
                pass
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            await asyncio.sleep(min(self.worker_health_interval_s, remaining))

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """Flush every serving engine's prefix cache and the policy's prefix index (admin token).

        200 when every engine complied, 500 with the per-engine report when any did not (or none serves):
        a trainer must not go on believing the fleet was flushed. The index is cleared either way: after
        a weight update its holders point at caches that are, or should be, gone."""
        report = CacheResetReport(
            await reset_engines(list(self.backends.serving), VLLM_RESET_PATH, self.backend_api_key)
        )
        report.router_entries_dropped = self.backends.policy.reset_cache_state()
        return _json(200 if report.ok else 500, report.to_json())

    async def delete_worker(self, request: web.Request) -> web.Response:
        try:
            # match_info is already percent-decoded once by aiohttp; decoding again would turn a
            # registered URL's literal "%41" into "A" and miss it.
            url = canonical_backend_url(request.match_info["url"])
        except ValueError as exc:
            return _json(400, {"success": False, "message": str(exc)})
        if not self.backends.remove(url):
            return _json(404, {"success": False, "message": f"worker {url} is not registered"})
        return _json(200, {"success": True, "message": f"worker {url} removed"})
