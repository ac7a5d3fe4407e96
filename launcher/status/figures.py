"""The dashboard's arithmetic on two scrapes: windows of cumulative counters and histograms, and figures
made fit for JSON.

A counter or a histogram from ``/metrics`` counts since the process started; the dashboard wants what
happens now. Every helper here takes the current and the previous scrape and falls back to the lifetime
figure (or to "unknown") when the previous one cannot be used: the first frame, a restart that reset
the counters, a histogram whose bounds changed.
"""

from __future__ import annotations

import math


def bucket_delta(
    current: list[tuple[float, float]], previous: list[tuple[float, float]] | None
) -> list[tuple[float, float]]:
    """The observations between two scrapes; the current (lifetime) buckets when there is no usable
    previous scrape (first frame, different bounds, or a counter reset after a restart)."""
    if not previous:
        return current
    prev = dict(previous)
    if set(prev) != {le for le, _ in current}:
        return current
    delta = [(le, c - prev[le]) for le, c in current]
    if any(d < 0 for _, d in delta):
        return current
    return delta


def lowest_bucket_bound(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The lowest bucket's bound when quantile ``q`` falls inside it, else None.

    Interpolating from 0 there is pure guesswork: vLLM's e2e histogram starts at 0.3 s, so every fast
    engine would read "150 ms" whatever its real latency. The dashboard shows "<300 ms" instead."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    le, count = buckets[0]
    return le if not math.isinf(le) and count >= q * buckets[-1][1] else None


def finite(value: float | None) -> float | None:
    """JSON has no NaN or infinity: such a figure is simply unknown."""
    if value is None or math.isnan(value) or math.isinf(value):
        return None
    return value


def rounded(value: float | None, digits: int = 4) -> float | None:
    """``finite(value)`` rounded to ``digits``: the snapshot carries figures, not float noise."""
    value = finite(value)
    return None if value is None else round(value, digits)


def counter_rate(cur: float | None, prev: float | None, dt: float) -> float | None:
    """Per-second increase of a counter; None without two readings or when it went down (a restart)."""
    if cur is None or prev is None or dt <= 0 or cur < prev:
        return None
    return (cur - prev) / dt


def windowed_ratio(
    num: float | None, den: float | None, prev_num: float | None, prev_den: float | None
) -> float | None:
    """``num/den`` over the last interval when it saw any ``den``, else since the start: a busy engine
    shows what it does now, an idle one still shows something meaningful."""
    if num is None or den is None:
        return None
    if prev_num is not None and prev_den is not None and den > prev_den and num >= prev_num:
        return (num - prev_num) / (den - prev_den)
    return num / den if den > 0 else None
