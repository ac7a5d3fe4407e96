"""Forwarding: one inbound request proxied to one backend (and, on failure, once to another).

Rules, each preventing a failure seen with real clients and peers:

* Never a redirect. Clients do not follow them for POST bodies, and a redirect would hand out an
  engine's own URL, which dies with the engine.
* The request body is read whole (the policy needs the prompt; a retry must resend it), within the
  size cap and the body deadline (``router.http.bodies``), the response
  is streamed chunk by chunk as it arrives (SSE included), so a long generation is never buffered.
  Small non-streaming responses with a known length are read whole first: one write instead of many,
  and a backend dying mid-body can still be retried because nothing has reached the client yet.
* Bodies are forwarded byte-for-byte both ways: the server side does not decompress request bodies
  (``auto_decompress`` off, see ``router.http.app``) and the upstream client (``router.http.upstream``) adds
  no headers of its own but ``Host`` and ``Content-Length``, so ``Content-Encoding`` stays true and the length
  is that of the bytes relayed.
* Hop-by-hop headers (RFC 9110 §7.6.1, plus those named in ``Connection``) are dropped both ways, and so
  is ``Expect``: the router itself answers ``100-continue`` (aiohttp's default expect handler) before
  reading the body, so the engine must not be asked again (its interim 100 is skipped in any case).
* A backend that refuses, resets, times out or answers 5xx is a failed attempt, answered 500 (see
  ``router.http.status``) after at most one retry on a *different* backend while nothing has been sent.
  Generation requests are safe to repeat (no side effects beyond compute), so retry is on for every
  route by default. A 4xx is the backend's answer to this request and passes through unchanged. Which
  failures count against an engine's health is ``router.http.attribution``'s rule: a failure that follows
  the request (it fails on two engines, the engine blames the input, a malformed header) is the client's,
  answered to the client and charged to no engine.
* A client that disconnects cancels its handler (``handler_cancellation``): the upstream connection is
  aborted (the engine stops generating for nobody), the in-flight slot is released at once, and the
  request is never retried elsewhere.
* The policy is told which backend each attempt went to (``Policy.commit``) and which one failed
  (``Policy.retract``), so affinity follows the backend that served, never one that failed.
* A generation request that arrives while the fleet is paused for a weight update is held by the
  routing state's ``PauseGate`` before its backend is chosen (``RoutingState.dispatch`` with ``hold``),
  and answered the no-healthy-backend status past the gate's bounds; other routes are never held.
* A stream that breaks after its first byte ends with an SSE ``error`` event, not a silent cut that a
  client would take for a complete answer.
* Every proxied answer says which weights produced it (``VERSION_HEADER``: the version the routing state
  knew for the engine when the request was dispatched, absent when it knew none) and the id the request is
  known by (``ROUTER_REQUEST_ID_HEADER``: the client's ``X-Request-Id``, else one made here), by which a
  request that straddled a refit is listed (``router.state.versions``). Nothing is added upstream: the
  id travels only back to the client and, with the release, to the routing state. A client's id is
  used only when it is one value of at most ``MAX_REQUEST_ID_CHARS`` printable ASCII characters; any
  other (non-UTF-8 bytes an engine fails on, 8 KB that every straddler list and record line would keep)
  is replaced by the router's own and not forwarded.
* A generation request may be gated on a weight version (``WANT_HEADER``, forwarded unchanged): it goes
  only to an engine that satisfies it, its retry too, and is held by the routing state while none does;
  a malformed or unknown version is answered 400 at once, a hold past its bounds the no-healthy-backend
  status.
* Where the router tells consumers apart (``RouterConfig.consumer_accounting``), a generation request
  names its consumer (put on the request by the access check, ``router.http.auth.CONSUMER``; the owner when
  none) to the routing state, which may hold it for a fair-share slot (``router.state.fair_share``;
  answered the no-healthy-backend status past the bound), and reports its end with the engine's
  ``usage.completion_tokens``. That number is read from the end of the answer as it passes, never by
  buffering it: from the body of a small JSON answer (already read whole), else from the last few chunks
  relayed (the final SSE ``data:`` chunk with ``usage``), at most ``USAGE_TAIL_BYTES`` searched. An answer
  without usage (a stream without ``include_usage``, a compressed body) counts no tokens. Without
  accounting none of this runs.
* With a consumers file a consumer's key never travels to an engine: the engines know the fleet owner's
  key, not the consumers' (an engine would answer a consumer's request 401), and a consumer's key is its
  own business. Its ``Authorization`` is replaced with the engine key (``backend_api_key``, else the
  router's API key), or dropped when there is none.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from multidict import CIMultiDict

from router.consumers import OWNER_CONSUMER, Consumer
from router.http.attribution import Blame, InputFailure, input_attributed, malformed_headers
from router.http.auth import CONSUMER, still_admitted
from router.http.bodies import read_body
from router.http.consumer_limits import ConsumerLimits
from router.http.limits import DEFAULT_HTTP_LIMITS, HttpLimits
from router.http.status import BACKEND_FAILURE_STATUS, error_body, sse_error_event
from router.http.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from router.policies.base import NoBackendAvailable, Policy, RouteRequest
from router.policies.consistent_hash import DEFAULT_SESSION_HEADER, session_key
from router.policies.prefix_index import block_hashes, prompt_start
from router.record.draft import RecordDraft, json_int
from router.record.format import MAX_PREFIX_BLOCKS
from router.record.writer import RecordWriter
from router.state.fair_share import FairShareRefused
from router.state.holds import holds_of
from router.state.metrics import RouterMetrics
from router.state.pause_gate import PauseRefused
from router.state.routing import Chosen, RoutingState
from router.state.versions import (
    REQUEST_ID_HEADER,
    ROUTER_REQUEST_ID_HEADER,
    VERSION_HEADER,
    WANT_HEADER,
    UnknownVersion,
    VersionRefused,
    VersionWant,
)

if TYPE_CHECKING:
    from router.config import RouterConfig

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Recomputed for the upstream request (Host from the backend URL, length from the body); Expect is the
# router's own business (see module doc).
_REQUEST_DROP = HOP_BY_HOP | {b"host", b"content-length", b"expect"}
# Content-Length is set from the bytes actually relayed; the router's own headers are the router's (an
# engine's would otherwise pass for them).
_RESPONSE_DROP = HOP_BY_HOP | {
    b"content-length",
    VERSION_HEADER.encode(),
    ROUTER_REQUEST_ID_HEADER.encode(),
}
# Responses up to this size with a known length are read whole before answering (see module doc).
SMALL_RESPONSE_BYTES = 256 * 1024
# Bodies above this size are digested by the policy in a worker thread, off the event loop.
LARGE_BODY_BYTES = 256 * 1024
JSON = "application/json"
# Held while the fleet is paused (generation); /tokenize and /v1/models do not reach the engine core.
HELD_DURING_PAUSE = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
# Where the engine's usage is looked for: the end of a small answer, else the last chunks relayed.
USAGE_TAIL_BYTES = 16 * 1024
USAGE_TAIL_CHUNKS = 4
_USAGE_KEY = b'"completion_tokens"'
# The record's prompt blocks when the policy computed none (cache_aware's own are reused): its default.
RECORD_BLOCK_BYTES = 1024
# A client's X-Request-Id longer than this (or not printable ASCII) is replaced by the router's own.
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID = REQUEST_ID_HEADER.encode()
# The answer's end the record keeps (its usage and finish reason are in the last few hundred bytes; a
# small copy, as the record holds it until its sink has it).
RECORD_TAIL_BYTES = 4096


def completion_tokens(tail: bytes) -> int:
    """The last ``"completion_tokens": N`` in ``tail`` (the end of an answer), 0 when there is none. A
    match inside a JSON string has its opening quote escaped, or is not followed by ``:`` (a key is; a
    string value ends with ``,`` or ``}``), so generated text cannot pass for it."""
    return json_int(tail, _USAGE_KEY) or 0


@dataclass
class ForwardingConfig:
    backend_timeout_s: float
    connect_timeout_s: float
    no_healthy_backend_status: int
    max_attempts: int = 2
    retry_on_timeout: bool = True
    health_managed: bool = False
    backend_api_key: str | None = None
    max_request_bytes: int = 64 * 1024 * 1024
    consumer_accounting: bool = False
    drop_client_auth: bool = False
    record_text: bool = False

    @classmethod
    def of(cls, config: RouterConfig) -> ForwardingConfig:
        """The forwarding part of a router's config: one mapping for the single process and for every
        worker process, so that a new setting cannot reach one and miss the other. With a consumers
        file the engines get the owner's key in place of the client's (module doc)."""
        consumers_engine_key = config.secret("api_key") if config.consumers_file is not None else None
        return cls(
            backend_timeout_s=config.backend_timeout_s,
            connect_timeout_s=config.connect_timeout_s,
            no_healthy_backend_status=config.no_healthy_backend_status,
            max_attempts=config.max_attempts,
            retry_on_timeout=config.retry_on_timeout,
            health_managed=config.health_managed,
            backend_api_key=config.secret("backend_api_key") or consumers_engine_key,
            max_request_bytes=config.max_request_bytes,
            consumer_accounting=config.consumer_accounting,
            drop_client_auth=config.consumers_file is not None,
            record_text=config.record_text,
        )


def record_tail(chunks: list[bytes]) -> bytes:
    """The last ``RECORD_TAIL_BYTES`` of a stream, from its last chunks (the last alone when it is
    long enough: no join of the others)."""
    last = chunks[-1]
    if len(last) >= RECORD_TAIL_BYTES or len(chunks) == 1:
        return last[-RECORD_TAIL_BYTES:]
    return b"".join(chunks)[-RECORD_TAIL_BYTES:]


def _record_hashes(body: bytes) -> list[int]:
    """The record's block hashes of a prompt whose policy computed none (pure: runs in a thread too)."""
    return block_hashes(body, RECORD_BLOCK_BYTES, prompt_start(body), MAX_PREFIX_BLOCKS)


