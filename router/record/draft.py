"""A request record as the forwarder gathers it: raw facts on the request path, the record built elsewhere.

What a record costs is what decides whether it can be on for every request: the router's whole work per
request is a few hundred microseconds of Python, and a record built in the router's process (its JSON
object, the usage read out of the answer, the hashes in hex) measured about a fifth of that. So the work
is split in three, each where it costs least:

* On the request path, ``RecordDraft`` stores what the forwarder already holds: the clock at a few
  points, the engine and its status per attempt, a reference to the answer's last bytes, the head and
  tail of the body (``BODY_SCAN_BYTES`` each; the body itself when short), the prompt's block hashes
  packed in one C call. Attribute writes, no parsing, no serialization.
* The record writer's thread (``router.record.writer``) sends a batch of drafts (each its ``__dict__``:
  only what the request set), ``marshal``-ed, to the record's own process.
* That process (``router.record.sink``) builds each record (``record_json``: the session key's hash,
  the usage and finish reason read from the answer's tail, ``max_tokens`` and ``stream`` from the body's
  ends, the hashes in hex, the text when asked) and writes it; its CPU is not the router's.

The few body facts the record wants without a JSON parse (``stream``, ``max_tokens``) are looked for in the
first and last ``BODY_SCAN_BYTES`` of the body only (where clients put sampling options), so a 60 MB prompt
costs what a short one does; a key found in neither is unknown (``max_tokens`` null; ``stream`` false,
unless the answer was an event stream, which says it was asked).

What else the record says, and how far to trust it:

* ``prefix``: the policy's own block hashes when it computed them (cache_aware), else
  ``prefix_index.block_hashes`` of the body; CPython ``hash`` values, seeded per router (its worker
  processes share one ``PYTHONHASHSEED``), so they compare within one router's record, not across runs.
* ``finish_reason``: the last non-null one in the answer's tail (``n>1``: whichever finished last).
* ``text`` (``record_text``): the prompt is the request body as sent; the completion is the first choice's
  text when the answer was one JSON body read whole (a small answer), empty for a stream (its text is spread
  over events that pass through unbuffered). Both cut to ``format.TEXT_SHARE``, then marked ``truncated``.

What a client sends never keeps its request out of the record (``record_line``): ``max_tokens`` past 64 bits
is ``null``, a line orjson refuses (lone surrogates: an id or header not UTF-8; an integer past 64 bits) is
written again with those values replaced, and a record that still cannot be built gets ``minimal_line``.
"""

from __future__ import annotations

import array
import hashlib
import re
import sys
import time
from collections.abc import Mapping
from typing import Any

import orjson

from router.record.format import MAX_PREFIX_BLOCKS, RECORD_VERSION, RequestRecord
from router.record.holds import held_breakdown

BODY_SCAN_BYTES = 2048
_BLANKS = b" \t\r\n"
_INT64_MAX = (1 << 63) - 1
_INT64_MIN = -(1 << 63)


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
_FINISH = b'"finish_reason"'


def usage_of(tail: bytes) -> tuple[int | None, int | None, int | None]:
    """``(prompt_tokens, cached_tokens, completion_tokens)`` of an answer's usage, from its last bytes:
    the last ``"usage"`` object, found by its braces and parsed by orjson (a few C calls); the keys
    looked for one by one when that fails (an object cut by the tail's start, another spelling)."""
    u = tail.rfind(_USAGE)
    if u >= 0 and (u == 0 or tail[u - 1] != 0x5C):
        j = tail.find(b"{", u + 7, u + 16)
        k = j
        while j >= 0:
            k = tail.find(b"}", k + 1)
            if k < 0:
                break
            if tail.count(b"{", j, k) == tail.count(b"}", j, k) + 1:  # its own closing brace
                try:
                    usage = orjson.loads(tail[j : k + 1])
                except orjson.JSONDecodeError:
                    break
                details = usage.get("prompt_tokens_details")
                cached = details.get("cached_tokens") if type(details) is dict else None
                prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
                return (
                    prompt if type(prompt) is int else None,
                    cached if type(cached) is int else None,
                    completion if type(completion) is int else None,
                )
    return (
        json_int(tail, b'"prompt_tokens"'),
        json_int(tail, b'"cached_tokens"'),
        json_int(tail, b'"completion_tokens"'),
    )


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


