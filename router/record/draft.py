"""A request record as the forwarder gathers it: raw facts on the request path, the record built elsewhere.

What a record costs is what decides whether it can be on for every request: the router's whole work per
request is a few hundred microseconds of Python, and a record built in the router's process (its JSON
object, the usage read out of the answer, the hashes in hex) measured about a fifth of that. So the work
is split in three, each where it costs least:

* On the request path, ``RecordDraft`` stores what the forwarder already holds: the clock at a few
  points, the engine and its status per attempt, references to the prompt's block hashes and to the
  answer's last bytes (no copy), the head and tail of the body (``BODY_SCAN_BYTES`` each). Attribute
  writes, no parsing, no serialization.
* The record writer's thread (``router.record.writer``) packs each draft (``pack``: one C call,
  ``operator.attrgetter``) and sends a batch of them, ``marshal``-ed, to the record's own process.
* That process (``router.record.sink``) builds each record (``record_json``: the session key's hash,
  the usage and finish reason read from the answer's tail, ``max_tokens`` and ``stream`` from the body's
  ends, the hashes in hex, the text when asked) and writes it; its CPU is not the router's.

The few body facts the record wants without a JSON parse (``stream``, ``max_tokens``) are looked for in
the first and last ``BODY_SCAN_BYTES`` of the body only (where clients put sampling options: before or
after the conversation), so a 60 MB prompt costs what a short one does; a key found in neither is unknown
(``max_tokens`` null; ``stream`` false, unless the answer was an event stream, which says it was asked).
"""

from __future__ import annotations

import array
import hashlib
import operator
import sys
import time
from typing import Any

import orjson

from router.record.format import MAX_PREFIX_BLOCKS, RECORD_VERSION, RequestRecord
from router.record.holds import held_breakdown

BODY_SCAN_BYTES = 2048
_BLANKS = b" \t\r\n"


def _value_at(data: bytes, i: int, key: bytes) -> int:
    """Offset of the value after the key found at ``i`` (after ``:`` and blanks), or -1 when what was
    found is not a key: its opening quote escaped (inside a JSON string), or no ``:`` after it."""
    if i and data[i - 1] == 0x5C:  # backslash: the quote is escaped
        return -1
    j = i + len(key)
    n = len(data)
    if j < n and data[j] == 0x3A:  # the compact form, ``"key":``: no blanks to skip
        j += 1
    else:
        while j < n and data[j] in _BLANKS:
            j += 1
        if j >= n or data[j] != 0x3A:  # ':'
            return -1
        j += 1
    while j < n and data[j] in _BLANKS:
        j += 1
    return j


def _int_at(data: bytes, j: int) -> int | None:
    k = j
    n = len(data)
    while k < n and 0x30 <= data[k] <= 0x39:
        k += 1
    return int(data[j:k]) if k > j else None


def json_int(data: bytes, key: bytes, start: int = 0, end: int | None = None) -> int | None:
    """The last ``key: N`` (``key`` quoted, e.g. ``b'"completion_tokens"'``) found in ``data[start:end]``,
    None when there is none. Generated text cannot pass for it: a match inside a JSON string has its
    quote escaped, and a string value is not followed by ``:``."""
    stop = len(data) if end is None else end
    while (i := data.rfind(key, start, stop)) >= 0:
        stop = i
        j = _value_at(data, i, key)
        if j >= 0 and (value := _int_at(data, j)) is not None:
            return value
    return None


def json_str(data: bytes, key: bytes, limit: int = 64) -> str | None:
    """The last ``key: "text"`` in ``data`` whose value is a short plain string (a ``finish_reason``;
    ``null`` values are passed over), None when there is none."""
    end = len(data)
    while (i := data.rfind(key, 0, end)) >= 0:
        end = i
        j = _value_at(data, i, key)
        if j < 0 or j >= len(data) or data[j] != 0x22:  # '"'
            continue
        k = data.find(b'"', j + 1, j + 2 + limit)
        if k > j and 0x5C not in data[j + 1 : k]:
            return data[j + 1 : k].decode("utf-8", "replace")
    return None