def filter_raw_headers(
    raw: Iterable[tuple[bytes, bytes]], drop: frozenset[bytes]
) -> list[tuple[bytes, bytes]]:
    """Copy raw headers without hop-by-hop ones and without any header that ``Connection`` names."""
    raw = list(raw)
    extra: set[bytes] = set()
    for name, value in raw:
        if name.lower() == b"connection":
            extra.update(token.strip().lower() for token in value.split(b","))
    return [(n, v) for n, v in raw if (low := n.lower()) not in drop and low not in extra]


def json_response(status: int, body: bytes) -> web.Response:
    return web.Response(status=status, body=body, content_type=JSON)


def new_request_id() -> str:
    """16 hex digits of randomness (a short uuid4; ``uuid.uuid4().hex`` costs five times as much)."""
    return os.urandom(8).hex()


def valid_request_id(value: str) -> bool:
    """Whether a client's ``X-Request-Id`` (as aiohttp decoded it: UTF-8, undecodable bytes escaped) is
    one the router keeps and forwards: 1 to ``MAX_REQUEST_ID_CHARS`` printable ASCII characters."""
    return 0 < len(value) <= MAX_REQUEST_ID_CHARS and value.isascii() and value.isprintable()


def request_id_of(headers: Any) -> str | None:
    """The client's request id when it sent exactly one valid one, else None (none sent, or one to
    replace: see ``valid_request_id``; two ids would let the engine and the router disagree)."""
    given = headers.getall(REQUEST_ID_HEADER, ())
    if len(given) == 1 and valid_request_id(given[0]):
        return given[0]  # type: ignore[no-any-return]
    return None


