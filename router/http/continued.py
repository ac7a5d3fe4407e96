"""The forwarder's side of a continued request (``router.continuation``): parts over the upstream pool.

``router.continuation.loop`` reads parts and decides moves without knowing HTTP's plumbing; this module
gives it that plumbing: an engine's answer as a ``Part`` (its connection and its backend slot given
back once, ``router.http.slots``), and ``open_move``, which dispatches a move through the routing state
like a retry (engines tried excluded, held while the fleet is paused, gated on the client's version
like the first part) and sends its body to ``/v1/completions`` with the request's own headers. A move's
engine that fails before its stream starts counts against it as a failed attempt would, and the loop
tries another while moves are left.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from aiohttp import web
from multidict import CIMultiDict

from router.consumers import OWNER_CONSUMER
from router.continuation.loop import Broke, Continuation, NoMove
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
    from router.http.forwarding import Forwarder
    from router.record.draft import RecordDraft
    from router.state.versions import VersionWant

MOVE_REFUSED = (NoBackendAvailable, PauseRefused, VersionRefused, UnknownVersion, FairShareRefused)


async def plan_request(path: str, body: bytes) -> Plan | None:
    """The continuation plan of a generation request (``plan.plan_of``); a large body is parsed off the
    loop, as the policy's ``prepare`` is."""
    if len(body) > LARGE_BODY_BYTES:
        return await asyncio.get_running_loop().run_in_executor(None, plan_of, path, body)
    return plan_of(path, body)


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
        tried: set[str],
        exclude: frozenset[str],
        want: VersionWant | None,
    ) -> None:
        self.forwarder = forwarder
        self.plan = plan
        self.route_request = route_request
        self.headers = headers
        self.request_id = request_id
        self.tried = tried
        self.exclude = exclude
        self.want = want

    async def open_move(self, body: bytes) -> HttpPart:
        fwd = self.forwarder
        try:
            chosen = await fwd.routing.dispatch(
                self.route_request, frozenset(self.tried) | self.exclude, True, self.want, None
            )
        except MOVE_REFUSED as exc:
            raise NoMove(str(exc)) from None
        url = chosen.url
        self.tried.add(url)
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
        self.forwarder.relay.failed(self.route_request, url, kind, charged)

    def client_gone(self) -> None:
        self.forwarder.metrics.errors.labels("client_gone").inc()


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
    loop = Continuation(
        moves.plan, request, head, moves, forwarder.config.continuation_max_moves, watch, draft, header_safe
    )
    part = HttpPart(forwarder, chosen, upstream, slot)
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
