"""The engines' own counters, read from their ``/metrics``, as snapshots and per-step deltas.

A trainer logs one dict per RL step: how many prompt and generation tokens the fleet processed, how many
prefix-cache tokens hit, how requests finished, how often the engines preempted. The engines count this
themselves (vLLM's Prometheus counters, which the simulator mirrors), so the router reads them rather than
counting on the request path: its own counts would miss requests sent to engines directly and would
cost every request. A snapshot is ``{engine url: {counter: value}}``; a delta subtracts two snapshots
engine by engine (an engine that restarted in between, whose counters went down, counts from zero) and
sums the fleet.

This module owns the counter names of the step dict (``COUNTERS`` and ``finished_<reason>``) and their
arithmetic; ``router.fleet.engine.EngineClient.counters`` reads one engine's (with the engine key, since
``/metrics`` is not open).
"""

from __future__ import annotations

from typing import Any

from router.prometheus import parse_metrics

COUNTERS: dict[str, str] = {
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
    "vllm:num_preemptions": "preemptions",
    "vllm:spec_decode_num_drafts": "spec_decode_drafts",
    "vllm:spec_decode_num_draft_tokens": "spec_decode_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "spec_decode_accepted_tokens",
}
"""vLLM family name (without ``_total``) -> our key. Speculative-decoding keys appear only when present."""
REQUESTS_BY_REASON = "vllm:request_success"

Counters = dict[str, float]
Snapshot = dict[str, Counters]


def parse_counters(text: str) -> Counters:
    """vLLM Prometheus text -> ``{key: value}`` summed over labels (model, engine index). Raises
    ``ValueError`` when a line is not a sample: an engine that answered something else (an HTML page)
    is an error of the read, not an engine that counted nothing."""
    out: Counters = {}
    # By sample name (``router.prometheus``), not family type.
    for sample_name, samples in parse_metrics(text, strict=True).items():
        if not sample_name.endswith("_total"):
            continue
        name = sample_name[: -len("_total")]
        key = COUNTERS.get(name)
        if key is None and name != REQUESTS_BY_REASON:
            continue
        for labels, value in samples:
            k = key or f"finished_{labels.get('finished_reason', 'unknown')}"
            out[k] = out.get(k, 0.0) + value
    return out


def fleet_total(snapshot: Snapshot) -> Counters:
    total: Counters = {}
    for counters in snapshot.values():
        for k, v in counters.items():
            total[k] = total.get(k, 0.0) + v
    return total


def delta(before: Snapshot, after: Snapshot) -> Snapshot:
    """Per engine ``after - before``; an engine new in ``after`` or whose counter went down (it
    restarted) counts from zero."""
    out: Snapshot = {}
    for url, now in after.items():
        then = before.get(url, {})
        out[url] = {k: (v - then.get(k, 0.0)) if v >= then.get(k, 0.0) else v for k, v in now.items()}
    return out


def step_dict(per_engine: Snapshot) -> dict[str, Any]:
    """``{"fleet": {...}, "engines": {url: {...}}, "prefix_hit_rate": ...}`` with integral counts."""
    fleet = fleet_total(per_engine)
    q = fleet.get("prefix_cache_queries", 0.0)
    return {
        "fleet": {k: int(v) if float(v).is_integer() else v for k, v in sorted(fleet.items())},
        "engines": {
            u: {k: int(v) if float(v).is_integer() else v for k, v in sorted(c.items())}
            for u, c in per_engine.items()
        },
        "prefix_hit_rate": (fleet.get("prefix_cache_hits", 0.0) / q) if q else None,
    }