def header_safe(value: str) -> str:
    """``value`` as a header value: a version with control or non-ASCII characters is percent-encoded
    (a stamp is any string; a CR or LF in a header would fail every answer)."""
    if value.isascii() and value.isprintable():
        return value
    from urllib.parse import quote

    return quote(value, safe="", errors="surrogateescape")


class _Slot:
    """One attempt's in-flight count, released once: as soon as the backend has answered in full and
    before the end of the answer reaches the client, or when the attempt ends otherwise.

    Why before the client: a Gym session sends its next turn the moment it has this answer. With
    worker processes that turn may be parsed by another worker, whose decision could reach the routing
    state before this worker's release, and would then see the session's engine one request (and one
    whole context of bytes) busier than it is: measured on the replay bench, that moved enough turns
    off their engine to cost 1-2.5 points of prefix-cache hits."""

    __slots__ = ("_request_id", "_routing", "_url", "_version", "_weight")

    def __init__(
        self, routing: RoutingState, url: str, weight: int, version: str | None, request_id: str
    ) -> None:
        self._routing: RoutingState | None = routing
        self._url = url
        self._weight = weight
        self._version = version
        self._request_id = request_id

    def release(self) -> None:
        routing, self._routing = self._routing, None
        if routing is not None:
            routing.release(self._url, self._weight, self._version, self._request_id)


