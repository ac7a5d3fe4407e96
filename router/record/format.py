"""The request record's format: one JSONL line per generation request the router (or one of its worker
processes) proxied. The one module that owns the shape: the router writes it (``router.record.writer``),
``rl-launch status`` reads its tail, ``rl-launch bench replay --trace`` turns a recorded step back into a
workload. Versioned: a reader skips, and counts, lines of another version instead of misreading them.

Version 1, every line a JSON object with ``"v": 1`` and:

==================  =============================================================================
``id``              the router's request id (``x-rl-request-id``)
``session``         a hash of the session key (``policy`` session key: header, ``user``...; never text),
                    or ``null`` when the request carried none
``consumer``        the consumer (standing fleets) or ``null``
``t``               arrival, epoch seconds (when the router had the request's head)
``path``            ``/v1/chat/completions``, ``/v1/completions``...
``stream``          whether the client asked for a stream
``engine``          the engine that answered last (``null``: none was reached)
``attempts``        ``[{"engine", "outcome", "status", "s"}]``: every try, in order; ``outcome`` is ``ok``
                    or the failure kind (``connect``, ``timeout``, ``status_5xx``, ``reset``...), ``s`` its
                    seconds
``held_s``          seconds held before routing: ``{"pause": s, "gate": s, "share": s}`` (pause gate,
                    version gate, fair share), zeros omitted
``ttfb_s``          seconds from arrival to the first byte of the answer sent to the client
``duration_s``      seconds from arrival to the end of the answer
``prompt_tokens``, ``cached_tokens``, ``completion_tokens``
                    from the engine's ``usage`` when it reports it, else ``null``
``finish_reason``   the (first) choice's ``finish_reason`` when the engine reports it
``status``          the status the client got
``version``         the weight version of the engine that answered (``x-rl-weight-version``)
``prompt_bytes``    the request body's size
``max_tokens``      what the client asked for (``max_tokens`` / ``max_completion_tokens``), or ``null``
``prefix``          the request's prompt as block hashes (``router.policies.prefix_index.block_hashes``
                    of the body, hex, at most ``MAX_PREFIX_BLOCKS``): what it shares with other requests,
                    with no text
``moves``           only on a request continued on another engine (``router.continuation``):
                    ``[{"from", "to", "at_token", "reason"}]``, each move in order: the engine left, the
                    one that went on, the completion token it went on from, and why (``drained``,
                    ``quarantined``, ``removed``, ``restarted``, or how the stream broke: ``reset``...)
``weight_versions`` only on a continued request: ``[[version, first, last], ...]``, the weight version
                    that made each run of completion tokens (inclusive indexes; ``null`` version: the
                    engine was never stamped); what the answer's ``x-rl-weight-versions`` says
``text``            only when the job asks for it (``router.record.text: true``): ``{"prompt": ...,
                    "completion": ...}``, with ``"truncated": true`` when the two together were longer
                    than ``1 / TEXT_SHARE`` of one record file (their starts are kept)
==================  =============================================================================

Every value is what JSON can hold: a string with bytes that are not UTF-8 (a client's header) is written
with them replaced, an integer past 64 bits (a client's ``max_tokens``) as ``null``. A request whose record
could not be built at all still gets a *minimal* line: only ``MINIMAL_FIELDS`` (``v``, ``id``, ``t``,
``path``, ``status``, ``consumer``), the rest read as their defaults; so no client can keep its requests out
of the record by what it sends.

Why no prompt or completion text by default: a record lives in a job directory that a team shares; the
hashes keep what a replay needs (which requests share which prefixes, how long each is) and nothing a
prompt said.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RECORD_VERSION = 1
RECORD_FILE = "requests.jsonl"
"""The current file in the record directory; rotated files are ``requests.<n>.jsonl`` (higher is older)
and, per worker process, ``requests-w<k>.jsonl`` / ``requests-w<k>.<n>.jsonl``."""
MAX_PREFIX_BLOCKS = 256
TEXT_SHARE = 8
"""With ``record.text``, a line's text takes at most this fraction of one record file's share of the cap
(``max_bytes / keep_files``): even escaped (JSON's worst case is 6 bytes a byte) a line fits in a file, so
``record.max_mb`` bounds the record whatever the prompts (a 64 MiB prompt would otherwise be one line)."""
OMITTED_WHEN_NONE = ("text", "moves", "weight_versions")
"""Keys a line has only when they say something: the text a job asked for, a continued request's moves."""
MINIMAL_FIELDS = ("id", "t", "path", "status", "consumer")
"""The keys of a minimal line (a record that could not be built whole), besides ``v``."""


@dataclass
class Attempt:
    engine: str
    outcome: str
    status: int | None
    s: float


@dataclass
class RequestRecord:
    id: str
    t: float
    path: str
    status: int
    session: str | None = None
    consumer: str | None = None
    stream: bool = False
    engine: str | None = None
    attempts: list[Attempt] = field(default_factory=list)
    held_s: dict[str, float] = field(default_factory=dict)
    ttfb_s: float | None = None
    duration_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    version: str | None = None
    prompt_bytes: int = 0
    max_tokens: int | None = None
    prefix: list[str] = field(default_factory=list)
    text: dict[str, Any] | None = None
    moves: list[dict[str, Any]] | None = None
    weight_versions: list[list[Any]] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"v": RECORD_VERSION}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if name == "attempts":
                value = [a.__dict__ for a in value]
            if value is None and name in OMITTED_WHEN_NONE:
                continue
            out[name] = value
        return out

    def line(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode() + b"\n"

    def minimal_json(self) -> dict[str, Any]:
        """The minimal line's object (``MINIMAL_FIELDS``): what is written when the whole one could not be."""
        return {"v": RECORD_VERSION, **{name: getattr(self, name) for name in MINIMAL_FIELDS}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        fields["attempts"] = [Attempt(**a) for a in data.get("attempts") or []]
        return cls(**fields)


@dataclass
class ReadReport:
    """What a read kept and what it skipped, and why (a record cut short by a killed job, or lines of
    another format version): a replay says so instead of silently replaying less."""

    records: list[RequestRecord]
    files: list[str]
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1

    def summary(self) -> str:
        if not self.skipped:
            return f"{len(self.records)} request(s) from {len(self.files)} file(s)"
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items()))
        return f"{len(self.records)} request(s) from {len(self.files)} file(s); skipped {why}"


