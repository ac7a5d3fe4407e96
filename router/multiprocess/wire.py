"""The decision channel's wire format: every frame the parent and its workers exchange, in one module.

The frame: ``<u32 payload length><u8 kind><payload>``. Each payload is written by one ``*_frame``
function here and read by its ``read_*`` counterpart here, and nowhere else: the parent's side
(``router.multiprocess.decisions``) and the worker's side (``router.multiprocess.remote``) only call them,
so the two processes cannot disagree on a layout (one module owns the shape of what two processes
exchange). What each frame is for is told in ``router.multiprocess.decisions``.

Layouts (little-endian):

* ``HELLO``: worker index, pid (u32, u32). ``READY``: empty.
* ``DISPATCH``: id, body size, n excluded, key bytes, n hashes (-1: none), flags (``<IqHHiB``); then the
  excluded URLs (each u16 length + bytes), the session key, the hashes (i64 each), with ``CONSUMER`` the
  consumer (u8 name length, the name, f64 weight), and with ``WANT`` the wanted version (the rest).
* ``CHOSEN``: request id, outcome (``<IB``); ``OK``: u16 URL length, the URL, then the engine's version
  (the rest, empty for none); ``OK_HELD``: the seconds held at the pause gate and for a fair-share slot
  (two f32), then as ``OK``; ``NO_BACKEND`` and the refusals: the reason (the rest); ``WITHDRAWN``: empty.
* ``CANCEL``, ``STATS_ASK``: the request id (u32). ``STATS``: the id, then the worker's samples (JSON).
* ``RELEASE``: body size, URL bytes, version bytes (0: none) (``<qHH``); the URL, the version, then the
  request id (the rest, only with a version: without one the release cannot straddle).
* ``FAILED``: URL bytes, kind bytes (empty: only forget the affinity), n hashes (``<HHi``); the URL, the
  kind, the hashes.
* ``FINISH``: completion tokens, counted (0: the request never reached an engine) (``<IB``); the
  consumer's name (the rest).
* ``MOVE_OFF``: u16 URL length, the URL, the reason (the rest). ``VERSION``: u16 URL length, the URL, the
  engine's new weight version (the rest).

``Framed`` splits the byte stream into frames and sends frames in batches, for both sides.
"""

from __future__ import annotations

import array
import asyncio
import struct
from typing import NamedTuple

from router.policies.base import NoBackendAvailable
from router.state.fair_share import FairShareRefused
from router.state.holds import NO_HOLDS, PAUSE, SHARE, Holds
from router.state.pause_gate import PauseRefused
from router.state.routing import Chosen
from router.state.versions import UnknownVersion, VersionRefused, VersionWant

HEADER = struct.Struct("<IB")
# kinds: worker -> parent
HELLO, READY, DISPATCH, RELEASE, FAILED, SUCCEEDED, STATS, CANCEL, FINISH = 1, 2, 3, 4, 5, 6, 7, 10, 11
# kinds: parent -> worker
CHOSEN, STATS_ASK = 8, 9
MOVE_OFF, VERSION = 12, 13  # the fleet asks the requests on an engine to move; an engine's version changed
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

_HELLO = struct.Struct("<II")
_DISPATCH = struct.Struct("<IqHHiB")
_CHOSEN = struct.Struct("<IB")
_HELD = struct.Struct("<ff")
_RELEASE = struct.Struct("<qHH")
_FAILED = struct.Struct("<HHi")
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


# -- HELLO, READY, CANCEL, STATS ------------------------------------------------------------------------
def hello_frame(index: int, pid: int) -> bytes:
    return frame(HELLO, _HELLO.pack(index, pid))


def read_hello(payload: bytes) -> tuple[int, int]:
    """``(worker index, pid)``."""
    return _HELLO.unpack(payload)  # type: ignore[return-value]


def ready_frame() -> bytes:
    return frame(READY)


def cancel_frame(rid: int) -> bytes:
    return frame(CANCEL, _U32.pack(rid))


def stats_ask_frame(rid: int) -> bytes:
    return frame(STATS_ASK, _U32.pack(rid))


def stats_frame(rid: int, samples: bytes) -> bytes:
    return frame(STATS, _U32.pack(rid) + samples)


def read_id(payload: bytes) -> int:
    """The request id that opens ``CANCEL``, ``STATS_ASK`` and ``STATS``."""
    (rid,) = _U32.unpack_from(payload)
    return rid  # type: ignore[no-any-return]


