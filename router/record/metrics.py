"""The request record's own metrics: records written, dropped and failed, and the record's bytes on disk.

Here rather than in ``router.state.metrics``: they count the record's writer and read the record's
directory (``router.record.format.record_files``), and the routing state's metrics must not depend on the
record (the record is built on the state, not the reverse). They register on the router's
``RouterMetrics`` registries like the rest, so ``/metrics`` renders them together.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.record.format import record_files
from router.state.metrics import RouterMetrics


class RecordCounts(Protocol):
    """What a request record writer counts (``router.record.writer.RecordWriter``)."""

    written: int
    write_errors: int

    @property
    def dropped(self) -> int: ...


class _RecordCollector(Collector):
    """A process's request record counts, read at scrape time (plain ints on the writer)."""

    def __init__(self, counts: RecordCounts) -> None:
        self._counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        c = self._counts
        yield CounterMetricFamily(
            "rl_router_record_written", "Request records written to the record files", value=c.written
        )
        yield CounterMetricFamily(
            "rl_router_record_dropped",
            "Request records not written (the record's queue was full, or a write failed)",
            value=c.dropped,
        )
        yield CounterMetricFamily(
            "rl_router_record_write_errors", "Writes of request records that failed", value=c.write_errors
        )


class _RecordBytesCollector(Collector):
    """Bytes of the record directory's files now, every process's together (read from the directory at
    scrape time: the one figure no single process counts)."""

    def __init__(self, directory: str) -> None:
        self._directory = directory

    def collect(self) -> Iterator[GaugeMetricFamily]:
        total = 0
        for f in record_files(self._directory):
            try:
                total += f.stat().st_size
            except OSError:  # rotated away since the listing
                pass
        yield GaugeMetricFamily("rl_router_record_bytes", "Bytes of request records on disk now", value=total)


def watch_record(metrics: RouterMetrics, counts: RecordCounts | None, directory: str | None) -> None:
    """Report this process's request record counts with its other per-request counts (summed over the
    workers by the parent), and, where ``directory`` is given (the process that renders the router's
    metrics), the bytes on disk of the whole record."""
    if counts is not None:
        metrics.own_registry.register(_RecordCollector(counts))
    if directory is not None:
        metrics.registry.register(_RecordBytesCollector(directory))
