"""``/metrics`` of one simulated engine, in Prometheus text with vLLM's metric names.

A custom collector in a per-engine ``CollectorRegistry`` reads the engine's plain counters at scrape
time: many engines in one process must not share (or collide on) the global registry, and the
scheduler's hot loop must not take prometheus-client locks per token.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from .scheduler import Scheduler
from .stats import Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SimCollector(Collector):
    """Yields vLLM-named metric families from a scheduler's live state and counters."""

    def __init__(self, scheduler: Scheduler, model_name: str) -> None:
        self.scheduler = scheduler
        self.model_name = model_name

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self.model_name], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([self.model_name], value)
        return c

    def _histogram(self, name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=["model_name"])
        fam.add_metric([self.model_name], buckets=h.cumulative(), sum_value=h.sum)
        return fam

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        s = self.scheduler
        st = s.stats
        yield self._gauge("vllm:num_requests_running", "Requests in model execution batches.", len(s.running))
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", len(s.waiting))
        yield self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.pool.usage()
        )
        yield self._counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens.", st.prefix_cache_queries
        )
        yield self._counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens.", st.prefix_cache_hits
        )
        yield self._counter("vllm:prompt_tokens", "Prefill tokens processed.", st.prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Generation tokens processed.", st.generation_tokens)
        yield self._counter("vllm:num_preemptions", "Cumulative preemptions.", st.preemptions)
        success = CounterMetricFamily(
            "vllm:request_success",
            "Successfully processed requests.",
            labels=["model_name", "finished_reason"],
        )
        for reason in sorted({"length", "stop", *st.success}):
            success.add_metric([self.model_name, reason], st.success.get(reason, 0))
        yield success
        yield self._histogram(
            "vllm:time_to_first_token_seconds", "Time to first token (wall clock).", st.ttft
        )
        yield self._histogram("vllm:e2e_request_latency_seconds", "End-to-end latency (wall clock).", st.e2e)


class SimMetrics:
    """The registry of one engine; ``render()`` is the ``/metrics`` body."""

    def __init__(self, scheduler: Scheduler, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SimCollector(scheduler, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)