def read_stats(payload: bytes) -> tuple[int, bytes]:
    """``(request id, the worker's samples)``."""
    return read_id(payload), payload[4:]


def _url_and_text(kind: int, url: str, text: str) -> bytes:
    u = url.encode()
    return frame(kind, _U16.pack(len(u)) + u + text.encode())


def _read_url_and_text(payload: bytes) -> tuple[str, str]:
    (n,) = _U16.unpack_from(payload)
    return payload[2 : 2 + n].decode(), payload[2 + n :].decode()


def move_off_frame(url: str, reason: str) -> bytes:
    return _url_and_text(MOVE_OFF, url, reason)


def read_move_off(payload: bytes) -> tuple[str, str]:
    """``(engine url, reason)``."""
    return _read_url_and_text(payload)


def version_frame(url: str, version: str) -> bytes:
    return _url_and_text(VERSION, url, version)


def read_version(payload: bytes) -> tuple[str, str]:
    """``(engine url, its new weight version)``."""
    return _read_url_and_text(payload)


# -- DISPATCH ---------------------------------------------------------------------------------------------
class Dispatch(NamedTuple):
    """A DISPATCH as the parent reads it. ``consumer``: ``(name, weight)`` when the worker sent one."""

    rid: int
    size: int
    excluded: frozenset[str]
    key: str | None
    hashes: list[int] | None
    hold: bool
    consumer: tuple[str, float] | None
    want: VersionWant | None


def dispatch_frame(
    rid: int,
    size: int,
    exclude: frozenset[str],
    key: bytes,
    features: object,
    hold: bool,
    consumer: tuple[str, float] | None,
    want: VersionWant | None,
) -> bytes:
    """``key``: the session header's value (empty: none); ``consumer`` is sent only with ``hold``."""
    excluded = b"".join(_U16.pack(len(b)) + b for b in (u.encode() for u in exclude))
    n_hashes, rest = _pack_hashes(features)
    flags = HOLD if hold else 0
    if hold and consumer is not None:
        flags |= CONSUMER
        n = consumer[0].encode()
        rest += bytes((len(n),)) + n + _F64.pack(consumer[1])
    if want is not None:
        flags |= (WANT | AT_LEAST) if want.at_least else WANT
        rest += want.version.encode("utf-8", "surrogateescape")  # a header's text, as aiohttp read it
    head = _DISPATCH.pack(rid, size, len(exclude), len(key), n_hashes, flags)
    return frame(DISPATCH, head + excluded + key + rest)


def read_dispatch(payload: bytes) -> Dispatch:
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
    consumer = None
    if flags & CONSUMER:
        n_name = payload[pos]
        name = payload[pos + 1 : pos + 1 + n_name].decode()
        (weight,) = _F64.unpack_from(payload, pos + 1 + n_name)
        pos += 1 + n_name + 8
        consumer = (name, weight)
    want = None
    if flags & WANT:
        text = payload[pos:].decode("utf-8", "surrogateescape")
        want = VersionWant(text, bool(flags & AT_LEAST))
    return Dispatch(rid, size, frozenset(excluded), key, hashes, bool(flags & HOLD), consumer, want)


# -- CHOSEN -----------------------------------------------------------------------------------------------
def chosen_frame(rid: int, url: str, version: str | None, holds: dict[str, float] | None = None) -> bytes:
    """``OK`` (or ``OK_HELD`` with what held the request: ``router.state.holds``)."""
    u = url.encode()
    v = version.encode() if version is not None else b""
    if holds:
        held = _HELD.pack(holds.get(PAUSE, 0.0), holds.get(SHARE, 0.0))
        return frame(CHOSEN, _CHOSEN.pack(rid, OK_HELD) + held + _U16.pack(len(u)) + u + v)
    return frame(CHOSEN, _CHOSEN.pack(rid, OK) + _U16.pack(len(u)) + u + v)


def withdrawn_frame(rid: int) -> bytes:
    return frame(CHOSEN, _CHOSEN.pack(rid, WITHDRAWN))


def refusal_frame(rid: int, exc: Exception) -> bytes:
    """The refusal ``exc`` (a ``NoBackendAvailable`` or one of the holds' refusals) with its message."""
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
    return frame(CHOSEN, _CHOSEN.pack(rid, outcome) + str(exc).encode())


