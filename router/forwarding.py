"""Forwarding: one inbound request proxied to one backend (and, on failure, once to another).

Rules, each preventing a failure seen with real clients and peers:

* Never a redirect. Clients do not follow them for POST bodies, and a redirect would hand out an
  engine's own URL, which dies with the engine.
* The request body is read whole (the policy needs the prompt; a retry must resend it), the response
  is streamed chunk by chunk as it arrives (SSE included), so a long generation is never buffered.
  Small non-streaming responses with a known length are read whole first: one write instead of many,
  and a backend dying mid-body can still be retried because nothing has reached the client yet.
* Bodies are forwarded byte-for-byte: the upstream session never decompresses (``auto_decompress=False``)
  and never adds ``Accept-Encoding``, so ``content-encoding`` and ``content-length`` stay true.
* Hop-by-hop headers (RFC 9110 §7.6.1, plus those named in ``Connection``) are dropped both ways.
* A backend that refuses, resets or times out answers 500 (see ``router.status``), after at most one
  retry on a *different* backend while nothing has been sent. Generation requests are safe to repeat
  (no side effects beyond compute), so retry is on for every route by default.
* A stream that breaks after its first byte ends with an SSE ``error`` event, not a silent cut that a
  client would take for a complete answer.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from router.backends import BackendSet
from router.metrics import RouterMetrics
from router.policies.base import NoBackendAvailable, Policy, RouteRequest
from router.status import BACKEND_FAILURE_STATUS, error_body, sse_error_event

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Recomputed by aiohttp for the upstream request (Host from the backend URL, length from the body).
_REQUEST_DROP = HOP_BY_HOP | {"host", "content-length"}
_RESPONSE_DROP = HOP_BY_HOP
# Responses up to this size with a known length are read whole before answering (see module doc).
SMALL_RESPONSE_BYTES = 256 * 1024
# Bodies above this size are digested by the policy in a worker thread, off the event loop.
LARGE_BODY_BYTES = 256 * 1024
JSON = "application/json"


class BackendFailure(Exception):
    """An attempt failed before anything reached the client; ``kind`` labels the metric."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


@dataclass
class ForwardingConfig:
    backend_timeout_s: float
    connect_timeout_s: float
    no_healthy_backend_status: int
    max_attempts: int = 2
    retry_on_timeout: bool = True
    health_managed: bool = False
    backend_api_key: str | None = None


def filter_headers(
    headers: CIMultiDictProxy[str] | CIMultiDict[str], drop: frozenset[str]
) -> CIMultiDict[str]:
    """Copy ``headers`` without hop-by-hop ones and without any header that ``Connection`` names."""
    extra: set[str] = set()
    for value in headers.getall("Connection", ()):
        extra.update(token.strip().lower() for token in value.split(","))
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in headers.items():
        lower = key.lower()
        if lower not in drop and lower not in extra:
            out.add(key, value)
    return out


def json_response(status: int, body: bytes) -> web.Response:
    return web.Response(status=status, body=body, content_type=JSON)


