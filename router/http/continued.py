"""The forwarder's side of a continued request (``router.continuation``): parts over the upstream pool.

``router.continuation.loop`` reads parts and decides moves without knowing HTTP's plumbing; this module
gives it that plumbing: an engine's answer as a ``Part`` (its connection and its backend slot given
back once, ``router.http.slots``), and ``open_move``, which dispatches a move through the routing state
like a retry (engines tried excluded, held while the fleet is paused, gated on the client's version
like the first part) and sends its body to ``/v1/completions`` with the request's own headers. A move's
engine that fails before its stream starts counts against it as a failed attempt would, and the loop
tries another while moves are left.

What a move may not land on is worked out at each move, not when the request arrived (issue 41, the
LoRA finding: a tenant's request moved off two engines in turn ended 500 under load):

* engines that *failed* this request (a broken stream, a refused move, a failed first attempt) and the
  engine it is leaving; an engine the fleet only moved it off (``removed``, ``drained``, ``restarted``,
  ``quarantined``) may take it again once it serves again;
* for an adapter's request, every serving engine that does not hold the adapter's version *now*: an
  engine restarted on a new port enters the serving set before the router has restored its adapters
  (``router.fleet.adapter_refit.on_serving``), and a move sent there got vLLM's 404. While no engine
  holds it, the move waits for one (the restore), at most the router's ``version_max_wait_s``;
* engines that refused the first part's added fields (``refused_fields``): they would refuse a move's.

An engine or front that answers 400 or 422 to the first part's body (the client's bytes with
``return_token_ids`` and the usage stream added: a Dynamo frontend refuses the unknown field) gets the
client's own bytes at once, on the same engine, and the request is proxied as without continuation: the
engine answers exactly as before, and it is neither a failed attempt nor a move. The forwarder remembers
the engine (``Forwarder.plain_only``) and sends its later requests the client's bytes straight away.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from aiohttp import web
from multidict import CIMultiDict

from router.consumers import OWNER_CONSUMER
from router.continuation.loop import MOVE_REASONS, Broke, Continuation, NoMove
from router.continuation.plan import COMPLETIONS, Plan, plan_of
from router.http.auth import CONSUMER
from router.http.bodies import LARGE_BODY_BYTES
from router.http.headers import RESPONSE_DROP, filter_raw_headers, header_safe
from router.http.slots import Slot, Ticket
from router.http.upstream import UpstreamError, UpstreamResponse
from router.policies.base import NoBackendAvailable, RouteRequest
from router.state.fair_share import FairShareRefused
from router.state.pause_gate import PauseRefused
from router.state.routing import Chosen
from router.state.versions import ROUTER_REQUEST_ID_HEADER, VERSION_HEADER, UnknownVersion, VersionRefused

if TYPE_CHECKING:
    from router.adapters.requests import AdapterRequest, AdapterRequests
    from router.http.forwarding import Forwarder
    from router.record.draft import RecordDraft
    from router.state.versions import VersionWant

MOVE_REFUSED = (NoBackendAvailable, PauseRefused, VersionRefused, UnknownVersion, FairShareRefused)
REFUSED_FIELDS = frozenset({400, 422})
"""An engine's answer to the first part that makes the router send the client's own bytes again."""
PLAIN_ONLY_MAX = 4096
"""Engines remembered as refusing the added fields, at most (a fleet restarting on new ports forever)."""
MOVE_POLL_S = 0.05


async def plain_if_refused(
    forwarder: Forwarder,
    upstream: UpstreamResponse,
    moves: Moves,
    url: str,
    method: str,
    path_qs: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
) -> tuple[UpstreamResponse, Moves | None]:
    """The engine's answer to the first part, and the request's moves; when the engine refused the first
    part's body (``REFUSED_FIELDS``), its answer to the client's own ``body`` instead, and no moves: the
    refused answer is read and let go, then the same engine is asked as without continuation. An engine
    that takes the client's bytes is remembered in ``Forwarder.plain_only`` (one that refuses them too
    refused the client's request, not the router's fields)."""
    if upstream.status not in REFUSED_FIELDS:
        return upstream, moves
    try:
        await upstream.read_at_most(forwarder.relay.max_error_body_bytes)
    finally:
        upstream.release()
    plain = await forwarder.pool.request(url, method, path_qs, headers, body)
    if plain.status < 400:
        remembered = forwarder.plain_only
        if len(remembered) >= PLAIN_ONLY_MAX:
            remembered.clear()
        remembered.add(url)
    return plain, None


async def plan_request(path: str, body: bytes) -> Plan | None:
    """The continuation plan of a generation request (``plan.plan_of``); a large body is parsed off the
    loop, as the policy's ``prepare`` is."""
    if len(body) > LARGE_BODY_BYTES:
        return await asyncio.get_running_loop().run_in_executor(None, plan_of, path, body)
    return plan_of(path, body)


