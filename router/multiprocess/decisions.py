"""The decision channel between a router's worker processes and its one routing state (the parent).

Why a channel at all: affinity and the load bound are only as good as the state they read. Worker
processes that each kept their own prefix index and in-flight counts would each see a fraction of the
fleet: a session's next turn parsed by another worker would find no affinity, and N workers would each
let a backend reach the load cap. So the state stays in one process (the parent, which also owns the
serving set, the prober and the admin API) and every worker asks it.

What crosses, and what does not: a worker parses the request, hashes the prompt (``Policy.prepare``) and
relays the bytes; only the decision's inputs cross (the block hashes as packed 64-bit integers, the body's
size, the backends already tried, the session header when the policy keys on one) and one URL comes back.
Release, success and failure are one-way messages on the same ordered stream, so a worker never waits for
them. A 20 KB prompt is ~20 hashes: ~200 bytes each way instead of the prompt.

The frame: ``<u32 payload length><u8 kind><payload>``; every payload layout is defined here and nowhere
else (one module owns the shape of what two processes exchange).

The fleet pause: a generation request's DISPATCH carries the ``HOLD`` flag, and while the parent's
``PauseGate`` is closed the parent delays its answer until resume (one gate for the whole router: its
``max_held`` and ``max_wait_s`` count every worker's requests together). Past either bound it answers
``PAUSE_REFUSED`` with the client's message, which the worker's forwarder turns into the same response a
one-process router gives. A held request whose client goes away is withdrawn (``CANCEL``), so it stops
counting against ``max_held`` at once, as it would in one process.

Weight versions (``router.state.versions``, kept by the parent): an ``OK`` answer carries the chosen
engine's version as the parent knew it then, and the worker's ``RELEASE`` gives that version back with the
request's id, so the parent counts and lists the request if the engine's version changed meanwhile (a
straddler); a release with no version costs nothing more. A DISPATCH gated on a version carries it (flags
``WANT`` and ``AT_LEAST``, the version after the hashes) and the parent decides, holds (after the pause
gate; ``CANCEL`` withdraws it as it does at the gate) or refuses (``UNKNOWN_VERSION`` at once,
``VERSION_REFUSED`` past the bounds), each answered as a one-process router would.

Consumers and fair share (``router.state.fair_share``, kept by the parent): a generation request's DISPATCH
carries its consumer's name and weight (flag ``CONSUMER``, after the hashes), and where the parent keeps a
consumer ledger it takes the consumer's fair-share slot after the pause and version holds, holding the
answer while the fleet is at capacity (``CANCEL`` withdraws it; ``FAIR_SHARE_REFUSED`` past the bound). An
``OK`` answer to such a dispatch means the worker holds a slot, which its ``FINISH`` (one-way, with the
engine's completion tokens) gives back. So the capacity and the shares are those of one router, whatever
the number of workers.

Holds, for the request record (``router.state.holds``): a request the parent held answers ``OK_HELD``
instead of ``OK``, with the seconds it waited at the pause gate and for a fair-share slot (two f32 before
the URL), which the worker puts on its answer (``Chosen.held``) as a one-process router does; a decision
that did not wait is a plain ``OK``, as before.

A worker that dies leaves requests counted in flight; the parent keeps a ledger per channel and releases
whatever a closed channel still held (backend slots and fair-share slots), so a crashed worker cannot
inflate the load bound, or keep the fleet at capacity, for good. A worker whose channel closes (the parent
died) stops serving and exits: no orphan keeps the port.
"""

from __future__ import annotations

import array
import asyncio
import logging
import struct
from collections.abc import Callable, Coroutine
from typing import Any

import orjson

from router.consumers import Consumer
from router.policies.base import NoBackendAvailable, Policy, RouteRequest
from router.state.fair_share import FairShareRefused
from router.state.holds import NO_HOLDS, PAUSE, SHARE, Holds
from router.state.pause_gate import PauseRefused
from router.state.routing import Chosen, LocalRouting
from router.state.versions import UnknownVersion, VersionRefused, VersionWant

log = logging.getLogger(__name__)