_USAGE = b'"usage"'
_USAGE_KEYS = (b'"prompt_tokens"', b'"cached_tokens"', b'"completion_tokens"')
_USAGE_SPAN = 512  # an engine's usage object is ~150 bytes
_FINISH = b'"finish_reason"'


def usage_of(tail: bytes) -> tuple[int | None, int | None, int | None]:
    """``(prompt_tokens, cached_tokens, completion_tokens)`` of an answer's usage, from its last bytes.
    Searched within ``_USAGE_SPAN`` bytes after the last ``"usage"`` key (short scans: the object is
    small), else, when there is no such key, in the whole tail."""
    u = tail.rfind(_USAGE)
    if u >= 0 and not (u and tail[u - 1] == 0x5C):
        end = min(len(tail), u + _USAGE_SPAN)
        out = [json_int(tail, key, u, end) for key in _USAGE_KEYS]
    else:
        out = [json_int(tail, key) for key in _USAGE_KEYS]
    return out[0], out[1], out[2]


def finish_reason_of(tail: bytes) -> str | None:
    """The last non-null ``finish_reason`` in an answer's last bytes (``"finish_reason":"stop"``, the
    compact form engines write, read at once; any other spelling by ``json_str``)."""
    i = tail.rfind(_FINISH)
    if i < 0:
        return None
    j = i + len(_FINISH)
    if tail[j : j + 2] == b':"' and (i == 0 or tail[i - 1] != 0x5C):
        k = tail.find(b'"', j + 2, j + 66)
        if k > 0 and 0x5C not in tail[j + 2 : k]:
            return tail[j + 2 : k].decode("utf-8", "replace")
    return json_str(tail, _FINISH)


def _body_value(body: bytes, key: bytes) -> int:
    """Offset of ``key``'s value in ``body``, -1 when not there."""
    hi = len(body)
    while (i := body.rfind(key, 0, hi)) >= 0:
        hi = i
        j = _value_at(body, i, key)
        if j >= 0:
            return j
    return -1


def body_int(parts: tuple[bytes, ...], *keys: bytes) -> int | None:
    """The first of ``keys`` with an integer value in one of ``parts`` (the body's ends)."""
    for key in keys:
        for part in parts:
            j = _body_value(part, key)
            if j >= 0:
                return _int_at(part, j)
    return None


def body_flag(parts: tuple[bytes, ...], key: bytes) -> bool:
    """Whether ``key: true`` is in one of ``parts`` (the body's ends)."""
    for part in parts:
        j = _body_value(part, key)
        if j >= 0:
            return part.startswith(b"true", j)
    return False