_INT_VALUE = re.compile(rb"[ \t\r\n]*:[ \t\r\n]*(\d+)")


def body_int(parts: tuple[bytes, ...], *keys: bytes) -> int | None:
    """The first of ``keys`` with an integer value in one of ``parts`` (the body's ends): the key's last
    occurrence not inside a string (its quote not escaped) followed by ``: digits``."""
    for key in keys:
        for part in parts:
            hi = len(part)
            while (i := part.rfind(key, 0, hi)) >= 0:
                hi = i
                if i and part[i - 1] == 0x5C:  # backslash: inside a string
                    continue
                m = _INT_VALUE.match(part, i + len(key))
                if m is not None:
                    return int(m[1])
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


def hex_hashes(hashes: list[int] | bytes) -> list[str]:
    """Block hashes as the record writes them: each the 16 hex digits of the hash as an unsigned 64-bit
    number. In C, not one format per block: a 40 KB prompt has ~40 blocks. ``hashes``: ints, or packed
    as native 64-bit integers (what the writer sends for a long list)."""
    if not hashes:
        return []
    if isinstance(hashes, bytes):
        packed = array.array("q")
        packed.frombytes(hashes[: 8 * MAX_PREFIX_BLOCKS])
    else:
        packed = array.array("q", hashes[:MAX_PREFIX_BLOCKS])
    if sys.byteorder == "little":
        packed.byteswap()
    return packed.tobytes().hex(" ", 8).split(" ")


class RecordDraft:
    """What one generation request's record is made of, gathered by the forwarder (module doc).

    Class attributes hold the defaults, so a request sets only what it has (most never touch half of
    these: no session, no consumer, no hold, one attempt), and what it set is its ``__dict__``: what the
    writer sends to the sink as it is (``marshal`` takes a dict of plain data). Times are raw
    ``time.perf_counter()`` readings; the sink subtracts. ``add_holds``: what the routing state reported
    held the request (``router.state.holds``), added by the forwarder (``router.record.holds``)."""

    id = ""
    status = 0
    session_key: str | None = None
    consumer: str | None = None
    sse = False  # the answer was an event stream
    # Attempts before the current one: (engine, outcome, status, t0, t1, version); the current (last)
    # one in the a_* fields. The record's engine is the last that answered (status not None).
    attempts: list[tuple[str, str, int | None, float, float, str | None]] | None = None
    a_engine: str | None = None
    a_outcome: str | None = None
    a_status: int | None = None
    a_version: str | None = None
    a_t0 = 0.0
    a_t1: float | None = None
    holds: dict[str, float] | None = None
    gated_s: float | None = None  # with a version wanted: the seconds around the first dispatch
    head_at: float | None = None  # when the answer's head left
    end_at: float | None = None
    prompt_bytes = 0
    head: bytes | None = None  # the body's first BODY_SCAN_BYTES, when it is longer than two of them
    end_bytes: bytes | None = None  # its last BODY_SCAN_BYTES (or the whole body when short)
    hashes: bytes | None = None  # the prompt's block hashes, packed (native 64-bit integers)
    tail: bytes | None = None  # the answer's last bytes, where its usage is
    prompt: bytes | None = None  # with record_text only
    answer: bytes | None = None  # with record_text only: a whole JSON answer
    moves: list[dict[str, Any]] | None = None  # a continued request's moves (router.continuation)
    weight_versions: list[list[Any]] | None = None  # and its [version, first, last] token spans

    def __init__(self, path: str, started: float) -> None:
        self.started = started  # perf_counter at arrival
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
        if hashes:
            # Packed now, one C call: marshal would write (and look up, they are the prefix index's too)
            # integer by integer.
            self.hashes = array.array("q", hashes[:MAX_PREFIX_BLOCKS]).tobytes()

    def add(self, kind: str, seconds: float) -> None:
        """A wait of the routing state held this request ``seconds`` (``router.record.holds``)."""
        holds = self.holds
        if holds is None:
            holds = self.holds = {}
        holds[kind] = holds.get(kind, 0.0) + seconds

    def add_holds(self, held: Mapping[str, float]) -> None:
        """What held this request, as its ``dispatch`` reported it (``Chosen.held``, or a refusal's)."""
        for kind, seconds in held.items():
            self.add(kind, seconds)

    def begin(self, engine: str) -> None:
        """An attempt on ``engine`` starts (the engine's answer status goes to ``a_status``)."""
        if self.a_engine is not None:  # a retry: the failed attempt joins the earlier ones
            t0 = self.a_t0
            outcome = self.a_outcome or "cancelled"
            earlier = (self.a_engine, outcome, self.a_status, t0, self.a_t1 or t0, self.a_version)
            self.attempts = [*self.attempts, earlier] if self.attempts else [earlier]
            self.a_outcome = self.a_status = self.a_t1 = self.a_version = None
        self.a_engine = engine
        self.a_t0 = time.perf_counter()

    def outcome(self, kind: str) -> None:
        """The current attempt, though answered, ended otherwise than ``ok`` (a broken stream, a client
        that went away)."""
        self.a_outcome = kind

    def end(self, outcome: str, version: str | None = None) -> None:
        """The current attempt is over with ``outcome`` (``ok`` or a failure kind; one given to
        ``outcome`` wins); ``version``: its engine's weight version, as the router stamped the answer."""
        self.a_t1 = time.perf_counter()
        if self.a_outcome is None:
            self.a_outcome = outcome
        if version is not None:
            self.a_version = version

    def finish(self, status: int) -> None:
        """The request is over, answered ``status``; an attempt still open was cut by the client."""
        self.status = status
        self.end_at = time.perf_counter()
        if self.a_t1 is None and self.a_engine is not None:
            self.end("cancelled")

    def text_bytes(self) -> int:
        """Bytes of text this draft holds until it is written (bounded by the writer)."""
        if self.prompt is None:
            return 0
        return len(self.prompt) + (len(self.answer) if self.answer else 0)

    def line(self) -> bytes:
        """The record's line, built here (tests; the router's process hands drafts to the sink)."""
        return record_line(self.__dict__, time.time() - time.perf_counter())

    def build(self) -> RequestRecord:
        return RequestRecord.from_json(record_json(self.__dict__, time.time() - time.perf_counter()))