HEADER = struct.Struct("<IB")
# kinds: worker -> parent
HELLO, READY, DISPATCH, RELEASE, FAILED, SUCCEEDED, STATS, CANCEL, FINISH = 1, 2, 3, 4, 5, 6, 7, 10, 11
# kinds: parent -> worker
CHOSEN, STATS_ASK = 8, 9
# DISPATCH flags
HOLD = 1  # a generation request: held while the fleet is paused (and while no engine has its version)
WANT = 2  # gated on a weight version: the version follows the hashes
AT_LEAST = 4  # with WANT: that version or any stamped after it
CONSUMER = 8  # with HOLD: the consumer (u8 name length, the name, f64 weight) follows the hashes
# CHOSEN outcomes
NO_BACKEND, OK, PAUSE_REFUSED, WITHDRAWN, UNKNOWN_VERSION, VERSION_REFUSED, FAIR_SHARE_REFUSED = range(7)
OK_HELD = 7
_REFUSALS: dict[int, type[Exception]] = {
    PAUSE_REFUSED: PauseRefused,
    UNKNOWN_VERSION: UnknownVersion,
    VERSION_REFUSED: VersionRefused,
    FAIR_SHARE_REFUSED: FairShareRefused,
}

_HELLO = struct.Struct("<II")  # worker index, pid
# id, body size, n excluded, key bytes, n hashes (-1: none), flags; then the excluded URLs (each u16
# length + bytes), the key, the hashes, with CONSUMER the consumer, and with WANT the wanted version (the
# rest)
_DISPATCH = struct.Struct("<IqHHiB")
# request id, outcome: OK (u16 URL length, the URL, then the engine's version: the rest, empty for
# none), OK_HELD (the seconds held at the pause gate and for a fair-share slot, two f32, then as OK),
# NO_BACKEND / PAUSE_REFUSED / UNKNOWN_VERSION / VERSION_REFUSED (the reason follows), WITHDRAWN
_CHOSEN = struct.Struct("<IB")
_HELD = struct.Struct("<ff")
# body size, URL bytes, version bytes (0: none); the URL, the version, then the request id (the rest,
# only with a version: without one the release cannot straddle)
_RELEASE = struct.Struct("<qHH")
_FAILED = struct.Struct("<HHi")  # URL bytes, kind bytes (empty: only forget the affinity), n hashes
# completion tokens, counted (0: the request never reached an engine); the consumer's name (the rest)
_FINISH = struct.Struct("<IB")
_F64 = struct.Struct("<d")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")


def frame(kind: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), kind) + payload


def _pack_hashes(features: object) -> tuple[int, bytes]:
    if features is None:
        return -1, b""
    packed = array.array("q", features)  # type: ignore[arg-type]
    return len(packed), packed.tobytes()


def _unpack_hashes(data: bytes, offset: int, n: int) -> list[int] | None:
    if n < 0:
        return None
    packed = array.array("q")
    packed.frombytes(data[offset : offset + 8 * n])
    return packed.tolist()


