"""The ingress deployment behind Serve's HTTP proxy: keeps the router's status contract.

Serve's own answers break the contract clients retry on: 408 when a request outlives the proxy's
timeout, 503 on back-pressure or a replica lost mid-call. Here every call to the engines goes through
one place that turns those into ours:

* a replica that fails, dies, hangs past ``backend_timeout_s`` or answers 5xx before a byte was sent
  is retried once on a different replica (``max_attempts``), then answered **500**, never 502/503/504;
* no running engine replica is answered ``no_healthy_status`` (409 by default) at once, a status
  clients do not retry, instead of queueing in Serve until a replica comes back;
* the proxy itself runs with no request timeout and the ingress with no queue limit, so neither sends
  its own 408/503.

Once the first byte of the body went out the status is fixed: a stream cut later ends the response
early (the client sees a truncated body, as with our router).

The refit window (``fleet_state``, read at most every half second): replicas whose engines the driver's
fleet endpoint holds out (stale, or quarantined by a refit) are in the call's ``RETRY_EXCLUDE`` from the
first attempt; a replica that refuses anyway (one the state does not list yet, after a stamp) is passed
over without counting an attempt; when no running replica may serve, the answer is ``no_healthy_status``
with the reason at once, never a request queued in Serve. Every response carries ``x-rl-weight-version``
(``router.state.versions.VERSION_HEADER``), the serving engine's version as the state last recorded it
(absent before anything was stamped); within about half a second of a refit the state may still show the
previous version.

Only the router's proxied routes (``router.http.app.PROXIED_ROUTES``: the OpenAI generation routes,
``/tokenize``, ``/detokenize``) reach the engines, and only with the job's API key, checked here before the
body is read; ``/health`` is the front's own. Everything else is 404: forwarding every path used to hand
vLLM's dev routes (``/pause``, ``/collective_rpc``...) to anyone who could reach the front, and a rollout
worker holding the client key could pause the fleet through it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from launcher.engines.host import read_secret
from launcher.engines.key_guard import authorized
from launcher.gateways.ray_serve.fleet_state import FleetState, FleetStateReader
from launcher.gateways.ray_serve.plan import ServePlan
from launcher.gateways.ray_serve.replica import HELD_OUT_HEADER
from launcher.gateways.ray_serve.request_router import (
    RETRY_EXCLUDE,
    ROUTE_KEY,
    ROUTED,
    flush_prefix_indexes,
)
from router.http.app import PROXIED_ROUTES
from router.state.versions import VERSION_HEADER

ENGINES_DEPLOYMENT = "engines"
INGRESS_DEPLOYMENT = "ingress"
_PROXIED = frozenset((method, path) for path, methods in PROXIED_ROUTES for method in methods)


def _error(status: int, message: str) -> Response:
    return JSONResponse({"error": {"message": message, "type": "gateway_error", "code": status}}, status)


class GatewayIngress:
    def __init__(self, engines: Any, plan: dict[str, Any], app_name: str) -> None:
        self.engines = engines
        self.plan = ServePlan(**plan)
        self.app_name = app_name
        # Read from the job's 0600 file on this node, never carried in the plan (Serve keeps deployment
        # arguments in its controller's checkpoint).
        self._key = read_secret(self.plan.engine.get("api_key_file"))
        self._running = 0
        self._running_at = 0.0
        self.fleet = FleetStateReader(self.plan.engine.get("job_dir"))
        self._fleet_version: str | None = None

    async def fleet_state(self) -> FleetState | None:
        """The refit window's state (cached, see ``fleet_state``); a new fleet version flushes the prefix
        index of our policy in Serve's routing (the refit flushed the engines' caches)."""
        state = await self.fleet.get()
        if state is not None and state.version != self._fleet_version:
            self._fleet_version = state.version
            flush_prefix_indexes()
        return state

    async def running_replicas(self) -> int:
        """Running engine replicas by Serve's controller (cached for a second: one call per request
        would make the controller the bottleneck)."""
        now = time.monotonic()
        if now - self._running_at > 1.0:
            from ray import serve

            status = await asyncio.to_thread(serve.status)
            app = status.applications.get(self.app_name)
            deployment = app.deployments.get(ENGINES_DEPLOYMENT) if app is not None else None
            self._running = int(deployment.replica_states.get("RUNNING", 0)) if deployment else 0
            self._running_at = now
        return self._running

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path == "/health":
            running = await self.running_replicas()
            if running:
                return Response(status_code=200)
            return _error(self.plan.no_healthy_status, "no healthy engine replica")
        if (request.method, path) not in _PROXIED:
            return _error(404, f"route {request.method} {path} is not served by the gateway")
        if self._key is not None and not authorized(request.headers.get("authorization"), self._key):
            return _error(401, "invalid or missing API key")
        body = await request.body()
        if len(body) > self.plan.max_request_bytes:
            return _error(413, f"request body over {self.plan.max_request_bytes} bytes")
        running = await self.running_replicas()
        if running == 0:
            return _error(self.plan.no_healthy_status, "no healthy engine replica")
        fleet = await self.fleet_state()
        held = fleet.held_out() if fleet is not None else {}
        if fleet is not None and (why := fleet.none_may_serve(running)) is not None:
            return _error(self.plan.no_healthy_status, why)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers.raw}
        tried: list[str] = []  # replicas that failed this request
        refused: dict[str, str] = {}  # replicas that refused it (held out): no attempt spent
        attempts = 0
        last = "no attempt made"
        # Each replica refuses once (it is excluded after): bounded by the attempts plus the replicas.
        for _round in range(self.plan.max_attempts + running):
            if attempts >= self.plan.max_attempts:
                break
            exclude = {*held, *tried, *refused}
            if len(exclude) >= running:  # nowhere left to go: Serve would hold the call until one comes
                break
            key = uuid.uuid4().hex
            call = self.engines.options(stream=True).forward.remote(
                request.method,
                path,
                request.url.query,
                headers,
                body,
                **{ROUTE_KEY: key, RETRY_EXCLUDE: tuple(sorted(exclude))},
            )
            try:
                head = await asyncio.wait_for(call.__anext__(), self.plan.backend_timeout_s)
            except Exception as exc:  # Serve's errors (actor died, back-pressure, timeout): a failed attempt
                call.cancel()
                attempts += 1
                replica = ROUTED.pop(key, None)
                if replica:
                    tried.append(replica)
                last = f"{type(exc).__name__}: {exc}"[:300]
                continue
            ROUTED.pop(key, None)
            status, head_headers, replica, _node = head
            out = dict(head_headers)
            if HELD_OUT_HEADER in out:
                call.cancel()
                refused[replica] = out[HELD_OUT_HEADER]
                continue
            if status >= 500:
                call.cancel()
                attempts += 1
                tried.append(replica)
                last = f"engine answered {status}"
                continue
            version = fleet.version_of(replica) if fleet is not None else None
            if version is not None:
                out[VERSION_HEADER] = version
            return StreamingResponse(_rest(call), status_code=status, headers=out, media_type=None)
        if attempts == 0:  # no replica failed it: every one it could reach is held out
            reasons = {**held, **refused}
            why = "; ".join(f"replica {rid}: {r}" for rid, r in sorted(reasons.items())) or last
            return _error(self.plan.no_healthy_status, f"no engine replica may serve now: {why}")
        return _error(500, f"engine request failed after {attempts} attempt(s): {last}")


async def _rest(call: Any) -> AsyncIterator[bytes]:
    try:
        async for chunk in call:
            yield chunk
    except Exception:  # the replica died mid-stream: end the body here (the status is already sent)
        return
