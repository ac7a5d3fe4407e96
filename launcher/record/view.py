"""The current step's rollouts as figures, from request records: its slowest sessions (turns, the
engines they moved between, turns included: ``continued`` counts the moves inside turns, where their time
went, weight versions, a continued turn's spans included) and a step timeline (requests in
flight over time, sessions finished, the tail's share of the step).

When a step is slow the question is which rollouts were the tail and where their time went: held by
the router (a pause, a version gate, the fair share), waiting for the first byte (the engine's queue and
prefill: a cache miss shows here), decoding, or between turns (the client's own time: tool calls, Gym).
The aggregate ``/metrics`` cannot answer it; the record can, per session. Pure: the dashboard renders
these figures (``launcher.status.rollouts``) and ``--json`` prints them.
"""

from __future__ import annotations

from typing import Any

from router.record.format import RequestRecord
from router.record.sessions import conversations

TOP = 8
TIMELINE_BINS = 60


def _end(r: RequestRecord) -> float:
    return r.t + (r.duration_s or 0.0)


def _versions(r: RequestRecord) -> list[str | None]:
    """The weight versions that made ``r``'s tokens: its spans' when it crossed a refit or a move."""
    return [span[0] for span in r.weight_versions or []] or [r.version]


def rollouts_view(records: list[RequestRecord], now: float, top: int = TOP) -> dict[str, Any] | None:
    """The slowest sessions and the step timeline of ``records`` (None: no record yet)."""
    if not records:
        return None
    sessions = []
    for key, rs in conversations(records, infer_sessions=True)[0]:
        engines: list[str] = []
        for r in rs:
            # A continued request ran on each engine it moved between (``RequestRecord.moves``).
            for engine in [*(m.get("from") for m in r.moves or []), r.engine]:
                if engine and (not engines or engines[-1] != engine):
                    engines.append(engine)
        held = sum(sum(r.held_s.values()) for r in rs)
        first_byte = sum(max(0.0, (r.ttfb_s or 0.0) - sum(r.held_s.values())) for r in rs)
        decode = sum(max(0.0, (r.duration_s or 0.0) - (r.ttfb_s or 0.0)) for r in rs)
        busy = sum(r.duration_s or 0.0 for r in rs)
        start, end = rs[0].t, max(_end(r) for r in rs)
        sessions.append(
            {
                "session": key,
                "turns": len(rs),
                "start": start,
                "end": end,
                "span_s": round(end - start, 3),
                "engines": engines,
                "moves": max(0, len(engines) - 1),
                "phases_s": {
                    "held": round(held, 3),
                    "first_byte": round(first_byte, 3),
                    "decode": round(decode, 3),
                    "between_turns": round(max(0.0, end - start - busy), 3),
                },
                "versions": sorted({v for r in rs for v in _versions(r) if v}),
                "continued": sum(len(r.moves or []) for r in rs),
                "failed": sum(r.status >= 400 for r in rs),
                "completion_tokens": sum(r.completion_tokens or 0 for r in rs),
                "last_request": rs[-1].id,
            }
        )
    sessions.sort(key=lambda s: s["span_s"], reverse=True)
    t0 = min(r.t for r in records)
    t1 = max(max(_end(r) for r in records), t0 + 1e-6)
    return {
        "start": t0,
        "end": t1,
        "requests": len(records),
        "sessions": len(sessions),
        "slowest": sessions[:top],
        "timeline": _timeline(records, sessions, t0, t1),
    }


def _timeline(
    records: list[RequestRecord], sessions: list[dict[str, Any]], t0: float, t1: float
) -> dict[str, Any]:
    """In flight per bin (requests overlapping it), sessions finished by each bin's end, and the tail's
    share: the time after 90% of the sessions had finished, over the whole span."""
    width = (t1 - t0) / TIMELINE_BINS
    in_flight = [0] * TIMELINE_BINS
    for r in records:
        a = int((r.t - t0) / width)
        b = int((_end(r) - t0) / width)
        for i in range(max(0, a), min(TIMELINE_BINS - 1, b) + 1):
            in_flight[i] += 1
    ends = sorted(s["end"] for s in sessions)
    finished = []
    j = 0
    for i in range(TIMELINE_BINS):
        edge = t0 + (i + 1) * width
        while j < len(ends) and ends[j] <= edge:
            j += 1
        finished.append(j)
    t90 = ends[max(0, int(0.9 * len(ends)) - 1)] if ends else t1
    return {
        "bin_s": round(width, 3),
        "in_flight": in_flight,
        "sessions_finished": finished,
        "t90_s": round(t90 - t0, 3),
        "tail_share": round((t1 - t90) / (t1 - t0), 3),
    }