class _Framed(asyncio.Protocol):
    """Splits a byte stream into frames and hands each to ``on_frame``; sends frames in batches.

    Frames sent during one turn of the event loop go out in one write at the end of it: a request
    sends three (dispatch, success, release) and a busy worker sends many per turn, and a write system
    call per frame was the largest single cost of the channel in a profile (bench/README.md)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._out: list[bytes] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport
        self._loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos, end = 0, len(buf)
        unpack = HEADER.unpack_from
        while end - pos >= 5:
            length, kind = unpack(buf, pos)
            if end - pos - 5 < length:
                break
            self.on_frame(kind, bytes(buf[pos + 5 : pos + 5 + length]))
            pos += 5 + length
        if pos:
            del buf[:pos]

    def on_frame(self, kind: int, payload: bytes) -> None:
        raise NotImplementedError

    def send(self, data: bytes) -> None:
        out = self._out
        out.append(data)
        if len(out) == 1 and self._loop is not None:
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        out = self._out
        if not out:
            return
        self._out = []
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(b"".join(out) if len(out) > 1 else out[0])


# -- the parent's side -------------------------------------------------------------------------------------
class WorkerChannel(_Framed):
    """One worker's connection to the routing state, on the parent's loop."""

    def __init__(self, service: DecisionService) -> None:
        super().__init__()
        self.service = service
        self.index = -1
        self.pid = 0
        self.ready = False
        # url -> [requests, body bytes] this worker holds in flight; released if the worker dies.
        self.ledger: dict[str, list[int]] = {}
        self._stats: dict[int, asyncio.Future[bytes]] = {}
        self._next = 0
        # request id -> the task holding that request at the pause gate
        self._held: dict[int, asyncio.Task[None]] = {}
        # consumer -> fair-share slots this worker holds; given back if the worker dies
        self.slots: dict[str, int] = {}

    def on_frame(self, kind: int, payload: bytes) -> None:
        routing = self.service.routing
        if kind == DISPATCH:
            rid, size, n_excl, n_key, n_hashes, flags = _DISPATCH.unpack_from(payload)
            pos = _DISPATCH.size
            excluded = []
            for _ in range(n_excl):
                (n,) = _U16.unpack_from(payload, pos)
                excluded.append(payload[pos + 2 : pos + 2 + n].decode())
                pos += 2 + n
            key = payload[pos : pos + n_key].decode() if n_key else None
            pos += n_key
            hashes = _unpack_hashes(payload, pos, n_hashes)
            pos += 8 * max(n_hashes, 0)
            header = self.service.session_header
            headers = {header: key} if key is not None and header is not None else {}
            request = RouteRequest("", b"", headers, hashes, size)
            exclude = frozenset(excluded)
            hold = bool(flags & HOLD)
            consumer = None
            if flags & CONSUMER:
                n_name = payload[pos]
                name = payload[pos + 1 : pos + 1 + n_name].decode()
                (weight,) = _F64.unpack_from(payload, pos + 1 + n_name)
                pos += 1 + n_name + 8
                if hold and routing.fair is not None:
                    consumer = Consumer(name, "", weight)
            want = None
            if flags & WANT:
                text = payload[pos:].decode("utf-8", "surrogateescape")
                want = VersionWant(text, bool(flags & AT_LEAST))
            if consumer is not None:
                try:
                    admitted = routing.enter_now(exclude, want, consumer)
                except (UnknownVersion, NoBackendAvailable) as exc:
                    self._refuse(rid, exc)
                    return
                if admitted is None:
                    self._hold_task(rid, self._enter(rid, request, exclude, want, consumer))
                    return
                self._decide(rid, request, admitted, consumer.name)
                return
            if flags & WANT or (hold and routing.gate.paused):  # the one check when neither
                try:
                    admitted = routing.admit_now(exclude, hold, want)
                except (UnknownVersion, NoBackendAvailable) as exc:
                    self._refuse(rid, exc)
                    return
                if admitted is None:
                    self._hold_task(rid, self._hold(rid, request, exclude, hold, want))
                    return
                exclude = admitted
            self._decide(rid, request, exclude)
        elif kind == CANCEL:
            (rid,) = _U32.unpack_from(payload)
            task = self._held.pop(rid, None)
            if task is not None:  # else answered already: the worker gives that answer back
                task.cancel()
                self.send(frame(CHOSEN, _CHOSEN.pack(rid, WITHDRAWN)))
        elif kind == RELEASE:
            size, n_url, n_version = _RELEASE.unpack_from(payload)
            pos = _RELEASE.size
            url = payload[pos : pos + n_url].decode()
            if n_version:
                pos += n_url
                version = payload[pos : pos + n_version].decode()
                request_id = payload[pos + n_version :].decode("utf-8", "surrogateescape")
                routing.release(url, size, version, request_id)
            else:
                routing.release(url, size)
            held = self.ledger.get(url)
            if held is not None:
                held[0] -= 1
                held[1] -= size
                if held[0] <= 0:
                    del self.ledger[url]
        elif kind == FINISH:
            tokens, counted = _FINISH.unpack_from(payload)
            name = payload[_FINISH.size :].decode()
            held_slots = self.slots.get(name, 0)
            if held_slots > 0:  # only a slot this worker holds (a stray frame frees nobody else's)
                if held_slots == 1:
                    del self.slots[name]
                else:
                    self.slots[name] = held_slots - 1
                routing.finish(name, tokens, bool(counted))
        elif kind == SUCCEEDED:
            routing.succeeded(payload.decode())
        elif kind == FAILED:
            n_url, n_kind, n_hashes = _FAILED.unpack_from(payload)
            pos = _FAILED.size
            url = payload[pos : pos + n_url].decode()
            failure = payload[pos + n_url : pos + n_url + n_kind].decode()
            hashes = _unpack_hashes(payload, pos + n_url + n_kind, n_hashes)
            request = RouteRequest("", b"", {}, hashes, 0)
            if failure:
                routing.failed(request, url, failure)
            else:
                routing.policy.retract(request, url)
        elif kind == STATS:
            (rid,) = _U32.unpack_from(payload)
            future = self._stats.pop(rid, None)
            if future is not None and not future.done():
                future.set_result(payload[4:])
        elif kind == HELLO:
            self.index, self.pid = _HELLO.unpack(payload)
        elif kind == READY:
            self.ready = True
            self.service.on_ready(self)
        else:
            log.error("router worker %d sent an unknown frame kind %d; closing its channel", self.index, kind)
            if self.transport is not None:
                self.transport.close()

    def _hold_task(self, rid: int, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._held[rid] = task
        task.add_done_callback(lambda _t, rid=rid: self._held.pop(rid, None))

    def _decide(
        self,
        rid: int,
        request: RouteRequest,
        exclude: frozenset[str],
        consumer: str | None = None,
        holds: dict[str, float] | None = None,
    ) -> None:
        """Choose and answer. ``consumer``: the request holds that consumer's fair-share slot, which
        becomes this worker's (given back by its FINISH), or is given back here with no backend.
        ``holds``: what held the request before this decision (answered ``OK_HELD``)."""
        routing = self.service.routing
        try:
            url = routing.dispatch_now(request, exclude)
        except NoBackendAvailable as exc:
            if consumer is not None:
                routing.finish(consumer, 0, counted=False)
            self.send(frame(CHOSEN, _CHOSEN.pack(rid, NO_BACKEND) + str(exc).encode()))
            return
        if consumer is not None:
            self.slots[consumer] = self.slots.get(consumer, 0) + 1
        held = self.ledger.get(url)
        if held is None:
            self.ledger[url] = [1, request.size]
        else:
            held[0] += 1
            held[1] += request.size
        u = url.encode()
        version = routing.versions.of.get(url)
        v = version.encode() if version is not None else b""
        if holds:
            held = _HELD.pack(holds.get(PAUSE, 0.0), holds.get(SHARE, 0.0))
            self.send(frame(CHOSEN, _CHOSEN.pack(rid, OK_HELD) + held + _U16.pack(len(u)) + u + v))
        else:
            self.send(frame(CHOSEN, _CHOSEN.pack(rid, OK) + _U16.pack(len(u)) + u + v))

    def _refuse(self, rid: int, exc: Exception) -> None:
        outcome = (
            PAUSE_REFUSED
            if isinstance(exc, PauseRefused)
            else UNKNOWN_VERSION
            if isinstance(exc, UnknownVersion)
            else VERSION_REFUSED
            if isinstance(exc, VersionRefused)
            else FAIR_SHARE_REFUSED
            if isinstance(exc, FairShareRefused)
            else NO_BACKEND
        )
        self.send(frame(CHOSEN, _CHOSEN.pack(rid, outcome) + str(exc).encode()))

    async def _hold(
        self, rid: int, request: RouteRequest, exclude: frozenset[str], hold: bool, want: VersionWant | None
    ) -> None:
        """Answer once the fleet resumes (in arrival order across all workers) and an engine has the
        wanted version, or refuse past the bounds; cancelled by the worker's CANCEL or when its channel
        closes."""
        holds = Holds()  # the seconds the gate held it, answered with the decision
        try:
            exclude = await self.service.routing.admit(exclude, hold, want, holds)
        except (PauseRefused, UnknownVersion, VersionRefused, NoBackendAvailable) as exc:
            self._refuse(rid, exc)
            return
        self._decide(rid, request, exclude, None, holds)

    async def _enter(
        self,
        rid: int,
        request: RouteRequest,
        exclude: frozenset[str],
        want: VersionWant | None,
        consumer: Consumer,
    ) -> None:
        """``_hold`` for a request of a consumer: the holds, then its fair-share slot (in the order the
        fair share grants slots across all workers), or a refusal past the bounds."""
        holds = Holds()  # the seconds the gate and the fair share held it, answered with the decision
        try:
            exclude = await self.service.routing.enter(exclude, want, consumer, holds)
        except (PauseRefused, UnknownVersion, VersionRefused, NoBackendAvailable, FairShareRefused) as exc:
            self._refuse(rid, exc)
            return
        self._decide(rid, request, exclude, consumer.name, holds)

    def cancel_held(self) -> None:
        """Stop holding this worker's requests (its channel closed, or the router stops)."""
        for task in list(self._held.values()):
            task.cancel()
        self._held.clear()

    async def ask_stats(self, timeout_s: float) -> bytes | None:
        """The worker's own metric samples (``router.state.metrics.per_request_snapshot``), or None."""
        self._next += 1
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._stats[self._next] = future
        self.send(frame(STATS_ASK, _U32.pack(self._next)))
        try:
            return await asyncio.wait_for(future, timeout_s)
        except (TimeoutError, ConnectionError):
            return None
        finally:
            self._stats.pop(self._next, None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_held()
        routing = self.service.routing
        for url, (count, size) in self.ledger.items():
            routing.release(url, size)
            for _ in range(count - 1):
                routing.release(url, 0)
        self.ledger.clear()
        for name, count in self.slots.items():
            for _ in range(count):
                routing.finish(name, 0, counted=False)
        self.slots.clear()
        for future in self._stats.values():
            if not future.done():
                future.set_exception(ConnectionError("worker channel closed"))
        self.service.on_lost(self)


class DecisionService:
    """The routing state served to worker processes over a Unix socket (on the parent's loop)."""

    def __init__(self, routing: LocalRouting) -> None:
        self.routing = routing
        self.session_header: str | None = getattr(routing.policy, "session_header", None)
        self.channels: set[WorkerChannel] = set()
        self._ready_waiters: list[Callable[[WorkerChannel], None]] = []

    def channel(self) -> WorkerChannel:
        ch = WorkerChannel(self)
        self.channels.add(ch)
        return ch

    def on_ready(self, channel: WorkerChannel) -> None:
        for waiter in list(self._ready_waiters):
            waiter(channel)

    def watch_ready(self, callback: Callable[[WorkerChannel], None]) -> None:
        self._ready_waiters.append(callback)

    def on_lost(self, channel: WorkerChannel) -> None:
        self.channels.discard(channel)

    def ready_channels(self) -> list[WorkerChannel]:
        return sorted((c for c in self.channels if c.ready), key=lambda c: c.index)

    def close(self) -> None:
        """Stop holding requests at the pause gate: the router is stopping."""
        for channel in list(self.channels):
            channel.cancel_held()


# -- the worker's side -------------------------------------------------------------------------------------
class RemoteRouting(_Framed):
    """``RoutingState`` answered by the parent: what a worker process's ``Forwarder`` routes with."""

    def __init__(self, policy: Policy, on_lost: Callable[[], None], stats: Callable[[], Any]) -> None:
        super().__init__()
        self._session_header: str | None = getattr(policy, "session_header", None)
        self._on_lost = on_lost
        self._stats = stats
        # request id -> (its answer, the request, the consumer whose fair-share slot an OK answer holds)
        self._pending: dict[int, tuple[asyncio.Future[Chosen], RouteRequest, str | None]] = {}
        self._next = 0
        self.closed = False

    def hello(self, index: int, pid: int) -> None:
        self.send(frame(HELLO, _HELLO.pack(index, pid)))

    def ready(self) -> None:
        self.send(frame(READY))

    async def dispatch(
        self,
        request: RouteRequest,
        exclude: frozenset[str],
        hold: bool = False,
        want: VersionWant | None = None,
        consumer: Consumer | None = None,
    ) -> Chosen:
        if self.closed:
            raise NoBackendAvailable("the router's routing state is gone (parent process stopped)")
        self._next = rid = (self._next + 1) & 0xFFFFFFFF
        excluded = b"".join(_U16.pack(len(b)) + b for b in (u.encode() for u in exclude))
        key = b""
        if self._session_header is not None:
            value = request.headers.get(self._session_header)
            key = value.encode() if value else b""
        n_hashes, hashes = _pack_hashes(request.features)
        flags = HOLD if hold else 0
        name: str | None = None
        if hold and consumer is not None:
            flags |= CONSUMER
            name = consumer.name
            n = name.encode()
            hashes += bytes((len(n),)) + n + _F64.pack(consumer.weight)
        if want is not None:
            flags |= (WANT | AT_LEAST) if want.at_least else WANT
            hashes += want.version.encode("utf-8", "surrogateescape")  # a header's text, as aiohttp read it
        head = _DISPATCH.pack(rid, request.size, len(exclude), len(key), n_hashes, flags)
        future: asyncio.Future[Chosen] = asyncio.get_running_loop().create_future()
        self._pending[rid] = (future, request, name)
        self.send(frame(DISPATCH, head + excluded + key + hashes))
        if not hold:
            return await future
            # A cancelled wait leaves the entry: its answer is then released at once (see on_frame).
        try:
            return await future
        except asyncio.CancelledError:
            # The client went away, perhaps while held at the pause gate: withdraw it there (the parent
            # answers WITHDRAWN, or has answered already and that answer is given back in on_frame).
            if rid in self._pending:
                self.send(frame(CANCEL, _U32.pack(rid)))
            raise

    def release(
        self, url: str, weight: int, dispatched_on: str | None = None, request_id: str | None = None
    ) -> None:
        # Written at once, not at the end of the loop turn: the forwarder releases before the client
        # gets the end of its answer, and this frame must be on its way before the client's next turn
        # can reach the routing state through another worker (see router.http.slots.Slot).
        u = url.encode()
        if dispatched_on and len(dispatched_on) < 0x4000:  # a u16 of UTF-8 (a longer one is not tracked)
            v = dispatched_on.encode()
            r = request_id.encode("utf-8", "surrogateescape") if request_id else b""
            self.send(frame(RELEASE, _RELEASE.pack(weight, len(u), len(v)) + u + v + r))
        else:
            self.send(frame(RELEASE, _RELEASE.pack(weight, len(u), 0) + u))
        self._flush()

    def succeeded(self, url: str) -> None:
        self.send(frame(SUCCEEDED, url.encode()))

    def finish(self, consumer: str, completion_tokens: int = 0, counted: bool = True) -> None:
        # Batched with the release that follows it on the success path (which flushes at once).
        tokens = min(max(completion_tokens, 0), 0xFFFFFFFF)
        self.send(frame(FINISH, _FINISH.pack(tokens, int(counted)) + consumer.encode()))

    def failed(self, request: RouteRequest, url: str, kind: str) -> None:
        # Written at once, like a release: a broken answer is cut right after this call, and the failure
        # must be on its way to the routing state (health counts, ejection, forgotten affinity) before the
        # client can see the cut and retry through another worker.
        self._send_failed(request, url, kind)
        self._flush()

    def _send_failed(self, request: RouteRequest, url: str, kind: str) -> None:
        u, k = url.encode(), kind.encode()
        n, hashes = _pack_hashes(request.features)
        self.send(frame(FAILED, _FAILED.pack(len(u), len(k), n) + u + k + hashes))

    def on_frame(self, kind: int, payload: bytes) -> None:
        if kind == CHOSEN:
            rid, ok = _CHOSEN.unpack_from(payload)
            entry = self._pending.pop(rid, None)
            if entry is None:
                return
            future, request, consumer = entry
            if ok == OK or ok == OK_HELD:
                pos = _CHOSEN.size
                held: Holds | None = None
                if ok == OK_HELD:
                    pause, share = _HELD.unpack_from(payload, pos)
                    pos += _HELD.size
                    held = Holds()
                    held.add(PAUSE, pause)
                    held.add(SHARE, share)
                (n,) = _U16.unpack_from(payload, pos)
                pos += 2
                url = payload[pos : pos + n].decode()
                version = payload[pos + n :].decode() or None
                if future.cancelled():
                    # The client went away while the parent decided: the slot it counted is given back
                    # and the affinity it recorded is forgotten (nothing was sent to that backend).
                    if consumer is not None:
                        self.finish(consumer, 0, counted=False)
                    self.release(url, request.size)
                    self._send_failed(request, url, "")
                else:
                    future.set_result(Chosen(url, version, held or NO_HOLDS))
                return
            if future.cancelled():
                return
            text = payload[_CHOSEN.size :].decode()
            future.set_exception(_REFUSALS.get(ok, NoBackendAvailable)(text))
        elif kind == STATS_ASK:
            (rid,) = _U32.unpack_from(payload)
            self.send(frame(STATS, _U32.pack(rid) + orjson.dumps(self._stats())))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        for future, _request, _consumer in self._pending.values():
            if not future.done():
                future.set_exception(NoBackendAvailable("the router's routing state is gone"))
        self._pending.clear()
        self._on_lost()
