"""Relaying one engine's answer to the client, and judging the attempt that produced it.

The answer is streamed chunk by chunk as it arrives (SSE included), so a long generation is never
buffered; a small non-streaming answer with a known length is read whole first (one write instead of
many, and a backend dying mid-body can still be retried: nothing has reached the client yet). A 5xx is a
failed attempt (``UpstreamError``, retried by the forwarder while nothing was sent); a stream that breaks
after its first byte ends with an SSE ``error`` event, or a cut connection for a plain body, never a
silent end a client would take for a complete answer. The backend slot is released, and the consumer's
fair-share slot ended with the engine's completion tokens, as soon as the engine has answered in full
(``router.http.slots``). Apart from the forwarder, which chooses, retries and accounts, so that each of
the two reads as one job.
"""

from __future__ import annotations

import time

from aiohttp import web
from multidict import CIMultiDict

from router.http.attribution import InputFailure, input_attributed
from router.http.headers import RESPONSE_DROP, filter_raw_headers, header_safe
from router.http.limits import DEFAULT_HTTP_LIMITS
from router.http.recording import (
    RECORD_TAIL_BYTES,
    USAGE_TAIL_BYTES,
    USAGE_TAIL_CHUNKS,
    completion_tokens,
    record_tail,
)
from router.http.slots import Slot, Ticket
from router.http.status import sse_error_event
from router.http.upstream import UpstreamError, UpstreamResponse
from router.policies.base import RouteRequest
from router.record.draft import RecordDraft
from router.state.metrics import RouterMetrics
from router.state.routing import Chosen, RoutingState
from router.state.versions import ROUTER_REQUEST_ID_HEADER, VERSION_HEADER

# Responses up to this size with a known length are read whole before answering (see module doc).
SMALL_RESPONSE_BYTES = 256 * 1024


class Relay:
    """Relays answers for one forwarder: counts outcomes in its routing state and metrics."""

    def __init__(self, routing: RoutingState, metrics: RouterMetrics, record_text: bool = False) -> None:
        """``record_text``: a small answer is kept whole on the request's record (``record_text``)."""
        self.routing = routing
        self.metrics = metrics
        self.record_text = record_text
        self.max_error_body_bytes = DEFAULT_HTTP_LIMITS.max_error_body_bytes
        """How much of a 5xx body is quoted (``HttpLimits``; set by the forwarder's ``use_limits``)."""

    def failed(self, route_request: RouteRequest, url: str, kind: str, charged: bool = True) -> None:
        """Count the failed attempt; the routing state forgets its affinity, and with ``charged`` counts
        it against the engine (``router.http.attribution``; the empty kind says: affinity only)."""
        self.metrics.errors.labels(kind).inc()
        self.routing.failed(route_request, url, kind if charged else "")

    async def relay(
        self,
        request: web.Request,
        route_request: RouteRequest,
        chosen: Chosen,
        upstream: UpstreamResponse,
        slot: Slot,
        request_id: str,
        ticket: Ticket | None = None,
        draft: RecordDraft | None = None,
    ) -> web.StreamResponse:
        """``ticket``: the request's place in the consumer ledger, ended with the engine's completion
        tokens once the engine has answered in full (before the backend slot is released, so that both
        reach the routing state together). ``draft``: the request's record, given the answer's status,
        when its head left, and the answer's last bytes (its usage, read on the writer's thread)."""
        url, version = chosen.url, chosen.version
        resp_headers = CIMultiDict(
            (n.decode("latin-1"), v.decode("latin-1"))
            for n, v in filter_raw_headers(upstream.raw_headers, RESPONSE_DROP)
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
                if self.record_text:
                    draft.answer = payload
            slot.release()  # the engine's work is done; see slots.Slot
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
            # The last chunks relayed, kept by reference (no copy) to find the usage in (recording.py).
            tail: list[bytes] | None = [] if ticket is not None or draft is not None else None
            while True:
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    if ticket is not None and tail is not None:
                        ticket.end(completion_tokens(b"".join(tail)[-USAGE_TAIL_BYTES:]))
                    if draft is not None and tail:
                        draft.tail = record_tail(tail)
                    slot.release()  # before the end of the stream reaches the client; see slots.Slot
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
        quoted = await upstream.read_at_most(self.max_error_body_bytes)
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
        self.failed(route_request, url, kind, charged=kind != "timeout")
        if is_sse:
            await response.write(sse_error_event(f"backend {url} failed mid-stream: {exc}", kind))
            await response.write_eof()
        elif request.transport is not None:
            # No in-band way to signal an error in a plain body: cut the connection so the client sees
            # a short body (length mismatch) instead of a truncated answer that looks whole.
            request.transport.close()