def session_hash(key: str) -> str:
    """What the record keeps of a session key: 16 hex digits of its sha256 (never the key itself)."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def answer_text(answer: bytes) -> str:
    """The first choice's text of a whole JSON answer (chat ``message.content`` or completion ``text``);
    empty when it is not one."""
    try:
        data = orjson.loads(answer)
        choice = data["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
    except (ValueError, KeyError, IndexError, TypeError):
        return ""
    return text if isinstance(text, str) else ""


def hex_hashes(hashes: list[int]) -> list[str]:
    """Block hashes as the record writes them: each the 16 hex digits of the hash as an unsigned 64-bit
    number. In C, not one format per block: a 40 KB prompt has ~40 blocks."""
    if not hashes:
        return []
    packed = array.array("q", hashes[:MAX_PREFIX_BLOCKS])
    if sys.byteorder == "little":
        packed.byteswap()
    return packed.tobytes().hex(" ", 8).split(" ")


class RecordDraft:
    """What one generation request's record is made of, gathered by the forwarder (module doc).

    Class attributes hold the defaults, so a request sets only what it has: most drafts never touch half
    of these (no session, no consumer, no hold, one attempt). ``holds``: also what the routing state's
    timed waits add their seconds to (``router.record.holds``, ``add``)."""

    session_key: str | None = None
    consumer: str | None = None
    sse = False  # the answer was an event stream
    engine: str | None = None
    version: str | None = None
    holds: dict[str, float] | None = None
    gated_s: float | None = None  # with a version wanted: the seconds around the first dispatch
    ttfb: float | None = None
    duration: float | None = None
    status = 0
    prompt_bytes = 0
    head: bytes | None = None  # the body's first BODY_SCAN_BYTES, when it is longer than two of them
    end_bytes: bytes | None = None  # its last BODY_SCAN_BYTES (or the whole body when short)
    hashes: list[int] | None = None
    tail: bytes | None = None  # the answer's last bytes, where its usage is
    prompt: bytes | None = None  # with record_text only
    answer: bytes | None = None  # with record_text only: a whole JSON answer
    id = ""
    attempts: list[tuple[str, str, int | None, float]] | None = None
    _a_engine: str | None = None  # the attempt in progress
    _a_t0 = 0.0
    _a_status: int | None = None
    _a_outcome: str | None = None

    def __init__(self, path: str, started: float) -> None:
        self.started = started  # perf_counter at arrival: every time is taken from it
        self.path = path

    # -- on the request path ----------------------------------------------------------------------------
    def read_body(self, body: bytes, hashes: list[int] | None) -> None:
        """Keep what the record takes from the request body: its size, its ends (references when it is
        short, two small copies when not) and the prompt's block hashes (at most ``MAX_PREFIX_BLOCKS``)."""
        n = self.prompt_bytes = len(body)
        if n <= 2 * BODY_SCAN_BYTES:
            self.end_bytes = body
        else:
            self.head = body[:BODY_SCAN_BYTES]
            self.end_bytes = body[-BODY_SCAN_BYTES:]
        if hashes is not None:
            self.hashes = hashes if len(hashes) <= MAX_PREFIX_BLOCKS else hashes[:MAX_PREFIX_BLOCKS]

    def add(self, kind: str, seconds: float) -> None:
        """A wait of the routing state held this request ``seconds`` (``router.record.holds``)."""
        holds = self.holds
        if holds is None:
            holds = self.holds = {}
        holds[kind] = holds.get(kind, 0.0) + seconds

    def begin(self, engine: str) -> None:
        """An attempt on ``engine`` starts."""
        self._a_engine = engine
        self._a_t0 = time.perf_counter()
        if self.attempts is not None:  # a retry: forget what the failed attempt saw
            self._a_status = None
            self._a_outcome = None

    def answered(self, status: int) -> None:
        """The engine of the current attempt answered with ``status`` (its head arrived)."""
        self._a_status = status

    def outcome(self, kind: str) -> None:
        """The current attempt, though answered, ended otherwise than ``ok`` (a broken stream, a client
        that went away)."""
        self._a_outcome = kind

    def end(self, outcome: str, version: str | None = None) -> None:
        """The current attempt is over with ``outcome`` (``ok`` or a failure kind; one given to
        ``outcome`` wins); the engine that answered it is the record's engine so far."""
        engine = self._a_engine
        if engine is None:
            return
        self._a_engine = None
        status = self._a_status
        attempt = (engine, self._a_outcome or outcome, status, time.perf_counter() - self._a_t0)
        if self.attempts is None:
            self.attempts = [attempt]
        else:
            self.attempts.append(attempt)
        if status is not None:
            self.engine = engine
            self.version = version

    def sent_head(self) -> None:
        if self.ttfb is None:
            self.ttfb = time.perf_counter() - self.started

    def finish(self, status: int) -> None:
        """The request is over, answered ``status``; an attempt still open was cut by the client."""
        if self._a_engine is not None:
            self.end("cancelled")
        self.status = status
        self.duration = time.perf_counter() - self.started

    def text_bytes(self) -> int:
        """Bytes of text this draft holds until it is written (bounded by the writer)."""
        if self.prompt is None:
            return 0
        return len(self.prompt) + (len(self.answer) if self.answer else 0)

    def line(self) -> bytes:
        """The record's line, built here (tests; the router's process hands drafts to the sink)."""
        return record_line(pack(self), time.time() - time.perf_counter())

    def build(self) -> RequestRecord:
        return RequestRecord.from_json(record_json(pack(self), time.time() - time.perf_counter()))


