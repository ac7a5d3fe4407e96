"""The end of a job's request record (``router.record`` writes it), read without loading a long run.

Only the last ``TAIL_BYTES`` of each current (unrotated) file are read: the record may be hundreds of MB,
and the dashboard reads it every refresh. A line being written is skipped, never half-parsed.
"""

from __future__ import annotations

from pathlib import Path

from router.record.format import RECORD_VERSION, RequestRecord

TAIL_BYTES = 8 << 20


def read_tail(
    record_dir: str | Path, since: float | None, consumer: str | None = None
) -> list[RequestRecord]:
    """The records of the current (unrotated) files that arrived at or after ``since``, read from the last
    ``TAIL_BYTES`` of each file; ``consumer``: only that consumer's (a job on a standing fleet)."""
    import orjson

    d = Path(record_dir)
    if not d.is_dir():
        return []
    out: list[RequestRecord] = []
    for f in d.glob("requests*.jsonl"):
        if f.name.count(".") != 1:  # requests[-wK].N.jsonl: rotated, older
            continue
        try:
            size = f.stat().st_size
            with f.open("rb") as fh:
                if size > TAIL_BYTES:
                    fh.seek(size - TAIL_BYTES)
                    fh.readline()  # a partial first line
                data = fh.read()
        except OSError:
            continue
        for raw in data.split(b"\n"):
            if not raw:
                continue
            try:
                obj = orjson.loads(raw)
                if obj.get("v") != RECORD_VERSION or (since is not None and obj["t"] < since):
                    continue
                if consumer is not None and obj.get("consumer") != consumer:
                    continue
                out.append(RequestRecord.from_json(obj))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a line being written, or another shape: the next refresh has it whole
    out.sort(key=lambda r: r.t)
    return out
