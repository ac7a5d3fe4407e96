"""Prometheus metrics of one router, in its own registry.

In-flight and decision counts are read at scrape time rather than updated per request (see below).
A per-router ``CollectorRegistry`` (not the process-global one) so several routers in one process (tests,
the bench's back-to-back arms, a Ray worker that restarts an actor) never collide on metric names.
Per-backend in-flight counts and the policy's own numbers are read at scrape time by a collector, so the
request path pays nothing for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.backends import BackendSet
from router.pause_gate import PauseGate

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


class RouterMetrics:
    def __init__(self, backends: BackendSet, policy_name: str, gate: PauseGate | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter(
            "rl_router_requests", "Requests answered, by route and status", ["route", "status"], registry=r
        )
        self.errors = Counter("rl_router_errors", "Router-side errors, by kind", ["kind"], registry=r)
        self.retries = Counter("rl_router_retries", "Attempts retried on another backend", registry=r)
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
        r.register(_FleetCollector(backends, lambda: policy_name, lambda: self.decisions))
        if gate is not None:
            r.register(_PauseCollector(gate, backends))

    def render(self) -> bytes:
        return generate_latest(self.registry)