class Forwarder:
    """Proxies requests for the router's routes. Lives on the router's event loop."""

    def __init__(
        self,
        backends: BackendSet,
        policy: Policy,
        metrics: RouterMetrics,
        config: ForwardingConfig,
    ) -> None:
        self.backends = backends
        self.policy = policy
        self.metrics = metrics
        self.config = config
        self.session: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(
            total=config.backend_timeout_s, sock_connect=config.connect_timeout_s
        )
        self._decisions = metrics.decisions.labels(policy.name)

    async def start(self) -> None:
        # limit=0: no pool cap. A fleet of engines each serving hundreds of concurrent sessions would
        # otherwise queue inside the router (aiohttp's default is 100 connections in all).
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
            timeout=self._timeout,
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    # -- the handler ----------------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "?"
        started = time.perf_counter()
        metrics = self.metrics
        metrics.in_flight.inc()
        status = 0
        try:
            response = await self._proxy(request)
            status = response.status
            return response
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            metrics.in_flight.dec()
            metrics.requests.labels(route, str(status)).inc()
            metrics.latency.labels(route).observe(time.perf_counter() - started)

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        body = await request.read() if request.body_exists else b""
        route_request = RouteRequest(path=request.path, body=body, headers=request.headers)
        if len(body) > LARGE_BODY_BYTES:
            route_request = await asyncio.get_running_loop().run_in_executor(
                None, self.policy.prepare, route_request
            )
        else:
            route_request = self.policy.prepare(route_request)
        headers = filter_headers(request.headers, _REQUEST_DROP)
        if self.config.backend_api_key is not None:
            headers["Authorization"] = f"Bearer {self.config.backend_api_key}"
        path_qs = request.rel_url.raw_path_qs

        tried: set[str] = set()
        last: BackendFailure | None = None
        for attempt in range(self.config.max_attempts):
            try:
                url = self.policy.choose(route_request, self.backends.load, frozenset(tried))
            except NoBackendAvailable as exc:
                if last is not None:
                    break  # nowhere else to retry: report the backend failure, not an empty fleet
                self.metrics.errors.labels("no_backend").inc()
                status = self.config.no_healthy_backend_status
                return json_response(
                    status, error_body(f"no healthy backend: {exc}", "no_healthy_backend", status)
                )
            self._decisions.inc()
            if attempt:
                self.metrics.retries.inc()
            tried.add(url)
            try:
                return await self._attempt(request, url, path_qs, headers, body)
            except BackendFailure as failure:
                last = failure
                self._on_failure(url, failure.kind)
        assert last is not None
        return json_response(
            BACKEND_FAILURE_STATUS,
            error_body(f"backend failed: {last}", f"backend_{last.kind}", BACKEND_FAILURE_STATUS),
        )

    def _on_failure(self, url: str, kind: str) -> None:
        self.metrics.errors.labels(kind).inc()
        self.backends.record(url, ok=False)
        if self.config.health_managed:
            # The controller owns re-admission; taking the backend out now stops the next requests from
            # landing on it before the controller's next tick.
            self.backends.remove(url)

    async def _attempt(
        self, request: web.Request, url: str, path_qs: str, headers: CIMultiDict[str], body: bytes
    ) -> web.StreamResponse:
        """One try on ``url``. Raises ``BackendFailure`` only while nothing was sent to the client."""
        assert self.session is not None
        load = self.backends.load
        load.acquire(url)
        try:
            try:
                upstream = await self.session.request(
                    request.method,
                    url + path_qs,
                    data=body or None,
                    headers=headers,
                    allow_redirects=False,
                )
            except TimeoutError as exc:
                raise BackendFailure("timeout", f"{url} did not answer in time") from exc
            except aiohttp.ClientConnectorError as exc:
                raise BackendFailure("connect", f"cannot connect to {url}: {exc.os_error}") from exc
            except aiohttp.ClientError as exc:
                raise BackendFailure("reset", f"{url}: {exc!r}") from exc
            async with upstream:
                return await self._relay(request, url, upstream)
        finally:
            load.release(url)

    async def _relay(
        self, request: web.Request, url: str, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        resp_headers = filter_headers(upstream.headers, _RESPONSE_DROP)
        length = upstream.content_length
        is_sse = upstream.content_type == "text/event-stream"
        ok = upstream.status < 500
        if length is not None and length <= SMALL_RESPONSE_BYTES and not is_sse:
            try:
                payload = await upstream.read()
            except TimeoutError as exc:
                raise BackendFailure("timeout", f"{url} did not finish its answer in time") from exc
            except aiohttp.ClientError as exc:
                raise BackendFailure("reset", f"{url} broke off its answer: {exc!r}") from exc
            resp_headers.popall("Content-Length", None)
            response = web.Response(status=upstream.status, headers=resp_headers, body=payload)
            await response.prepare(request)
            await response.write_eof()
            self.backends.record(url, ok)
            return response

        response = web.StreamResponse(status=upstream.status, headers=resp_headers)
        if length is not None:
            response.content_length = length
        # From here on the client has a status line: failures can no longer be retried.
        await response.prepare(request)
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        except (TimeoutError, aiohttp.ClientError) as exc:
            kind = "timeout" if isinstance(exc, TimeoutError) else "stream_broken"
            self._on_failure(url, kind)
            if is_sse:
                await response.write(sse_error_event(f"backend {url} failed mid-stream: {exc!r}", kind))
                await response.write_eof()
            else:
                # No in-band way to signal an error in a plain body: cut the connection so the client
                # sees a short body (length mismatch) instead of a truncated answer that looks whole.
                if request.transport is not None:
                    request.transport.close()
            return response
        await response.write_eof()
        self.backends.record(url, ok)
        return response