_DEFAULTS = {k: v for k, v in vars(RecordDraft).items() if not k.startswith("__") and not callable(v)}
"""A draft's fields and their defaults: what the sink reads a sent draft (its ``__dict__``) against."""


def _held(holds: dict[str, float] | None, gated_s: float | None) -> dict[str, float]:
    if not holds and gated_s is None:
        return {}
    return held_breakdown(holds or {}, gated_s or 0.0, gated_s is not None)


def int64(value: int | None) -> int | None:
    """``value`` when it is a 64-bit integer (what JSON readers and orjson take), else None."""
    return value if value is None or _INT64_MIN <= value <= _INT64_MAX else None


def clean(value: Any) -> Any:
    """``value`` with every string valid UTF-8 (what is not, replaced) and every integer a 64-bit one (else
    None), in nested dicts and lists too: what orjson can write."""
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode()
    if isinstance(value, bool) or not isinstance(value, int | dict | list | tuple):
        return value
    if isinstance(value, int):
        return int64(value)
    if isinstance(value, dict):
        return {clean(k): clean(v) for k, v in value.items()}
    return [clean(v) for v in value]


def _cut(data: bytes, limit: int) -> tuple[str, bool]:
    """At most ``limit`` bytes of ``data`` as text (a character cut in two is replaced), and whether it
    was cut."""
    if len(data) <= limit:
        return data.decode("utf-8", "replace"), False
    return data[:limit].decode("utf-8", "replace"), True


def record_text(prompt: bytes, answer: bytes | None, limit: int | None) -> dict[str, Any]:
    """The record's ``text``: the prompt, then the completion, together at most ``limit`` bytes (None: no
    limit), with ``truncated`` when either was cut."""
    completion = answer_text(answer) if answer else ""
    if limit is None:
        return {"prompt": prompt.decode("utf-8", "replace"), "completion": completion}
    text, cut = _cut(prompt, limit)
    rest = max(0, limit - min(len(prompt), limit))
    said, cut_too = _cut(completion.encode("utf-8", "replace"), rest)
    out: dict[str, Any] = {"prompt": text, "completion": said}
    if cut or cut_too:
        out["truncated"] = True
    return out