async def moves_for(
    forwarder: Forwarder,
    path: str,
    body: bytes,
    route_request: RouteRequest,
    headers: list[tuple[bytes, bytes]],
    request_id: str,
) -> Moves | None:
    """The moves of a request the router continues (None: it is proxied as it is)."""
    plan = await plan_request(path, body)
    return Moves(forwarder, plan, route_request, headers, request_id) if plan is not None else None


def is_event_stream(upstream: UpstreamResponse) -> bool:
    return (upstream.header(b"content-type") or b"").startswith(b"text/event-stream")


class HttpPart:
    """One engine's streamed answer, with the backend slot ``dispatch`` charged for it."""

    def __init__(self, forwarder: Forwarder, chosen: Chosen, upstream: UpstreamResponse, slot: Slot) -> None:
        self.forwarder = forwarder
        self.url = chosen.url
        self.version = chosen.version
        self.upstream = upstream
        self.slot = slot

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.upstream.iter_chunks():
                yield chunk
        except UpstreamError as exc:
            raise Broke(exc.kind, str(exc)) from None

    def done(self, ok: bool) -> None:
        if ok:
            self.forwarder.routing.succeeded(self.url)
        self.upstream.release()  # back to the pool when the exchange completed, else closed
        self.slot.release()


class Moves:
    """``Engines`` for one request: its moves go through this forwarder's routing state and pool."""

    def __init__(
        self,
        forwarder: Forwarder,
        plan: Plan,
        route_request: RouteRequest,
        headers: list[tuple[bytes, bytes]],
        request_id: str,
    ) -> None:
        self.forwarder = forwarder
        self.plan = plan
        self.route_request = route_request
        self.headers = headers
        self.request_id = request_id
        self.tried: set[str] = set()
        """The forwarder's engines tried for this request (its own set, shared)."""
        self.want: VersionWant | None = None
        """The client's version gate, which a move meets as the first part did."""
        self.lacking: Callable[[], frozenset[str]] | None = None
        """The serving engines a move may not go to now for want of what the request names."""
        self.wait_s = 0.0
        """How long a move waits for one of ``lacking`` to be ready (0: not at all)."""
        self.current: str | None = None
        """The engine the answer is on now (left out of its next move)."""
        self.left: set[str] = set()
        """Engines the fleet moved the request off, which did not fail it."""
        self.resends = 0
        """Times the request was sent again from its start because the fleet moved it off its engine
        before its first token (``resend``): moves at token 0, out of ``continuation_max_moves``."""
        self._resent: tuple[str, str] | None = None

    def need_adapter(self, adapters: AdapterRequests | None, adapter: AdapterRequest | None) -> None:
        """A request for ``adapter``: its moves go only to engines holding its version at the time, and
        wait for one (a restarted engine's restore) up to the router's ``version_max_wait_s``."""
        if adapters is None or adapter is None:
            return
        target = adapter.route.target
        self.lacking = lambda: frozenset(u for u in adapters.serving() if u not in target.engines)
        self.wait_s = adapters.max_wait_s

    def resend(self, url: str, kind: str) -> bool:
        """Whether a first part that ended with ``kind`` on ``url`` before any token is sent again from
        its start, by the forwarder, instead of retried: the fleet's doing (``MOVE_REASONS``: a drain, a
        quarantine, a removal) is not the engine failing, so it neither uses the request's one retry nor
        counts against the engine; it counts as a move (``rl_router_moves``, the record's ``moves``) while
        moves are left."""
        if kind not in MOVE_REASONS or self.resends >= self.forwarder.config.continuation_max_moves:
            return False
        self.resends += 1
        self.left.add(url)
        self._resent = (url, kind)
        self.forwarder.metrics.moves.labels(kind).inc()
        return True

    def landed(self, url: str, draft: RecordDraft | None) -> None:
        """The request was dispatched to ``url``; after a ``resend`` its record shows the move."""
        if self._resent is None:
            return
        (left, kind), self._resent = self._resent, None
        if draft is not None:
            draft.moves = [*(draft.moves or ()), {"from": left, "to": url, "at_token": 0, "reason": kind}]

    def excluded(self) -> frozenset[str]:
        """Where a move may not go now (module doc)."""
        out = (self.tried - self.left) | self.forwarder.plain_only
        if self.current is not None:
            out = out | {self.current}
        if self.lacking is not None:
            out = out | self.lacking()
        return frozenset(out)

    async def dispatch(self) -> Chosen:
        """The move's engine (a resend's too): held while the fleet is paused, gated on the client's
        version, never one ``excluded`` names; while none but engines lacking the request's adapter could
        take it, waits (polling, ``wait_s`` at most) for one of them to get it."""
        routing = self.forwarder.routing
        until = time.monotonic() + self.wait_s
        while True:
            try:
                return await routing.dispatch(self.route_request, self.excluded(), True, self.want, None)
            except NoBackendAvailable:
                if self.lacking is None or time.monotonic() >= until:
                    raise
                waiting = self.lacking() - (self.tried - self.left) - {self.current}
                if not waiting:
                    raise  # no serving engine that may yet get the adapter
                await asyncio.sleep(MOVE_POLL_S)

    async def open_move(self, body: bytes) -> HttpPart:
        fwd = self.forwarder
        try:
            chosen = await self.dispatch()
        except MOVE_REFUSED as exc:
            raise NoMove(str(exc)) from None
        url = chosen.url
        self.tried.add(url)
        self.left.discard(url)
        self.current = url
        slot = Slot(fwd.routing, url, len(body), chosen.version, self.request_id)
        try:
            upstream = await fwd.pool.request(url, "POST", COMPLETIONS, self.headers, body)
        except UpstreamError as exc:
            slot.release()
            self.failed(url, exc.kind, True)
            raise Broke(exc.kind, str(exc)) from None
        except BaseException:  # the client went away meanwhile: the slot is not left counted
            slot.release()
            raise
        if upstream.status != 200 or not is_event_stream(upstream):
            try:
                quoted = await upstream.read_at_most(fwd.relay.max_error_body_bytes)
            finally:
                upstream.release()
                slot.release()
            self.failed(url, "status", upstream.status >= 500)
            text = quoted.decode("utf-8", "replace")
            raise Broke("status", f"backend {url} answered the move {upstream.status}: {text}")
        return HttpPart(fwd, chosen, upstream, slot)

    def failed(self, url: str, kind: str, charged: bool) -> None:
        if kind in MOVE_REASONS:  # the fleet's doing, not the engine's failure: it may serve it again
            self.left.add(url)
        self.forwarder.relay.failed(self.route_request, url, kind, charged)

    def client_gone(self) -> None:
        self.forwarder.metrics.errors.labels("client_gone").inc()

    def moved(self, reason: str) -> None:
        self.forwarder.metrics.moves.labels(reason).inc()


