"""Plain counters an engine keeps; ``/metrics`` and ``SimServer.stats()`` both read these.

One source of truth, updated with integer adds in the scheduler's hot loop: a prometheus-client
``Counter.inc`` takes a lock per call, and two sets of books (one for Prometheus, one for the bench)
could disagree.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, fields

# vLLM's buckets for time to first token and end-to-end latency (wall-clock seconds, so at speed s a
# modelled 1 s lands in the 1/s bucket).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class Histogram:
    """Fixed-bucket histogram: ``counts[i]`` observations fell at or under ``bounds[i]`` (not cumulative)."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` pairs ending with ``+Inf``, as Prometheus exposes them."""
        out: list[tuple[str, int]] = []
        acc = 0
        for bound, c in zip((*map(repr, self.bounds), "+Inf"), self.counts, strict=True):
            acc += c
            out.append((bound, acc))
        return out


@dataclass
class EngineStats:
    """Monotonic counters of one engine (tokens count like vLLM's: prefix-cache figures in tokens)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    steps: int = 0
    busy_s: float = 0.0
    """Wall-clock seconds spent in steps (modelled step times, after speed and slow factor)."""
    success: dict[str, int] = field(default_factory=dict)
    """Finished requests by finish reason (``length``, ``stop``)."""
    aborted: int = 0
    errors_injected: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))

    def snapshot(self) -> dict[str, object]:
        """A JSON-friendly copy (histograms reduced to count and sum)."""
        d: dict[str, object] = {
            f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("ttft", "e2e", "success")
        }
        d["success"] = dict(self.success)
        d["ttft_count"], d["ttft_sum"] = self.ttft.count, self.ttft.sum
        d["e2e_count"], d["e2e_sum"] = self.e2e.count, self.e2e.sum
        return d
