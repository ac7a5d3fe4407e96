"""Prometheus metrics of one router, in its own registry.

In-flight and decision counts are read at scrape time rather than updated per request (see below).
A per-router ``CollectorRegistry`` (not the process-global one) so several routers in one process (tests,
the bench's back-to-back arms, a Ray worker that restarts an actor) never collide on metric names.
Per-backend in-flight counts and the policy's own numbers are read at scrape time by a collector, so the
request path pays nothing for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.state.backends import BackendSet
from router.state.fair_share import FairShare
from router.state.pause_gate import PauseGate
from router.state.versions import WeightVersions

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _FleetCollector(Collector):
    def __init__(
        self, backends: BackendSet, policy_name: Callable[[], str], decisions: Callable[[], int]
    ) -> None:
        self._backends = backends
        self._policy_name = policy_name
        self._decisions = decisions

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        b = self._backends
        inflight = GaugeMetricFamily(
            "rl_router_backend_in_flight", "Requests in flight per serving backend", labels=["backend"]
        )
        for url, n in b.load.snapshot().items():
            inflight.add_metric([url], n)
        yield inflight
        serving = GaugeMetricFamily("rl_router_serving_backends", "Backends in the serving set")
        serving.add_metric([], len(b.serving))
        yield serving
        ok = CounterMetricFamily(
            "rl_router_backend_successes", "Fully sent responses per backend", labels=["backend"]
        )
        bad = CounterMetricFamily(
            "rl_router_backend_failures", "Failed attempts per backend", labels=["backend"]
        )
        for url, (s, f) in list(b.totals.items()):
            ok.add_metric([url], s)
            bad.add_metric([url], f)
        yield ok
        yield bad
        stats = GaugeMetricFamily(
            "rl_router_policy_stat", "Numbers the routing policy reports", labels=["policy", "stat"]
        )
        name = self._policy_name()
        for key, value in b.policy.stats().items():
            stats.add_metric([name, key], value)
        yield stats
        in_flight = GaugeMetricFamily("rl_router_in_flight", "Requests being proxied to a backend now")
        in_flight.add_metric([], b.load.total_in_flight)
        yield in_flight
        decisions = CounterMetricFamily(
            "rl_router_policy_decisions", "Backends chosen by the policy", labels=["policy"]
        )
        decisions.add_metric([name], self._decisions())
        yield decisions


# A worker process's per-request samples, as sent to the parent (router.multiprocess.wire STATS):
# [[family name, type, help, [[sample name, labels, value], ...]], ...]
Snapshot = list[list[Any]]


def per_request_snapshot(registry: CollectorRegistry) -> Snapshot:
    """The samples of ``registry`` in the shape ``merge_snapshots`` sums (``_created`` left out: a
    creation time is not a count)."""
    return [
        [
            f.name,
            f.type,
            f.documentation,
            [[s.name, s.labels, s.value] for s in f.samples if not s.name.endswith("_created")],
        ]
        for f in registry.collect()
    ]


def merge_snapshots(snapshots: list[Snapshot]) -> list[Metric]:
    """Counters and histogram buckets summed across workers, sample by sample (all are cumulative
    counts, so the sum is what one process would have counted)."""
    families: dict[str, tuple[str, str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]] = {}
    for snapshot in snapshots:
        for name, kind, doc, samples in snapshot:
            _, _, sums = families.setdefault(name, (kind, doc, {}))
            for sample_name, labels, value in samples:
                key = (sample_name, tuple(sorted(labels.items())))
                sums[key] = sums.get(key, 0.0) + value
    out = []
    for name, (kind, doc, sums) in families.items():
        metric = Metric(name, doc, kind)
        for (sample_name, labels), value in sums.items():
            metric.add_sample(sample_name, dict(labels), value)
        out.append(metric)
    return out


class WorkerStats(Protocol):
    """What the parent of worker processes offers the metrics: the workers' latest snapshots."""

    restarts: int

    def snapshots(self) -> dict[int, Snapshot]: ...

    def serving(self) -> int: ...

    def retired(self) -> list[Snapshot]:
        """Last counts of workers that died (kept in the sums)."""
        ...

    async def refresh(self) -> None: ...


