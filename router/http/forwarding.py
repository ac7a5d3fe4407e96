"""Forwarding: one inbound request proxied to one backend (and, on failure, once to another).

Rules, each preventing a failure seen with real clients and peers:

* Never a redirect: clients do not follow them for POST bodies, and it would hand out an engine's URL.
* A completions or chat request the router can follow (``router.continuation.plan``) is read as an
  event stream and, when its engine breaks or the fleet moves it, continued on another engine from the
  tokens produced (``router.continuation``; the plumbing in ``router.http.continued``), up to
  ``continuation_max_moves`` times. One the fleet takes off its engine before its first token is sent
  again from its start (``Moves.resend``): not a failed attempt, so it keeps its retry. An engine that
  refuses the fields this adds (400/422: a Dynamo frontend) gets the client's own bytes at once.
  Every other request is proxied byte for byte as below.
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

This module chooses, retries and accounts; the other jobs are one module each: the headers that cross
and the request id (``router.http.headers``), relaying an answer and judging its attempt
(``router.http.relay``), the slots given back once (``router.http.slots``), and what a record and the
consumer ledger read off the passing bytes (``router.http.recording``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from router.adapters.body import UnreadableBody
from router.adapters.requests import AdapterRequest, AdapterRequests
from router.adapters.table import AdapterForbidden, AdapterUnavailable, BaseModelNotServed
from router.consumers import OWNER_CONSUMER, Consumer
from router.continuation.moves import EngineWatch
from router.http.attribution import Blame, InputFailure, malformed_headers
from router.http.auth import CONSUMER, account_of, still_admitted
from router.http.bodies import LARGE_BODY_BYTES, read_body
from router.http.capability import ROUTE_KEY
from router.http.consumer_limits import ConsumerLimits
from router.http.continued import Moves, continue_answer, is_event_stream, moves_for, plain_if_refused
from router.http.forwarding_config import ForwardingConfig as ForwardingConfig
from router.http.headers import REQUEST_DROP, REQUEST_ID, filter_raw_headers, new_request_id, request_id_of
from router.http.limits import DEFAULT_HTTP_LIMITS, HttpLimits
from router.http.recording import draft_request, record_hashes
from router.http.relay import Relay
from router.http.slots import Slot, Ticket
from router.http.status import BACKEND_FAILURE_STATUS, error_body
from router.http.upstream import UpstreamError, UpstreamPool
from router.policies.base import NoBackendAvailable, Policy, RouteRequest
from router.policies.consistent_hash import DEFAULT_SESSION_HEADER
from router.record.draft import RecordDraft
from router.record.writer import RecordWriter
from router.state.fair_share import FairShareRefused
from router.state.holds import holds_of
from router.state.metrics import RouterMetrics
from router.state.pause_gate import PauseRefused
from router.state.routing import Chosen, RoutingState
from router.state.versions import (
    REQUEST_ID_HEADER,
    WANT_HEADER,
    UnknownVersion,
    VersionRefused,
    VersionWant,
)

JSON = "application/json"
# Held while the fleet is paused (generation); /tokenize and /v1/models do not reach the engine core.
HELD_DURING_PAUSE = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})


def json_response(status: int, body: bytes) -> web.Response:
    return web.Response(status=status, body=body, content_type=JSON)


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
        # The answer's side of each attempt (router.http.relay): relayed, or judged a failed attempt.
        self.relay = Relay(routing, metrics, config.record_text)
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
        self.adapters: AdapterRequests | None = None
        """The fleet's LoRA adapters (set by the router where it serves them): a generation request whose
        ``model`` names one goes to its current version's served name, on the engines holding it."""
        self.engine_watch = EngineWatch()
        """This process's tracked attempts by engine (``router.continuation.moves``): the fleet side asks
        the requests on a drained, quarantined, removed or restarted engine to move through it."""
        self.plain_only: set[str] = set()
        """Engines that refused a continued request's added fields and took the client's own bytes (a
        Dynamo frontend): their requests are proxied as they are (``router.http.continued``)."""

    def use_limits(self, limits: HttpLimits) -> None:
        """Apply the backend-side limits (header bytes, quoted error body); called before serving."""
        self.limits = limits
        self.pool.max_header_bytes = limits.max_backend_header_bytes
        self.relay.max_error_body_bytes = limits.max_error_body_bytes

    async def close(self) -> None:
        await self.pool.close()
        if self.record is not None:
            # Bounded (RecordWriter.close), and off the loop: the last batch may meet a slow disk.
            await asyncio.get_running_loop().run_in_executor(None, self.record.close)

    # -- the handler ----------------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        route = request.get(ROUTE_KEY)  # a route under the registration capability's prefix
        if route is None:
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
        if draft is not None and draft_request(
            draft, request, route_request, self._session_header, self._accounting, self._record_text
        ):
            draft.hashes = await asyncio.get_running_loop().run_in_executor(None, record_hashes, body)
        headers = filter_raw_headers(request.raw_headers, REQUEST_DROP)
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
                headers = [(n, v) for n, v in headers if n.lower() != REQUEST_ID]
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
        adapter: AdapterRequest | None = None
        if hold and self.adapters is not None:
            try:
                caller = account_of(request)  # as the adapter routes name owners
                adapter = await self.adapters.prepare(body, caller, want, len(body) > LARGE_BODY_BYTES)
            except AdapterForbidden as exc:
                self.metrics.errors.labels("adapter_forbidden").inc()
                return json_response(403, error_body(str(exc), "forbidden", 403))
            except (AdapterUnavailable, VersionRefused) as exc:
                self.metrics.errors.labels("adapter_unavailable").inc()
                status = self.config.no_healthy_backend_status
                return json_response(status, error_body(str(exc), "adapter_unavailable", status))
            except UnknownVersion as exc:
                self.metrics.errors.labels("unknown_weight_version").inc()
                return json_response(400, error_body(str(exc), "unknown_weight_version", 400))
            except BaseModelNotServed as exc:
                self.metrics.errors.labels("model_not_served").inc()
                return json_response(404, error_body(str(exc), "model_not_found", 404))
            except UnreadableBody as exc:  # the engine may read what the router cannot: never passed on
                self.metrics.errors.labels("unreadable_body").inc()
                return json_response(400, error_body(str(exc), "invalid_request_error", 400))
            if adapter is not None:
                body, want = adapter.body, None  # the gate was the adapter's version, met above
                route_request = self.policy.scope(route_request, adapter.route.served)
                adapter.route.target.enter()
        shown = adapter.route.version if adapter is not None else None
        tried: set[str] = set()
        # Planned once dispatched, not before: a request held for a pause or a fair share keeps only its
        # bytes (a parsed body would double what the held bodies' bound lets it keep).
        continued = hold and self.config.continuation_max_moves > 0
        moves: Moves | None = None
        last: UpstreamError | None = None
        ticket: Ticket | None = None
        blame: Blame | None = None  # made at the first failure (router.http.attribution)
        attempt = 0  # failed attempts so far, against max_attempts (a resend at token 0 is not one)
        first = True  # no dispatch yet
        retrying = False  # the next dispatch follows a failed attempt
        try:
            while attempt < self.config.max_attempts:
                try:
                    if draft is not None and first:
                        chosen = await self._dispatch_recorded(
                            draft,
                            route_request,
                            hold,
                            want,
                            consumer,
                            adapter.exclude if adapter else frozenset(),
                        )
                    elif moves is not None and not retrying:
                        chosen = await moves.dispatch()  # a resend: where a move may go now
                    else:
                        excluded = frozenset(tried) | adapter.exclude if adapter else frozenset(tried)
                        chosen = await routing.dispatch(route_request, excluded, hold, want, consumer)
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
                    ticket = Ticket(routing, consumer.name)
                    consumer = None
                if first and not still_admitted(request):
                    # Revoked while it was held (a pause, its fair share): refused now, not served.
                    Slot(routing, chosen.url, len(body), chosen.version, request_id).release()
                    return json_response(401, error_body("the API key was revoked", "unauthorized", 401))
                hold = False
                if retrying:
                    self.metrics.retries.inc()
                url = chosen.url
                tried.add(url)
                if draft is not None:
                    draft.begin(url)
                if moves is not None:
                    moves.landed(url, draft)
                if continued and first:
                    moves = await moves_for(self, request.path, body, route_request, headers, request_id)
                    if moves is not None:
                        moves.tried, moves.want = tried, want
                        moves.need_adapter(self.adapters, adapter)
                first = False
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
                        shown,
                        moves,
                    )
                except UpstreamError as failure:
                    if draft is not None:
                        draft.end(failure.kind, chosen.version)
                    if moves is not None and moves.resend(url, failure.kind):
                        # The fleet took the engine away before the answer's first token (a drain, a
                        # quarantine): nothing to continue, so the request is sent again from its start,
                        # as a move at token 0, charged to no engine and not a retry.
                        self.relay.failed(route_request, url, failure.kind, charged=False)
                        retrying = False
                        continue
                    last = failure
                    attempt += 1
                    retrying = True
                    if blame is None:
                        blame = Blame()
                    attributed = isinstance(failure, InputFailure) or malformed_headers(headers)
                    retried = attempt < self.config.max_attempts and (
                        failure.kind != "timeout" or self.config.retry_on_timeout
                    )
                    charged = blame.failed(url, failure.kind, attributed, retried)
                    self.relay.failed(route_request, url, failure.kind, charged)
                    if failure.kind == "timeout" and not self.config.retry_on_timeout:
                        break
                    continue
                if draft is not None:
                    draft.end("ok", chosen.version)
                return response
        finally:
            if ticket is not None:
                ticket.end()  # no answer in full (it failed, or the client left): no tokens counted
            if adapter is not None:
                adapter.route.target.leave()
        assert last is not None
        if blame is not None and blame.poisoned():
            self.metrics.poisoned((request.get(CONSUMER) or OWNER_CONSUMER).name)
        return json_response(
            BACKEND_FAILURE_STATUS,
            error_body(f"backend failed: {last}", f"backend_{last.kind}", BACKEND_FAILURE_STATUS),
        )

    async def _dispatch_recorded(
        self,
        draft: RecordDraft,
        route_request: RouteRequest,
        hold: bool,
        want: VersionWant | None,
        consumer: Consumer | None,
        exclude: frozenset[str] = frozenset(),
    ) -> Chosen:
        """The first dispatch of a recorded request: what held it goes on its draft, from the answer
        (``Chosen.held``) or from the refusal (``router.state.holds``). Gated on a version, it is timed
        whole, since the version gate's wait is what is left of it once the reported waits are taken
        out (``router.record.holds``)."""
        t0 = time.perf_counter()
        try:
            chosen = await self.routing.dispatch(route_request, exclude, hold, want, consumer)
        except BaseException as exc:
            draft.add_holds(holds_of(exc))
            raise
        finally:
            if want is not None:
                draft.gated_s = time.perf_counter() - t0
        draft.add_holds(chosen.held)
        return chosen

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
        ticket: Ticket | None = None,
        draft: RecordDraft | None = None,
        blame: Blame | None = None,
        shown: str | None = None,
        moves: Moves | None = None,
    ) -> web.StreamResponse:
        """One try on ``url``. Raises ``UpstreamError`` only while nothing was sent to the client.
        ``blame``: the request's failed attempts so far; an answer below 500 here settles them.
        ``shown``: the version the answer's header names when it is not the engine's (an adapter's).
        ``moves``: an eligible request's continuation (its first part's body is the plan's).

        A cancellation (the client went away) aborts the upstream connection through ``release`` and
        frees the slot in the ``finally`` blocks; it is not an ``UpstreamError``, so nothing retries it.
        """
        # ``dispatch`` counted the request in flight, weighted by the body's size: a multi-turn request
        # resends its whole context, so the bytes in flight per backend approximate the KV each engine
        # holds (cache_aware bounds on it).
        url, version = chosen.url, chosen.version
        slot = Slot(self.routing, url, len(body), version, request_id)
        if moves is not None and url in self.plain_only:
            moves = None  # it refused the added fields before: the client's bytes, as they are
        try:
            sent = body if moves is None else moves.plan.first_body
            upstream = await self.pool.request(url, request.method, path_qs, headers, sent)
            if moves is not None:  # an engine that refuses the added fields gets the client's bytes
                upstream, moves = await plain_if_refused(
                    self, upstream, moves, url, request.method, path_qs, headers, body
                )
            if blame is not None and upstream.status < 500:
                self._charge(route_request.path, blame.answered(upstream.status))
            answered = chosen if shown is None else chosen._replace(version=shown)
            try:
                if moves is not None and upstream.status == 200 and is_event_stream(upstream):
                    return await continue_answer(
                        self, request, moves, answered, upstream, slot, ticket, draft
                    )
                return await self.relay.relay(
                    request, route_request, answered, upstream, slot, request_id, ticket, draft
                )
            finally:
                upstream.release()
        finally:
            slot.release()
