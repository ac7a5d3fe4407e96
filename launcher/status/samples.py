"""One scrape of the router's or an engine's ``/metrics``: fetched, then read into typed figures.

The fetch never raises and never outlasts its timeout: a row shows why its endpoint gave nothing, and
one wedged engine cannot hold up the frame. The text is read by ``router.prometheus`` (the project's one
Prometheus reader), keeping only the families below; the collector turns two of these samples into
rates and windowed latencies (``launcher.status.figures``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp

from router.fleet.engine import describe_failure
from router.prometheus import histogram_buckets, metric_by_label, metric_sum, parse_metrics

# Only these families are parsed from an engine's /metrics: a real vLLM exposes ~100 KB per engine, and
# at 256 engines a full parse every second would cost more CPU than the rest of the dashboard together.
# Older vLLM names (gpu_cache_usage_perc, gpu_prefix_cache_*) are read as fallbacks.
ENGINE_PREFIXES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_hits_total",
    "vllm:request_success_total",
    "vllm:e2e_request_latency_seconds_bucket",
)
ROUTER_PREFIXES = ("rl_router_",)

Scrape = tuple[str | None, str | None, float]
"""``(body, error, monotonic time)`` of one ``GET /metrics``: a body or the reason there is none."""


async def fetch_metrics(session: aiohttp.ClientSession, base_url: str, timeout_s: float) -> Scrape:
    """``GET base_url/metrics`` of the front, which serves it open (engines are read through
    ``router.fleet.engine``'s client, which owns their routes and their key); never raises, never
    outlasts the timeout, never follows a redirect (a 3xx shows as the row's error)."""
    url = f"{base_url.rstrip('/')}/metrics"
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(url, allow_redirects=False) as resp:
                if resp.status != 200:
                    return None, f"HTTP {resp.status} from /metrics", time.monotonic()
                return await resp.text(errors="replace"), None, time.monotonic()
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
        return None, describe_failure(exc, timeout_s), time.monotonic()


def canonical_url(url: str) -> str:
    """The router keys backends by ``http://host:port`` (no ``/v1``); engine listings may carry either."""
    try:
        from router.state.backends import canonical_backend_url

        return canonical_backend_url(url)
    except (ImportError, ValueError):
        url = url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url


@dataclass
class RouterSample:
    """The router's counters at one instant (cumulative; rates come from two of these)."""

    t: float
    requests: float
    by_status: dict[str, float]
    errors: dict[str, float]
    latency: list[tuple[float, float]]
    backend_in_flight: dict[str, float]
    successes: dict[str, float]
    failures: dict[str, float]
    in_flight: float | None
    serving: float | None

    @classmethod
    def parse(cls, text: str, t: float) -> RouterSample:
        m = parse_metrics(text, ROUTER_PREFIXES)
        by_status = metric_by_label(m, "rl_router_requests_total", "status")
        return cls(
            t=t,
            requests=sum(by_status.values()),
            by_status=by_status,
            errors=metric_by_label(m, "rl_router_errors_total", "kind"),
            latency=histogram_buckets(m, "rl_router_request_duration_seconds"),
            backend_in_flight=metric_by_label(m, "rl_router_backend_in_flight", "backend"),
            successes=metric_by_label(m, "rl_router_backend_successes_total", "backend"),
            failures=metric_by_label(m, "rl_router_backend_failures_total", "backend"),
            in_flight=metric_sum(m, "rl_router_in_flight"),
            serving=metric_sum(m, "rl_router_serving_backends"),
        )


@dataclass
class EngineSample:
    """One engine's vLLM metrics at one instant."""

    t: float
    running: float | None
    waiting: float | None
    kv_usage: float | None
    prefix_queries: float | None
    prefix_hits: float | None
    successes: float | None
    e2e: list[tuple[float, float]] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str, t: float) -> EngineSample:
        m = parse_metrics(text, ENGINE_PREFIXES)

        def first(*names: str) -> float | None:
            for n in names:
                v = metric_sum(m, n)
                if v is not None:
                    return v
            return None

        return cls(
            t=t,
            running=first("vllm:num_requests_running"),
            waiting=first("vllm:num_requests_waiting"),
            kv_usage=first("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
            prefix_queries=first("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
            prefix_hits=first("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
            successes=first("vllm:request_success_total"),
            e2e=histogram_buckets(m, "vllm:e2e_request_latency_seconds"),
        )
