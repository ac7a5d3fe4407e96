"""The continuation loop: read an engine's part, and when it breaks, go on with the rest elsewhere.

One ``Continuation`` per eligible request (``plan.plan_of``), from the moment its first engine answered
200 with an event stream. It reads the part's events into the ``stitch.Answer`` and relays the client's
chunks as they come (or keeps them, for a client that did not ask to stream). A part *breaks* when its
connection fails, its engine sends an error event, or its stream ends before a finish reason; it is
*moved* when the fleet asks (``moves.Watch.moved``: the engine is drained, quarantined, removed or
restarted), which cuts the part at once. Either way the answer goes on with a move: another engine
(through ``Engines.open_move``: the routing state's dispatch, engines tried excluded) gets the prompt's
token ids plus the tokens produced, at most ``max_moves`` times per request, and not after a second
engine broke on it (``Continuation.breaks``).

What is not moved falls back to what the forwarder always did:

* the first part broke before the client got anything and before a token was produced: ``Broke`` is
  raised to the forwarder, which retries from scratch (once, on another engine) as for any request;
* no move is left, no engine takes it, or the answer cannot be continued exactly (``Answer.continuable``):
  a streamed answer ends with the SSE ``error`` event, a whole one is answered 500; nothing that was
  produced is passed off as a complete answer.

A streamed client's head is sent with the first chunk that carries a token (a chat's role chunk waits
for it), so that a first part that dies at once is still retried from scratch with nothing sent. Its
spans go on the last chunk (``weight_versions``); a whole answer has them in the header too. Chunks of
tokens whose text has not come yet (an unfinished UTF-8 character) are held until it comes: a move
continues after the last settled token (``Answer.cut_to_settled``), and the client never sees a token
twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from aiohttp import web
from multidict import CIMultiDict

from router.continuation.plan import Plan
from router.continuation.spans import Spans
from router.continuation.sse import DONE, Events
from router.continuation.stitch import Answer
from router.state.versions import WEIGHT_VERSIONS_HEADER

if TYPE_CHECKING:
    from router.continuation.moves import EngineWatch, Watch
    from router.record.draft import RecordDraft


class Broke(Exception):
    """A part ended before its answer did (``kind``: ``reset``, ``timeout``, ``status``, ``stream_error``,
    ``stream_broken``, or the fleet's move reason)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


class NoMove(Exception):
    """No engine takes a move now (none serving beyond those tried, a pause or version gate past its
    bound)."""


class Part(Protocol):
    """One engine's answer being read."""

    url: str
    version: str | None

    def chunks(self) -> AsyncIterator[bytes]:
        """The body's chunks; raises ``Broke`` when the connection fails."""
        ...

    def done(self, ok: bool) -> None:
        """The part is over (``ok``: the engine answered in full): its connection and slot go back."""
        ...


class Engines(Protocol):
    """The forwarder's side: where a move goes, and how a failed part is counted."""

    async def open_move(self, body: bytes) -> Part:
        """Dispatch and send a move's body; raises ``NoMove``, or ``Broke`` for an engine that failed it."""
        ...

    def failed(self, url: str, kind: str, charged: bool) -> None: ...

    def client_gone(self) -> None: ...

    def moved(self, reason: str) -> None:
        """Count a move that another engine took (``rl_router_moves``)."""


class Continuation:
    def __init__(
        self,
        plan: Plan,
        request: web.Request,
        head: CIMultiDict[str],
        engines: Engines,
        max_moves: int,
        watch: EngineWatch | None = None,
        draft: RecordDraft | None = None,
        header_safe: Callable[[str], str] = str,
    ) -> None:
        """``head``: the client's answer headers (the engine's, filtered, with the router's own);
        ``watch``: where the fleet asks requests to move (None: only breaks move them)."""
        self.plan = plan
        self.request = request
        self.head = head
        self.engines = engines
        self.max_moves = max_moves
        self.engine_watch = watch
        self.draft = draft
        self.header_safe = header_safe
        self.spans = Spans(None)
        self.answer = Answer(plan, self.spans)
        self.moves = 0
        self.response: web.StreamResponse | None = None
        self._waiting: list[bytes] = []
        self._held: list[bytes] = []  # chunks of tokens whose text has not come (Answer.pending)
        self._ready = False  # an event the router does not read went by: nothing waits any more
        self._tail: list[bytes] = []
        self.whole: bytes | None = None
        self.broken: list[str] = []
        """The kind of each part that broke (the moves' causes), in order."""
        """A whole answer's body, once sent (the record keeps it with ``record_text``)."""

    # -- the loop -----------------------------------------------------------------------------------
    async def run(self, first: Part) -> web.StreamResponse:
        """The client's answer, all parts stitched. Raises ``Broke`` only while nothing was sent and no
        token produced on the first part (the forwarder retries it)."""
        self.spans = self.answer.spans = Spans(first.version)
        part = first
        while True:
            try:
                await self._read(part)
            except Broke as broke:
                if self.answer.finish_reason is not None:  # the answer was whole; only its end was lost
                    part.done(False)
                    break
                part.done(False)
                if part is first and self.response is None and not self.answer.produced:
                    raise  # today's retry, by the forwarder (which counts the failure)
                # As the plain relay counts a broken stream: past its deadline, the request's length.
                kind = broke.kind
                if kind not in MOVE_REASONS:
                    kind = "timeout" if kind == "timeout" else "stream_broken"
                self.broken.append(kind)
                second = self.breaks >= 2
                # The forwarder's rule (router.http.attribution): the second engine a request breaks is
                # not charged to that engine, and the request stops there.
                self.engines.failed(part.url, kind, charged=kind == "stream_broken" and not second)
                if self.draft is not None:
                    self.draft.end(kind, part.version)
                try:
                    if second:
                        raise NoMove(
                            f"it broke the stream of {self.breaks} engines (the request may be the cause)"
                        )
                    part = await self._move(part, broke)
                except (NoMove, Broke) as why:
                    return await self._give_up(why)
                continue
            except ConnectionResetError:
                part.done(False)
                self.engines.client_gone()
                if self.draft is not None:
                    self.draft.outcome("client_gone")
                return self.response or web.Response(status=499)
            except BaseException:
                part.done(False)
                raise
            part.done(True)
            break
        return await self._finish()

    async def _read(self, part: Part) -> None:
        """Read ``part`` to its end; raises ``Broke`` when it breaks or the fleet moves it."""
        watch: Watch | None = None
        if self.engine_watch is not None:
            watch = self.engine_watch.watch(part.url)
            answer, spans = self.answer, self.spans
            watch.on_version = lambda v: spans.change(v, answer.produced)
        try:
            if watch is None:
                await self._events(part)
                return
            reader = asyncio.ensure_future(self._events(part))
            moved = asyncio.ensure_future(watch.moved.wait())
            try:
                await asyncio.wait((reader, moved), return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                moved.cancel()
                reader.cancel()
                raise
            moved.cancel()
            if not reader.done():
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, Broke, ConnectionResetError):
                    await reader
                raise Broke(watch.reason or "moved", f"{part.url}: the fleet moved its requests")
            reader.result()
        finally:
            if watch is not None and self.engine_watch is not None:
                self.engine_watch.unwatch(watch)

    async def _events(self, part: Part) -> None:
        events = Events()
        answer = self.answer
        done = False
        stream = self.plan.stream
        async for chunk in part.chunks():
            batch = self._waiting  # the client's bytes of this read, written at once
            if stream and not answer.continuable and not answer.parts and self.response is not None:
                ended = chunk.endswith(b"data: [DONE]\n\n")
                plain = chunk[: -len(b"data: [DONE]\n\n")] if ended else chunk
                if not events.pending and self._plain_read(plain):
                    if plain:  # whole events, none the router must read: as they came
                        await self._send([plain])
                    done = done or ended  # the router writes its own [DONE]
                    continue
            for name, data in events.feed(chunk):
                if data == DONE:
                    done = True
                    continue
                if name == "error":
                    raise Broke("stream_error", data.decode("utf-8", "replace")[:500])
                if stream and not answer.continuable and not answer.parts and _plain_chunk(data):
                    # No move can follow: what is left of the answer is relayed unread, as the plain
                    # relay would (less the token ids the client did not ask for).
                    batch.append(
                        b"data: " + (data if self.plan.token_ids else without_token_ids(data)) + b"\n\n"
                    )
                    continue
                event = _json_object(data)
                if event is not None and "error" in event:
                    raise Broke("stream_error", data.decode("utf-8", "replace")[:500])
                if event is None or ("choices" not in event and "usage" not in event):
                    # Not a chunk the router reads: relayed as it came, and no longer continued.
                    answer.continuable = False
                    if stream:
                        prefix = f"event: {name}\n".encode() if name else b""
                        batch.append(prefix + b"data: " + data.replace(b"\n", b"\ndata: ") + b"\n\n")
                        self._ready = True
                    continue
                out = answer.feed(event, not stream or answer.parts > 0)
                if out is not None and stream:
                    if answer.pending:  # held until their text comes: a move may take them back
                        self._held.append(self._client_bytes(out, data))
                        continue
                    if self._held:
                        batch += self._held
                        self._held = []
                    batch.append(self._client_bytes(out, data))
            started = answer.produced or answer.chars or answer.finish_reason is not None
            if batch and (started or self._ready or not answer.continuable):
                self._waiting = []
                await self._send(batch)
        if answer.finish_reason is None and not done:
            raise Broke("stream_broken", f"{part.url}: the stream ended before its answer")

    async def _move(self, part: Part, broke: Broke) -> Part:
        """The next part: another engine continues the answer (each try counts as a move)."""
        answer = self.answer
        if not answer.continuable or answer.prompt_ids is None:
            raise NoMove("this answer cannot be continued exactly (no token ids, or a parser reads it)")
        answer.cut_to_settled()
        self._held = []  # never sent: the next engine makes those tokens again
        if self.plan.max_tokens is not None and answer.produced >= self.plan.max_tokens:
            answer.finish_reason = "length"  # its budget was spent: the engine died before saying so
            raise _Complete
        last_error: Exception = broke
        while self.moves < self.max_moves:
            self.moves += 1
            try:
                new = await self.engines.open_move(self.plan.resume_body(answer.prompt_ids, answer.ids))
            except Broke as exc:
                last_error = exc
                continue
            answer.new_part()
            self.engines.moved(broke.kind)
            self.spans.change(new.version, answer.produced)
            if self.draft is not None:
                move = {"from": part.url, "to": new.url, "at_token": answer.produced, "reason": broke.kind}
                self.draft.moves = [*(self.draft.moves or ()), move]
                self.draft.begin(new.url)
                self.draft.a_status = 200
            return new
        raise NoMove(f"no move left ({self.max_moves} per request): {last_error}")

    # -- the client's side --------------------------------------------------------------------------
    def _plain_read(self, chunk: bytes) -> bool:
        """A read of whole plain events (``_plain_chunk``, each), without ``[DONE]`` or an event name, and
        without token ids the client did not ask for: relayed as it is, without splitting it."""
        if not chunk:
            return True
        if not chunk.endswith(b"\n\n") or b"[DONE]" in chunk or b"event:" in chunk or b"\r" in chunk:
            return False
        if chunk.count(b'"finish_reason":') != chunk.count(b'"finish_reason":null'):
            return False
        if not self.plan.token_ids and b'token_ids"' in chunk:
            return False
        return b'"usage"' not in chunk and b'"error"' not in chunk

    def _client_bytes(self, chunk: dict[str, Any], data: bytes) -> bytes:
        """The client's event for ``chunk`` (the engine's ``data`` parsed and reshaped by the answer).
        The first part's events are in the client's shape already: sent as the engine wrote them, less
        the token ids the client did not ask for (no serialization per token)."""
        answer = self.answer
        if answer.versions_due(chunk):
            chunk["weight_versions"] = self.spans.spans(answer.produced)
        elif not answer.parts:
            return b"data: " + (data if self.plan.token_ids else without_token_ids(data)) + b"\n\n"
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    async def _send(self, batch: list[bytes]) -> None:
        """Write ``batch``: the head first, with the first chunk that carries a token (the chunks before,
        a chat's role chunk, wait for it in ``_waiting``)."""
        if self.response is None:
            await self._prepare()
        await self._write(b"".join(batch))

    async def _prepare(self) -> web.StreamResponse:
        response = self.response = web.StreamResponse(status=200, headers=self.head)
        await response.prepare(self.request)
        if self.draft is not None:
            self.draft.head_at = time.perf_counter()
            self.draft.sse = True
        return response

    async def _write(self, data: bytes) -> None:
        assert self.response is not None
        tail = self._tail
        tail.append(data)
        if len(tail) > 4:
            del tail[0]
        await self.response.write(data)

    async def _finish(self) -> web.StreamResponse:
        answer = self.answer
        if self.draft is not None:
            self.draft.weight_versions = self.spans.spans(answer.produced)
        if self.plan.stream:
            if self.response is None:
                await self._prepare()
            await self._write(b"".join(self._waiting + self._held) + answer.final_chunks())
            if self.draft is not None:
                self.draft.tail = b"".join(self._tail)[-4096:]
            assert self.response is not None
            await self.response.write_eof()
            return self.response
        body = orjson.dumps(answer.whole())
        head = CIMultiDict(self.head)
        head["Content-Type"] = "application/json"
        head[WEIGHT_VERSIONS_HEADER] = self.header_safe(self.spans.header(answer.produced))
        self.whole = body
        if self.draft is not None:
            self.draft.tail = body[-4096:]
        response = web.Response(status=200, headers=head, body=body)
        await response.prepare(self.request)
        if self.draft is not None:
            self.draft.head_at = time.perf_counter()
        await response.write_eof()
        return response

    @property
    def breaks(self) -> int:
        """The parts that broke on their own (a reset, an error event, a timeout), not moved by the fleet.
        A request that breaks a second engine is not moved again: a request that crashes engines (a
        prompt that trips a kernel bug) would otherwise take ``1 + max_moves`` of them down, where the
        forwarder's retry lets it reach two. Moves the fleet asks for are not the request's doing."""
        return sum(kind not in MOVE_REASONS for kind in self.broken)

    @property
    def poisoned(self) -> bool:
        """Whether the request broke two engines (their streams, or the backend timeout on each): the
        request's fault, as ``router.http.attribution`` says of a request that fails wherever it goes."""
        return self.breaks >= 2

    async def _give_up(self, why: Exception) -> web.StreamResponse:
        """No move: the SSE error event on a streamed answer, 500 on a whole one (module doc)."""
        message = f"generation could not be continued after {self.answer.produced} tokens: {why}"
        if isinstance(why, _Complete):
            return await self._finish()
        if self.draft is not None:
            self.draft.outcome("stream_broken")
        if self.plan.stream and self.response is not None:
            payload = orjson.dumps({"error": {"message": message, "type": "stream_broken", "code": 500}})
            await self._write(b"event: error\ndata: " + payload + b"\n\n")
            await self.response.write_eof()
            return self.response
        # Named as the forwarder names its last failure (``backend_timeout``, ...), so a client's retry
        # logic reads a continued request's end as it read a retried one's.
        last = self.broken[-1] if self.broken else "failed"
        kind = "failed" if last in MOVE_REASONS else last
        body = orjson.dumps(
            {"error": {"message": message, "type": f"backend_{kind}", "code": 500}, "router": True}
        )
        response = web.Response(status=500, body=body, content_type="application/json")
        await response.prepare(self.request)
        await response.write_eof()
        return response


_TOKEN_ID_KEYS = (b'"prompt_token_ids":', b'"token_ids":')


def without_token_ids(data: bytes) -> bytes:
    """An engine's event without its ``token_ids`` and ``prompt_token_ids`` members (a list of ints or
    null), cut from the bytes: a key's quotes are bare, while a quote inside a JSON string is escaped, so
    generated text cannot match. Once per token: a re-serialization of the event costs several times
    more."""
    if b'token_ids"' not in data:
        return data
    for key in _TOKEN_ID_KEYS:
        i = data.find(key)
        while i >= 0:
            j = i + len(key)
            if data.startswith(b"null", j):
                end = j + 4
            elif data.startswith(b"[", j):
                end = data.find(b"]", j) + 1
                if not end:
                    return data
            else:
                return data  # not a shape the router writes back without reading it
            if data[i - 1 : i] == b",":
                data = data[: i - 1] + data[end:]
                i -= 1
            else:
                data = data[:i] + data[end + 1 :] if data[end : end + 1] == b"," else data[:i] + data[end:]
            i = data.find(key, i)
    return data


def _plain_chunk(data: bytes) -> bool:
    """An event that neither ends the answer, nor carries usage or an error (read by bytes: keys are
    bare quotes, quotes in strings escaped)."""
    if b'"finish_reason":null' not in data and b'"finish_reason":' in data:
        return False
    return b'"usage"' not in data and b'"error"' not in data


def _json_object(data: bytes) -> dict[str, Any] | None:
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return event if isinstance(event, dict) else None


class _Complete(NoMove):
    """The answer turned out complete (its budget spent) when its part broke."""


MOVE_REASONS = frozenset({"drained", "quarantined", "removed", "restarted", "moved"})