def record_json(sent: dict[str, Any], clock_offset: float, text_limit: int | None = None) -> dict[str, Any]:
    """A draft's record (``sent``: its ``__dict__``): the JSON object ``RequestRecord.to_json`` writes
    (same keys, same order; tests/component/test_router_record.py holds the two together). ``clock_offset``:
    wall-clock time minus ``time.perf_counter()`` in the process that made the draft. ``text_limit``: the
    bytes of text a line may hold (``record_text``)."""
    d = {**_DEFAULTS, **sent}
    started = d["started"]
    tail = d["tail"]
    prompt_tokens = cached = completion = None
    finish_reason = None
    if tail:
        prompt_tokens, cached, completion = usage_of(tail)
        finish_reason = finish_reason_of(tail)
    head, end_bytes = d["head"], d["end_bytes"]
    parts = (end_bytes, head) if head is not None else (end_bytes,) if end_bytes else ()
    attempts = list(d["attempts"] or ())
    if d["a_engine"] is not None:
        t0 = d["a_t0"]
        outcome = d["a_outcome"] or "cancelled"
        attempts.append((d["a_engine"], outcome, d["a_status"], t0, d["a_t1"] or t0, d["a_version"]))
    engine = version = None
    for e, _o, st, _t0, _t1, v in reversed(attempts):
        if st is not None:  # the engine that answered last
            engine, version = e, v
            break
    end_at = d["end_at"]
    duration = end_at - started if end_at is not None else None
    head_at = d["head_at"]
    ttfb = head_at - started if head_at is not None else duration  # the router's own answer: at its end
    hashes = d["hashes"]
    out: dict[str, Any] = {
        "v": RECORD_VERSION,
        "id": d["id"],
        "t": started + clock_offset,
        "path": d["path"],
        "status": d["status"],
        "session": session_hash(d["session_key"]) if d["session_key"] else None,
        "consumer": d["consumer"],
        # An engine streams when asked: the body is read only for an answer that says nothing (an error).
        "stream": True if d["sse"] else d["status"] != 200 and body_flag(parts, b'"stream"'),
        "engine": engine,
        "attempts": [
            {
                "engine": e,
                "outcome": f"status_{st // 100}xx" if o == "status" and st is not None else o,
                "status": st,
                "s": t1 - t0,
            }
            for e, o, st, t0, t1, _v in attempts
        ],
        "held_s": _held(d["holds"], d["gated_s"]),
        "ttfb_s": ttfb,
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "finish_reason": finish_reason,
        "version": version,
        "prompt_bytes": d["prompt_bytes"],
        "max_tokens": int64(body_int(parts, b'"max_tokens"', b'"max_completion_tokens"')),
        "prefix": hex_hashes(hashes) if hashes else [],
    }
    prompt = d["prompt"]
    if prompt is not None:
        out["text"] = record_text(prompt, d["answer"], text_limit)
    out.update((k, d[k]) for k in ("moves", "weight_versions") if d[k] is not None)  # RequestRecord's
    return out


def record_line(sent: dict[str, Any], clock_offset: float, text_limit: int | None = None) -> bytes:
    """``record_json`` as a JSONL line (orjson: a third of ``json.dumps``'s cost). A value orjson refuses is
    the client's doing (module doc): the line is written with it ``clean``ed, never dropped (that pass runs
    only then, so a plain record pays nothing for it)."""
    out = record_json(sent, clock_offset, text_limit)
    try:
        return orjson.dumps(out, option=orjson.OPT_APPEND_NEWLINE)
    except orjson.JSONEncodeError:
        return orjson.dumps(clean(out), option=orjson.OPT_APPEND_NEWLINE)


def minimal_line(sent: dict[str, Any], clock_offset: float) -> bytes:
    """The minimal line (``format.MINIMAL_FIELDS``) of a draft whose record could not be built: its id,
    arrival, path, status and consumer, each ``clean``ed (and of the right type, or its default)."""
    d = {**_DEFAULTS, **sent}

    def text(value: object) -> str:
        return value if isinstance(value, str) else repr(value)

    started, status, consumer = d.get("started"), d["status"], d["consumer"]
    record = RequestRecord(
        id=text(d["id"]),
        t=started + clock_offset if isinstance(started, float) else 0.0,
        path=text(d.get("path", "")),
        status=status if type(status) is int else 0,
        consumer=text(consumer) if consumer is not None else None,
    )
    return orjson.dumps(clean(record.minimal_json()), option=orjson.OPT_APPEND_NEWLINE)