def read_chosen(payload: bytes) -> tuple[int, int]:
    """``(request id, outcome)``; then ``read_choice`` for ``OK``/``OK_HELD``, else ``read_refusal``."""
    return _CHOSEN.unpack_from(payload)  # type: ignore[return-value]


def chose(outcome: int) -> bool:
    """Whether a CHOSEN's outcome names an engine (``OK``, ``OK_HELD``)."""
    return outcome == OK or outcome == OK_HELD


def read_choice(payload: bytes, outcome: int) -> Chosen:
    """The engine, its version and what held the request, of an ``OK`` or ``OK_HELD``."""
    pos = _CHOSEN.size
    held: Holds | None = None
    if outcome == OK_HELD:
        pause, share = _HELD.unpack_from(payload, pos)
        pos += _HELD.size
        held = Holds()
        held.add(PAUSE, pause)
        held.add(SHARE, share)
    (n,) = _U16.unpack_from(payload, pos)
    pos += 2
    url = payload[pos : pos + n].decode()
    version = payload[pos + n :].decode() or None
    return Chosen(url, version, held or NO_HOLDS)


def read_refusal(payload: bytes, outcome: int) -> Exception:
    """The exception a one-process router would have raised, with the parent's message."""
    text = payload[_CHOSEN.size :].decode()
    return _REFUSALS.get(outcome, NoBackendAvailable)(text)


# -- RELEASE, SUCCEEDED, FAILED, FINISH -------------------------------------------------------------------
def release_frame(weight: int, url: str, dispatched_on: str | None, request_id: str | None) -> bytes:
    u = url.encode()
    if dispatched_on and len(dispatched_on) < 0x4000:  # a u16 of UTF-8 (a longer one is not tracked)
        v = dispatched_on.encode()
        r = request_id.encode("utf-8", "surrogateescape") if request_id else b""
        return frame(RELEASE, _RELEASE.pack(weight, len(u), len(v)) + u + v + r)
    return frame(RELEASE, _RELEASE.pack(weight, len(u), 0) + u)


def read_release(payload: bytes) -> tuple[int, str, str | None, str | None]:
    """``(body size, url, version dispatched on, request id)``; no version: no id either."""
    size, n_url, n_version = _RELEASE.unpack_from(payload)
    pos = _RELEASE.size
    url = payload[pos : pos + n_url].decode()
    if not n_version:
        return size, url, None, None
    pos += n_url
    version = payload[pos : pos + n_version].decode()
    request_id = payload[pos + n_version :].decode("utf-8", "surrogateescape")
    return size, url, version, request_id


def succeeded_frame(url: str) -> bytes:
    return frame(SUCCEEDED, url.encode())


def read_succeeded(payload: bytes) -> str:
    return payload.decode()


def failed_frame(url: str, kind: str, features: object) -> bytes:
    u, k = url.encode(), kind.encode()
    n, hashes = _pack_hashes(features)
    return frame(FAILED, _FAILED.pack(len(u), len(k), n) + u + k + hashes)


def read_failed(payload: bytes) -> tuple[str, str, list[int] | None]:
    """``(url, failure kind, the request's hashes)``; an empty kind: only forget the affinity."""
    n_url, n_kind, n_hashes = _FAILED.unpack_from(payload)
    pos = _FAILED.size
    url = payload[pos : pos + n_url].decode()
    failure = payload[pos + n_url : pos + n_url + n_kind].decode()
    return url, failure, _unpack_hashes(payload, pos + n_url + n_kind, n_hashes)


def finish_frame(consumer: str, completion_tokens: int, counted: bool) -> bytes:
    tokens = min(max(completion_tokens, 0), 0xFFFFFFFF)
    return frame(FINISH, _FINISH.pack(tokens, int(counted)) + consumer.encode())


def read_finish(payload: bytes) -> tuple[int, bool, str]:
    """``(completion tokens, counted, consumer)``."""
    tokens, counted = _FINISH.unpack_from(payload)
    return tokens, bool(counted), payload[_FINISH.size :].decode()


# -- the stream -------------------------------------------------------------------------------------------
class Framed(asyncio.Protocol):
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

    def send_now(self, data: bytes) -> None:
        """Send ``data`` with whatever this turn batched, without waiting for the end of the turn."""
        self.send(data)
        self._flush()

    def _flush(self) -> None:
        out = self._out
        if not out:
            return
        self._out = []
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(b"".join(out) if len(out) > 1 else out[0])
