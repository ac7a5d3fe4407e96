"""Every sample of a Prometheus text as a sorted list of (name, sorted labels, value), read two ways:
``reference`` by ``prometheus_client``'s own parser, ``ours`` by the project's reader
(``router.prometheus.parse_metrics``); the tests hold the two equal on what the real emitters write."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from router.prometheus import parse_metrics


def _key(value: float) -> float | str:
    return "nan" if math.isnan(value) else value


def reference(text: str) -> list[tuple[str, tuple[tuple[str, str], ...], float | str]]:
    """Every sample as ``prometheus_client`` reads it (name, sorted labels, value)."""
    return sorted(
        (s.name, tuple(sorted(s.labels.items())), _key(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    )


def ours(text: str) -> list[tuple[str, tuple[tuple[str, str], ...], float | str]]:
    return sorted(
        (name, tuple(sorted(s.labels.items())), _key(s.value))
        for name, samples in parse_metrics(text, strict=True).items()
        for s in samples
    )