PACKED = (
    "id",
    "started",
    "path",
    "status",
    "session_key",
    "consumer",
    "sse",
    "engine",
    "attempts",
    "holds",
    "gated_s",
    "ttfb",
    "duration",
    "version",
    "prompt_bytes",
    "head",
    "end_bytes",
    "hashes",
    "tail",
    "prompt",
    "answer",
)
"""A draft's fields as the writer's thread sends them to the sink, in this order (``pack``)."""
pack = operator.attrgetter(*PACKED)
"""``pack(draft)``: its ``PACKED`` fields as one tuple, in C (plain data: ``marshal`` can send it)."""


def record_json(packed: tuple[Any, ...], clock_offset: float) -> dict[str, Any]:
    """A packed draft's record: the JSON object ``RequestRecord.to_json`` writes (same keys, same order;
    tests/test_router_record.py holds the two together). ``clock_offset``: wall-clock time minus
    ``time.perf_counter()`` in the process that made the draft (its arrival is a perf_counter reading)."""
    (
        request_id,
        started,
        path,
        status,
        session_key,
        consumer,
        sse,
        engine,
        attempts,
        holds,
        gated_s,
        ttfb,
        duration,
        version,
        prompt_bytes,
        head,
        end_bytes,
        hashes,
        tail,
        prompt,
        answer,
    ) = packed
    prompt_tokens = cached = completion = None
    finish_reason = None
    if tail:
        prompt_tokens, cached, completion = usage_of(tail)
        finish_reason = finish_reason_of(tail)
    parts = (end_bytes, head) if head is not None else (end_bytes,) if end_bytes else ()
    out: dict[str, Any] = {
        "v": RECORD_VERSION,
        "id": request_id,
        "t": round(started + clock_offset, 6),
        "path": path,
        "status": status,
        "session": session_hash(session_key) if session_key else None,
        "consumer": consumer,
        "stream": bool(sse) or body_flag(parts, b'"stream"'),
        "engine": engine,
        "attempts": [
            {
                "engine": e,
                "outcome": f"status_{st // 100}xx" if o == "status" and st is not None else o,
                "status": st,
                "s": round(s, 6),
            }
            for e, o, st, s in attempts or ()
        ],
        "held_s": _held(holds, gated_s),
        "ttfb_s": round(ttfb if ttfb is not None else duration, 6) if duration is not None else None,
        "duration_s": round(duration, 6) if duration is not None else None,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "finish_reason": finish_reason,
        "version": version,
        "prompt_bytes": prompt_bytes,
        "max_tokens": body_int(parts, b'"max_tokens"', b'"max_completion_tokens"'),
        "prefix": hex_hashes(hashes) if hashes else [],
    }
    if prompt is not None:
        out["text"] = {
            "prompt": prompt.decode("utf-8", "replace"),
            "completion": answer_text(answer) if answer else "",
        }
    return out


def _held(holds: dict[str, float] | None, gated_s: float | None) -> dict[str, float]:
    if not holds and gated_s is None:
        return {}
    return held_breakdown(holds or {}, gated_s or 0.0, gated_s is not None)


def record_line(packed: tuple[Any, ...], clock_offset: float) -> bytes:
    """``record_json`` as a JSONL line (orjson: a third of ``json.dumps``'s cost)."""
    return orjson.dumps(record_json(packed, clock_offset), option=orjson.OPT_APPEND_NEWLINE)