async def continue_answer(
    forwarder: Forwarder,
    request: web.Request,
    moves: Moves,
    chosen: Chosen,
    upstream: UpstreamResponse,
    slot: Slot,
    ticket: Ticket | None,
    draft: RecordDraft | None,
) -> web.StreamResponse:
    """The client's answer to an eligible request whose first engine answered with an event stream.
    Raises ``UpstreamError`` while the forwarder may still retry it from scratch (``loop.run``)."""
    head: CIMultiDict[str] = CIMultiDict(
        (n.decode("latin-1"), v.decode("latin-1"))
        for n, v in filter_raw_headers(upstream.raw_headers, RESPONSE_DROP)
    )
    head[ROUTER_REQUEST_ID_HEADER] = header_safe(moves.request_id)
    if chosen.version is not None:
        head[VERSION_HEADER] = header_safe(chosen.version)
    if draft is not None:
        draft.a_status = upstream.status
    watch = getattr(forwarder, "engine_watch", None)
    max_moves = forwarder.config.continuation_max_moves - moves.resends
    loop = Continuation(moves.plan, request, head, moves, max_moves, watch, draft, header_safe)
    part = HttpPart(forwarder, chosen, upstream, slot)
    moves.current = chosen.url
    try:
        response = await loop.run(part)
    except Broke as exc:
        raise UpstreamError(exc.kind, str(exc), started=True) from None
    if loop.poisoned:
        forwarder.metrics.poisoned((request.get(CONSUMER) or OWNER_CONSUMER).name)
    if ticket is not None:
        ticket.end(loop.answer.total_usage().get("completion_tokens") or 0)
    if draft is not None and forwarder.relay.record_text and loop.whole is not None:
        draft.answer = loop.whole
    return response