class _WorkersCollector(Collector):
    def __init__(self, workers: WorkerStats) -> None:
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        snapshots = self._workers.snapshots()
        yield from merge_snapshots([*snapshots.values(), *self._workers.retired()])
        per_worker = GaugeMetricFamily(
            "rl_router_worker_requests", "Requests answered by each worker process", labels=["worker"]
        )
        for index, snapshot in sorted(snapshots.items()):
            total = sum(
                value
                for name, _kind, _doc, samples in snapshot
                if name == "rl_router_requests"
                for sample_name, _labels, value in samples
                if sample_name == "rl_router_requests_total"
            )
            per_worker.add_metric([str(index)], total)
        yield per_worker
        alive = GaugeMetricFamily("rl_router_workers", "Worker processes serving the port")
        alive.add_metric([], self._workers.serving())
        yield alive
        restarts = CounterMetricFamily("rl_router_worker_restarts", "Worker processes replaced after dying")
        restarts.add_metric([], self._workers.restarts)
        yield restarts


class _PauseCollector(Collector):
    """The fleet pause as the router sees it: read at scrape time, nothing on the request path."""

    def __init__(self, gate: PauseGate, backends: BackendSet) -> None:
        self._gate = gate
        self._backends = backends

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._gate.stats()
        gauges = (
            ("rl_router_fleet_paused", "1 while the fleet is paused for a weight update", float(s.paused)),
            ("rl_router_held_requests", "Generation requests held until resume", s.held),
            ("rl_router_held_longest_wait_seconds", "Longest wait among requests held now", s.longest_wait_s),
            (
                "rl_router_last_pause_max_wait_seconds",
                "Longest wait of a held request in the last completed pause",
                s.last_max_wait_s,
            ),
            ("rl_router_last_pause_seconds", "Duration of the last completed pause", s.last_pause_s),
            (
                "rl_router_stale_backends",
                "Engines held out until refit to the current version",
                len(self._backends.stale),
            ),
        )
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        for name, doc, value in (
            ("rl_router_held", "Requests held during pauses", s.held_total),
            ("rl_router_held_refused", "Requests refused past the pause bounds", s.refused_total),
            ("rl_router_pauses", "Fleet pauses", s.pauses_total),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c


class _VersionCollector(Collector):
    """Weight versions as the routing state sees them (``router.state.versions``), read at scrape time."""

    def __init__(self, versions: WeightVersions) -> None:
        self._versions = versions

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        v = self._versions
        held = GaugeMetricFamily(
            "rl_router_version_held_requests",
            "Requests held now for an engine on the weight version they want",
        )
        held.add_metric([], v.held)
        yield held
        for name, doc, value in (
            (
                "rl_router_version_refused",
                "Requests gated on a weight version refused past the hold's bounds",
                v.refused_total,
            ),
            (
                "rl_router_straddled_requests",
                "Requests whose engine's weight version changed while they were in flight",
                v.straddled_total,
            ),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c


class _ConsumerCollector(Collector):
    """Per consumer of a standing fleet (``router.state.fair_share``), read at scrape time from the routing
    state's ledger: exact for the whole router, worker processes included, and nothing on the request
    path. Consumer names are ``[A-Za-z0-9._-]`` (``router.consumers``); prometheus_client escapes label
    values in any case."""

    def __init__(self, fair: FairShare) -> None:
        self._fair = fair

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        fair = self._fair
        rows = fair.rows()
        requests = CounterMetricFamily(
            "rl_router_consumer_requests",
            "Generation requests of each consumer that reached an engine and ended",
            labels=["consumer"],
        )
        tokens = CounterMetricFamily(
            "rl_router_consumer_completion_tokens",
            "Completion tokens the engines reported (usage) for each consumer's requests",
            labels=["consumer"],
        )
        refused = CounterMetricFamily(
            "rl_router_consumer_refused",
            "Generation requests refused past the fair-share wait bound, per consumer",
            labels=["consumer"],
        )
        in_flight = GaugeMetricFamily(
            "rl_router_consumer_in_flight",
            "Generation requests of each consumer in flight",
            labels=["consumer"],
        )
        waiting = GaugeMetricFamily(
            "rl_router_consumer_waiting",
            "Generation requests of each consumer waiting for a fair-share slot",
            labels=["consumer"],
        )
        share = GaugeMetricFamily(
            "rl_router_consumer_share",
            "Each consumer's fraction of the generation requests completed in the last 60 s",
            labels=["consumer"],
        )
        for name, row in rows.items():
            requests.add_metric([name], row["requests"])
            tokens.add_metric([name], row["completion_tokens"])
            refused.add_metric([name], row["refused"])
            in_flight.add_metric([name], row["in_flight"])
            waiting.add_metric([name], row["waiting"])
            share.add_metric([name], row["share"])
        yield from (requests, tokens, refused, in_flight, waiting, share)
        if fair.capacity is not None:
            capacity = GaugeMetricFamily(
                "rl_router_fair_share_capacity", "Generation requests in flight through the router at most"
            )
            capacity.add_metric([], fair.capacity)
            yield capacity


class RouterMetrics:
    """``backends``: the routing state's view (None in a worker process, whose parent reports it).
    ``gate``: the fleet pause gate, reported where the routing state lives (the parent of worker
    processes holds the one gate, so its numbers appear once in the aggregated metrics).
    ``workers``: in the parent of worker processes, the source of their per-request counts, which are
    then reported summed (one router, one set of numbers) instead of this process's own.
    ``fair``: the consumer ledger, reported where the routing state lives (as ``gate``)."""

    def __init__(
        self,
        backends: BackendSet | None,
        policy_name: str,
        gate: PauseGate | None = None,
        workers: WorkerStats | None = None,
        fair: FairShare | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._workers = workers
        r = self.registry if workers is None else CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "rl_router_requests", "Requests answered, by route and status", ["route", "status"], registry=r
        )
        self.errors = Counter("rl_router_errors", "Router-side errors, by kind", ["kind"], registry=r)
        self.retries = Counter("rl_router_retries", "Attempts retried on another backend", registry=r)
        self.moves = Counter(
            "rl_router_moves",
            "Generations moved to another engine mid-answer with the tokens they had (router.continuation), "
            "by why: drained, quarantined, removed, restarted, or how the stream broke",
            ["reason"],
            registry=r,
        )
        self._poisoned: Counter | None = None
        self.latency = Histogram(
            "rl_router_request_duration_seconds",
            "Time from request received to response fully sent",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # Plain ints on the request path, read at scrape time: a prometheus-client metric takes a lock
        # per update, and the router pays for every one of them on every request.
        self.decisions = 0
        if backends is not None:
            self.registry.register(_FleetCollector(backends, lambda: policy_name, lambda: self.decisions))
            self.registry.register(_VersionCollector(backends.versions))
            if gate is not None:
                self.registry.register(_PauseCollector(gate, backends))
            if fair is not None:
                self.registry.register(_ConsumerCollector(fair))
        if workers is not None:
            self.registry.register(_WorkersCollector(workers))
        self.own_registry = r

    def poisoned(self, consumer: str) -> None:
        """Count a generation request of ``consumer`` answered 500 whose failure followed the request (it
        failed on two engines, or the engine blamed the input: ``router.http.attribution``), charged to no
        engine's health. Per consumer as the ``rl_router_consumer_*`` families, but counted where the
        request ends (a worker process's counts are summed by the parent), "owner" without a consumers
        file; the family is made at the first one, so a router that never had one lists none (a router
        without consumers lists no consumer family)."""
        if self._poisoned is None:
            self._poisoned = Counter(
                "rl_router_consumer_poisoned",
                "Generation requests answered 500 whose failure followed the request, charged to no engine",
                ["consumer"],
                registry=self.own_registry,
            )
        self._poisoned.labels(consumer).inc()

    async def refresh(self) -> None:
        """Fetch the workers' counts before a render (nothing to do in a single process)."""
        if self._workers is not None:
            await self._workers.refresh()

    def render(self, consumers: bool = False) -> bytes:
        """The open ``/metrics``: every family but the per-consumer ones. ``consumers``: those alone
        (``GET /fleet/metrics``, the fleet owner's). The families of a standing fleet's consumers are
        labelled with their job names, which the open ``/metrics`` showed any local user (with each one's
        requests, tokens and share); an opaque label would still count the tenants and their usage, and a
        job name is guessed from the spec name and a timestamp, so a digest of it hides nothing."""
        return generate_latest(_Families(self.registry, consumers))


CONSUMER_FAMILIES = "rl_router_consumer_"
"""The prefix of every family labelled with a consumer's name (``_ConsumerCollector``, ``poisoned``)."""


class _Families(Collector):
    """The families of ``registry`` that are (``consumers``) or are not per consumer, as a registry
    ``generate_latest`` reads."""

    def __init__(self, registry: CollectorRegistry, consumers: bool) -> None:
        self._registry = registry
        self._consumers = consumers

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            if family.name.startswith(CONSUMER_FAMILIES) == self._consumers:
                yield family