def record_files(path: str | Path) -> list[Path]:
    """The record files of a record directory (or the one file given), oldest first."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        return []

    def age(f: Path) -> tuple[int, str]:
        parts = f.name.split(".")  # requests[-wK].jsonl or requests[-wK].N.jsonl
        rotation = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else 0
        return (-rotation, f.name)

    return sorted((f for f in p.glob("requests*.jsonl") if f.is_file()), key=age)


def iter_lines(path: Path, report: ReadReport) -> Iterator[RequestRecord]:
    try:
        data = path.read_bytes()
    except OSError:
        report.skip("unreadable file(s)")
        return
    lines = data.split(b"\n")
    tail_cut = bool(lines) and lines[-1] != b""
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError:
            last = tail_cut and i == len(lines) - 1
            report.skip("line(s) cut short (the writer was killed mid-line)" if last else "malformed line(s)")
            continue
        if not isinstance(obj, dict):
            report.skip("malformed line(s)")
            continue
        if obj.get("v") != RECORD_VERSION:
            report.skip(f"line(s) of format version {obj.get('v')!r} (this rl-launch reads {RECORD_VERSION})")
            continue
        try:
            yield RequestRecord.from_json(obj)
        except (TypeError, ValueError, KeyError):
            report.skip("malformed line(s)")


def read_records(path: str | Path) -> ReadReport:
    """Every whole record under ``path`` (a record directory or one file), sorted by arrival."""
    files = record_files(path)
    report = ReadReport([], [str(f) for f in files])
    for f in files:
        report.records.extend(iter_lines(f, report))
    report.records.sort(key=lambda r: r.t)
    return report
