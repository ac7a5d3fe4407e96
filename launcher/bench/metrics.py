"""Read the engines' own Prometheus counters before and after an arm.

Why the engines' metrics and not the router's: the prefix-cache hit rate and the per-engine request
count are facts about the engines, and the direct arm has no router at all. Reading the same vLLM
counters in every arm (``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``, both in
tokens; ``vllm:request_success_total``) makes the arms comparable, and a delta over the run removes
whatever the engine did before (warm-up, an earlier arm on a shared fleet).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

from router.fleet.engine import LOAD_GAUGES, EngineClient
from router.fleet.ops import fan_out
from router.prometheus import metric_sum, parse_metrics

WATCHED: tuple[str, ...] = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)


def parse_prometheus(text: str, names: Sequence[str] = WATCHED) -> dict[str, float]:
    """Sum each wanted metric over all its label sets (e.g. ``finished_reason``, ``model_name``); a
    metric the text does not hold is left out. Read by ``router.prometheus``, only the wanted lines."""
    metrics = parse_metrics(text, tuple(names))
    out: dict[str, float] = {}
    for name in names:
        total = metric_sum(metrics, name)
        if total is not None:
            out[name] = total
    return out


async def scrape(
    engine_urls: Sequence[str], timeout_s: float = 10.0, api_key: str | None = None
) -> list[dict[str, float] | None]:
    """``GET {url}/metrics`` of every engine (URL without ``/v1``) through the engine client, which
    sends ``api_key`` (a job's engines take it on every route but ``/health``) and follows no redirect;
    None where it could not be read."""
    urls = [u.rstrip("/") for u in engine_urls]
    got = await fan_out(urls, EngineClient.metrics_text, api_key=api_key, timeout_s=timeout_s)
    return [None if r.value is None else parse_prometheus(r.value) for r in got]


def deltas(
    before: Sequence[dict[str, float] | None], after: Sequence[dict[str, float] | None]
) -> list[dict[str, float] | None]:
    """Per-engine counter increase over the run (None for an engine missing from either scrape)."""
    out: list[dict[str, float] | None] = []
    for b, a in zip(before, after, strict=True):
        if a is None or b is None:
            out.append(None)
        else:
            out.append({k: a[k] - b.get(k, 0.0) for k in a})
    return out


async def sample_load(
    engine_urls: Sequence[str],
    interval_s: float,
    stop: asyncio.Event,
    api_key: str | None = None,
) -> list[tuple[float, list[float | None]]]:
    """``(epoch seconds, requests on each engine)`` every ``interval_s`` until ``stop`` is set: running
    plus waiting, the engines' own gauges, for the per-engine load plot. Only the engines can say this
    for a router's arm (the client does not know where the router sent each request); one scrape of
    each engine a second is far below what the measured traffic costs them."""
    urls = [u.rstrip("/") for u in engine_urls]
    samples: list[tuple[float, list[float | None]]] = []
    async with EngineClient.open(api_key, max(1.0, 2 * interval_s)) as engines:
        while not stop.is_set():
            t = time.time()
            got = await engines.each(urls, EngineClient.metrics_text)
            loads: list[float | None] = []
            for r in got:
                m = None if r.value is None else parse_prometheus(r.value, LOAD_GAUGES)
                loads.append(None if not m else sum(m.values()))
            samples.append((t, loads))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, interval_s - (time.time() - t)))
    return samples