class _Ticket:
    """A generation request's fair-share slot and place in the consumer ledger, ended once: when the
    engine has answered in full (with its completion tokens, just before the backend slot is released),
    or when the request ends otherwise."""

    __slots__ = ("_routing", "name")

    def __init__(self, routing: RoutingState, name: str) -> None:
        self._routing: RoutingState | None = routing
        self.name = name

    def end(self, tokens: int = 0) -> None:
        routing, self._routing = self._routing, None
        if routing is not None:
            routing.finish(self.name, tokens)


class Forwarder:
    """Proxies requests for the router's routes. Lives on the router's event loop."""

    def __init__(
        self,
        routing: RoutingState,
        policy: Policy,
        metrics: RouterMetrics,
        config: ForwardingConfig,
        record: RecordWriter | None = None,
    ) -> None:
        """``routing``: where decisions and counts live (this process, or the router's parent process for
        a worker); ``policy``: used here only to ``prepare`` a request's features (the hashing is the
        expensive part and stays in the process that parsed the request). ``record``: where each
        generation request's record goes (None: no record); closed with the forwarder."""
        self.routing = routing
        self.policy = policy
        self.metrics = metrics
        self.config = config
        self.max_request_bytes = config.max_request_bytes
        # No cap on connections: a fleet of engines each serving hundreds of concurrent sessions would
        # otherwise queue inside the router (aiohttp's client pool defaults to 100 in all).
        self.pool = UpstreamPool(config.connect_timeout_s, config.backend_timeout_s)
        self.limits = DEFAULT_HTTP_LIMITS
        self.use_limits(DEFAULT_HTTP_LIMITS)
        self._auth = (
            (b"Authorization", f"Bearer {config.backend_api_key}".encode("latin-1"))
            if config.backend_api_key is not None
            else None
        )
        self._drop_auth = config.drop_client_auth
        self._accounting = config.consumer_accounting
        self._requests: dict[tuple[str, int], Any] = {}
        self._latency: dict[str, Any] = {}
        self.record = record
        # A consumer's connections and body bytes in this process (set by router.http.app.build_app
        # where there are consumers); checked before the body is read.
        self.consumer_limits: ConsumerLimits | None = None
        self._record_text = config.record_text
        self._session_header: str = getattr(policy, "session_header", None) or DEFAULT_SESSION_HEADER

    def use_limits(self, limits: HttpLimits) -> None:
        """Apply the backend-side limits (header bytes, quoted error body); called before serving."""
        self.limits = limits
        self.pool.max_header_bytes = limits.max_backend_header_bytes

    async def close(self) -> None:
        await self.pool.close()
        if self.record is not None:
            # Bounded (RecordWriter.close), and off the loop: the last batch may meet a slow disk.
            await asyncio.get_running_loop().run_in_executor(None, self.record.close)

    # -- the handler ----------------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "?"
        started = time.perf_counter()
        metrics = self.metrics
        status = 500  # what aiohttp answers for an exception that escapes the handler
        draft: RecordDraft | None = None
        if self.record is not None and route in HELD_DURING_PAUSE:
            draft = RecordDraft(route, started)
        limits = self.consumer_limits
        consumer = request.get(CONSUMER) if limits is not None else None
        try:
            refused = limits.admit(request, consumer) if limits is not None else None
            response = refused if refused is not None else await self._proxy(request, draft)
            status = response.status
            return response
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        except web.HTTPException as exc:  # e.g. 413 from request.read(): aiohttp sends exc's status
            status = exc.status
            raise
        finally:
            counter = self._requests.get((route, status))
            if counter is None:
                counter = self._requests[(route, status)] = metrics.requests.labels(route, str(status))
            counter.inc()
            histogram = self._latency.get(route)
            if histogram is None:
                histogram = self._latency[route] = metrics.latency.labels(route)
            histogram.observe(time.perf_counter() - started)
            if limits is not None:
                limits.done(request, consumer)
            if draft is not None:
                draft.finish(status)
                self.record.submit(draft, draft.text_bytes() if self._record_text else 0)  # type: ignore[union-attr]

    async def _proxy(self, request: web.Request, draft: RecordDraft | None = None) -> web.StreamResponse:
        if request.body_exists:
            body = await read_body(request, self.max_request_bytes, self.limits.body_timeout_s)
        else:
            body = b""
        route_request = RouteRequest(request.path, body, request.headers)
        if len(body) > LARGE_BODY_BYTES:
            route_request = await asyncio.get_running_loop().run_in_executor(
                None, self.policy.prepare, route_request
            )
        else:
            route_request = self.policy.prepare(route_request)
        if draft is not None and self._draft_request(draft, request, route_request):
            draft.hashes = await asyncio.get_running_loop().run_in_executor(None, _record_hashes, body)
        headers = filter_raw_headers(request.raw_headers, _REQUEST_DROP)
        if self._auth is not None:
            headers = [(n, v) for n, v in headers if n.lower() != b"authorization"]
            headers.append(self._auth)
        elif self._drop_auth:
            headers = [(n, v) for n, v in headers if n.lower() != b"authorization"]
        path_qs = request.rel_url.raw_path_qs
        request_id = request_id_of(request.headers)
        if request_id is None:
            request_id = new_request_id()
            if REQUEST_ID_HEADER in request.headers:  # the client's, refused: not forwarded either
                headers = [(n, v) for n, v in headers if n.lower() != _REQUEST_ID]
        if draft is not None:
            draft.id = request_id

        routing = self.routing
        # Held by the routing state while the fleet is paused (first attempt only: a retry was admitted).
        hold = request.path in HELD_DURING_PAUSE
        want: VersionWant | None = None
        if hold:
            wanted = request.headers.get(WANT_HEADER)
            if wanted is not None:
                try:
                    want = VersionWant.parse(wanted)
                except ValueError as exc:
                    self.metrics.errors.labels("bad_weight_version").inc()
                    return json_response(400, error_body(str(exc), "invalid_weight_version", 400))
        consumer: Consumer | None = None
        if hold and self._accounting:
            consumer = request.get(CONSUMER) or OWNER_CONSUMER
        tried: set[str] = set()
        last: UpstreamError | None = None
        ticket: _Ticket | None = None
        blame: Blame | None = None  # made at the first failure (router.http.attribution)
        try:
            for attempt in range(self.config.max_attempts):
                try:
                    if draft is not None and not attempt:
                        chosen = await self._dispatch_recorded(draft, route_request, hold, want, consumer)
                    else:
                        chosen = await routing.dispatch(route_request, frozenset(tried), hold, want, consumer)
                except PauseRefused as exc:
                    self.metrics.errors.labels("pause_bound").inc()
                    status = self.config.no_healthy_backend_status
                    return json_response(status, error_body(str(exc), "no_healthy_backend", status))
                except UnknownVersion as exc:
                    self.metrics.errors.labels("unknown_weight_version").inc()
                    return json_response(400, error_body(str(exc), "unknown_weight_version", 400))
                except VersionRefused as exc:
                    self.metrics.errors.labels("version_bound").inc()
                    status = self.config.no_healthy_backend_status
                    return json_response(status, error_body(str(exc), "weight_version_unavailable", status))
                except FairShareRefused as exc:
                    self.metrics.errors.labels("fair_share_bound").inc()
                    status = self.config.no_healthy_backend_status
                    return json_response(status, error_body(str(exc), "fleet_at_capacity", status))
                except NoBackendAvailable as exc:
                    if last is not None:
                        break  # nowhere else to retry: report the backend failure, not an empty fleet
                    self.metrics.errors.labels("no_backend").inc()
                    status = self.config.no_healthy_backend_status
                    return json_response(
                        status, error_body(f"no healthy backend: {exc}", "no_healthy_backend", status)
                    )
                if consumer is not None:
                    # The first dispatch took the consumer's slot; a retry goes on with it.
                    ticket = _Ticket(routing, consumer.name)
                    consumer = None
                if not attempt and not still_admitted(request):
                    # Revoked while it was held (a pause, its fair share): refused now, not served.
                    _Slot(routing, chosen.url, len(body), chosen.version, request_id).release()
                    return json_response(401, error_body("the API key was revoked", "unauthorized", 401))
                hold = False
                if attempt:
                    self.metrics.retries.inc()
                url = chosen.url
                tried.add(url)
                if draft is not None:
                    draft.begin(url)
                try:
                    response = await self._attempt(
                        request,
                        route_request,
                        chosen,
                        path_qs,
                        headers,
                        body,
                        request_id,
                        ticket,
                        draft,
                        blame,
                    )
                except UpstreamError as failure:
                    if draft is not None:
                        draft.end(failure.kind, chosen.version)
                    last = failure
                    if blame is None:
                        blame = Blame()
                    attributed = isinstance(failure, InputFailure) or malformed_headers(headers)
                    retried = attempt + 1 < self.config.max_attempts and (
                        failure.kind != "timeout" or self.config.retry_on_timeout
                    )
                    charged = blame.failed(url, failure.kind, attributed, retried)
                    self._on_failure(route_request, url, failure.kind, charged)
                    if failure.kind == "timeout" and not self.config.retry_on_timeout:
                        break
                    continue
                if draft is not None:
                    draft.end("ok", chosen.version)
                return response
        finally:
            if ticket is not None:
                ticket.end()  # no answer in full (it failed, or the client left): no tokens counted
        assert last is not None
        if blame is not None and blame.poisoned():
            self.metrics.poisoned((request.get(CONSUMER) or OWNER_CONSUMER).name)
        return json_response(
            BACKEND_FAILURE_STATUS,
            error_body(f"backend failed: {last}", f"backend_{last.kind}", BACKEND_FAILURE_STATUS),
        )

    def _draft_request(self, draft: RecordDraft, request: web.Request, route_request: RouteRequest) -> bool:
        """The request's part of its record: what is known before routing. The prompt's block hashes are
        the policy's own when it computed them (cache_aware), else computed here; True when they are
        still to be computed, off the loop (a large body, as ``prepare`` is)."""
        body = route_request.body
        features = route_request.features
        later = False
        if isinstance(features, list):
            hashes: list[int] | None = features
        elif len(body) > LARGE_BODY_BYTES:
            hashes, later = None, True
        else:
            hashes = _record_hashes(body) if body else None
        draft.read_body(body, hashes)
        draft.session_key = session_key(request.headers, self._session_header, case_insensitive=True)
        if self._accounting:
            consumer = request.get(CONSUMER)
            if consumer is not None:
                draft.consumer = consumer.name
        if self._record_text:
            draft.prompt = body
        return later

    async def _dispatch_recorded(
        self,
        draft: RecordDraft,
        route_request: RouteRequest,
        hold: bool,
        want: VersionWant | None,
        consumer: Consumer | None,
    ) -> Chosen:
        """The first dispatch of a recorded request: what held it goes on its draft, from the answer
        (``Chosen.held``) or from the refusal (``router.state.holds``). Gated on a version, it is timed
        whole, since the version gate's wait is what is left of it once the reported waits are taken
        out (``router.record.holds``)."""
        t0 = time.perf_counter()
        try:
            chosen = await self.routing.dispatch(route_request, frozenset(), hold, want, consumer)
        except BaseException as exc:
            draft.add_holds(holds_of(exc))
            raise
        finally:
            if want is not None:
                draft.gated_s = time.perf_counter() - t0
        draft.add_holds(chosen.held)
        return chosen

    def _on_failure(self, route_request: RouteRequest, url: str, kind: str, charged: bool = True) -> None:
        """Count the failed attempt; the routing state forgets its affinity, and with ``charged`` counts
        it against the engine (``router.http.attribution``; the empty kind says: affinity only)."""
        self.metrics.errors.labels(kind).inc()
        self.routing.failed(route_request, url, kind if charged else "")

    def _charge(self, path: str, held: list[tuple[str, str]]) -> None:
        """Failures ``Blame`` held that another engine's answer put on their engines: counted now. Their
        affinity was forgotten when they failed (no hashes: nothing more to forget)."""
        bare = RouteRequest(path, features=[])
        for url, kind in held:
            self.routing.failed(bare, url, kind)

    async def _attempt(
        self,
        request: web.Request,
        route_request: RouteRequest,
        chosen: Chosen,
        path_qs: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        request_id: str,
        ticket: _Ticket | None = None,
        draft: RecordDraft | None = None,
        blame: Blame | None = None,
    ) -> web.StreamResponse:
        """One try on ``url``. Raises ``UpstreamError`` only while nothing was sent to the client.
        ``blame``: the request's failed attempts so far; an answer below 500 here settles them.

        A cancellation (the client went away) aborts the upstream connection through ``release`` and
        frees the slot in the ``finally`` blocks; it is not an ``UpstreamError``, so nothing retries it.
        """
        # ``dispatch`` counted the request in flight, weighted by the body's size: a multi-turn request
        # resends its whole context, so the bytes in flight per backend approximate the KV each engine
        # holds (cache_aware bounds on it).
        url, version = chosen.url, chosen.version
        slot = _Slot(self.routing, url, len(body), version, request_id)
        try:
            upstream = await self.pool.request(url, request.method, path_qs, headers, body)
            if blame is not None and upstream.status < 500:
                self._charge(route_request.path, blame.answered(upstream.status))
            try:
                return await self._relay(
                    request, route_request, chosen, upstream, slot, request_id, ticket, draft
                )
            finally:
                upstream.release()
        finally:
            slot.release()

    async def _relay(
        self,
        request: web.Request,
        route_request: RouteRequest,
        chosen: Chosen,
        upstream: UpstreamResponse,
        slot: _Slot,
        request_id: str,
        ticket: _Ticket | None = None,
        draft: RecordDraft | None = None,
    ) -> web.StreamResponse:
        """``ticket``: the request's place in the consumer ledger, ended with the engine's completion
        tokens once the engine has answered in full (before the backend slot is released, so that both
        reach the routing state together). ``draft``: the request's record, given the answer's status,
        when its head left, and the answer's last bytes (its usage, read on the writer's thread)."""
        url, version = chosen.url, chosen.version
        resp_headers = CIMultiDict(
            (n.decode("latin-1"), v.decode("latin-1"))
            for n, v in filter_raw_headers(upstream.raw_headers, _RESPONSE_DROP)
        )
        resp_headers[ROUTER_REQUEST_ID_HEADER] = header_safe(request_id)
        if version is not None:
            resp_headers[VERSION_HEADER] = header_safe(version)
        if draft is not None:
            draft.a_status = upstream.status
        if upstream.status >= 500:
            raise await self._status_failure(url, upstream)
        length = upstream.content_length
        content_type = upstream.header(b"content-type") or b""
        is_sse = content_type.startswith(b"text/event-stream")
        if length is not None and length <= SMALL_RESPONSE_BYTES and not is_sse:
            payload = await upstream.read()  # an UpstreamError here is still retryable: nothing sent
            # The backend has answered in full: counted before the client write, which may fail.
            self.routing.succeeded(url)
            if ticket is not None:
                ticket.end(completion_tokens(payload[-USAGE_TAIL_BYTES:]))
            if draft is not None:
                draft.tail = payload[-RECORD_TAIL_BYTES:]
                if self._record_text:
                    draft.answer = payload
            slot.release()  # the engine's work is done; see _Slot
            response = web.Response(status=upstream.status, headers=resp_headers, body=payload)
            try:
                await response.prepare(request)
                if draft is not None:
                    draft.head_at = time.perf_counter()
                await response.write_eof()
            except ConnectionResetError:
                self.metrics.errors.labels("client_gone").inc()
                if draft is not None:
                    draft.outcome("client_gone")
            return response

        response = web.StreamResponse(status=upstream.status, headers=resp_headers)
        if length is not None:
            response.content_length = length
        # From here on the client has a status line: failures can no longer be retried.
        if draft is not None and is_sse:
            draft.sse = True
        try:
            await response.prepare(request)
            if draft is not None:
                draft.head_at = time.perf_counter()
            chunks = upstream.iter_chunks()
            # The last chunks relayed, kept by reference (no copy) to find the usage in (module doc).
            tail: list[bytes] | None = [] if ticket is not None or draft is not None else None
            while True:
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    if ticket is not None and tail is not None:
                        ticket.end(completion_tokens(b"".join(tail)[-USAGE_TAIL_BYTES:]))
                    if draft is not None and tail:
                        draft.tail = record_tail(tail)
                    slot.release()  # before the end of the stream reaches the client; see _Slot
                    break
                except UpstreamError as exc:
                    if draft is not None:
                        draft.outcome("timeout" if exc.kind == "timeout" else "stream_broken")
                    await self._broken_stream(request, response, route_request, url, is_sse, exc)
                    return response
                if tail is not None:
                    tail.append(chunk)
                    if len(tail) > USAGE_TAIL_CHUNKS:
                        del tail[0]
                await response.write(chunk)
            await response.write_eof()
        except ConnectionResetError:
            # The client went away (ClientConnectionResetError is one): not the backend's fault.
            self.metrics.errors.labels("client_gone").inc()
            if draft is not None:
                draft.outcome("client_gone")
            return response
        self.routing.succeeded(url)
        return response

    async def _status_failure(self, url: str, upstream: UpstreamResponse) -> UpstreamError:
        """A 5xx answer as a failed attempt, quoting the start of the backend's error body. Reads at most
        ``max_error_body_bytes``; a longer body leaves the exchange incomplete, so ``release`` closes
        the connection instead of reading the rest."""
        quoted = await upstream.read_at_most(self.limits.max_error_body_bytes)
        text = quoted.decode("utf-8", "replace")
        failure = InputFailure if input_attributed(upstream.status, quoted) else UpstreamError
        return failure("status", f"backend {url} answered {upstream.status}: {text}", started=True)

    async def _broken_stream(
        self,
        request: web.Request,
        response: web.StreamResponse,
        route_request: RouteRequest,
        url: str,
        is_sse: bool,
        exc: UpstreamError,
    ) -> None:
        kind = "timeout" if exc.kind == "timeout" else "stream_broken"
        # A stream past the deadline was being answered: its length is the request's, not a failure of
        # the engine (router.http.attribution). A cut stream is the engine's.
        self._on_failure(route_request, url, kind, charged=kind != "timeout")
        if is_sse:
            await response.write(sse_error_event(f"backend {url} failed mid-stream: {exc}", kind))
            await response.write_eof()
        elif request.transport is not None:
            # No in-band way to signal an error in a plain body: cut the connection so the client sees
            # a short body (length mismatch) instead of a truncated answer that looks whole.
            request.transport.close()
