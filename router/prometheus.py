"""The project's one reader of Prometheus text (the exposition format an engine's or a router's
``/metrics`` answers): samples by name, each with its labels and value.

Engines (vLLM and the simulator, both through ``prometheus_client``), our router and the other fronts
speak this format, and each reader of it had its own parser: ``prometheus_client``'s (slow, and one odd
line fails the whole text), and two small ones that took an exemplar's number for the value or read an
escaped backslash before ``n`` as a newline. One parser, with the choices each reader needs
(``router.fleet.engine_counters``, ``launcher.status`` and ``launcher.bench.metrics`` read through it):

* Line by line, with a prefix filter applied before any parsing (``prefixes``): a real vLLM answers
  ~100 KB, and a dashboard that scrapes 256 engines every second must not parse the families it throws
  away.
* Tolerant by default: a line it cannot read is skipped, because a status view that crashes on one odd
  metric helps nobody. ``strict=True`` raises ``PrometheusTextError`` (a ``ValueError``) naming the
  first such line instead, for a reader that must tell "this engine answered something else" (an HTML
  page, a proxy's error) from "this engine counted nothing".
* Label values are read as quoted strings with their escapes (``\\\\``, ``\\"``, ``\\n``), so a value may
  hold spaces, commas, ``}`` or ``#``; what follows the value (a timestamp, an OpenMetrics exemplar
  ``# {...} 1.0``) is ignored rather than mistaken for it.
* Values are floats as Prometheus writes them (``NaN``, ``+Inf``, ``-Inf``, ``1e+06``). Comment lines
  (``# HELP``, ``# TYPE``, ``# EOF``) are skipped: samples are keyed by their own name
  (``x_total``, ``x_bucket``, ``x_created``), never by family, since parsers disagree on how a
  ``# TYPE x counter`` family groups its ``x_total`` samples.

Metric names are read in Prometheus' classic character set, which every emitter above uses; a line in
the newer quoted-name form (``{"a.b", ...}``) is an unreadable line.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple


class Sample(NamedTuple):
    labels: dict[str, str]
    value: float


Metrics = dict[str, list[Sample]]
"""Sample name (as written: ``vllm:prompt_tokens_total``, ``x_bucket``) -> its samples, in text order."""


class PrometheusTextError(ValueError):
    """A line of the text is not a Prometheus sample (``strict`` parsing only)."""


_QUOTED = r'"[^"\\\n]*(?:\\.[^"\\\n]*)*"'  # unrolled: one pass, no per-character alternation
_SAMPLE = re.compile(
    r"([A-Za-z_:][A-Za-z0-9_:]*)"  # the sample name
    rf"[ \t]*(?:\{{([^\"}}]*(?:{_QUOTED}[^\"}}]*)*)\}}[ \t]*|[ \t]+)"  # its labels, or at least one blank
    r"([^ \t]+)"  # the value; a timestamp or an exemplar may follow
)
_PAIR = rf"[A-Za-z_][A-Za-z0-9_]*[ \t]*=[ \t]*{_QUOTED}"
_LABELS = re.compile(rf"[ \t]*(?:{_PAIR}[ \t]*(?:,[ \t]*{_PAIR}[ \t]*)*(?:,[ \t]*)?)?")
_LABEL = re.compile(rf"([A-Za-z_][A-Za-z0-9_]*)[ \t]*=[ \t]*({_QUOTED})")
_ESCAPE = re.compile(r"\\(.)")


def _unescape(quoted: str) -> str:
    inner = quoted[1:-1]
    if "\\" not in inner:
        return inner
    return _ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), inner)


def _labels(text: str) -> dict[str, str] | None:
    """``a="1",b="x"`` (a trailing comma allowed) -> ``{"a": "1", "b": "x"}``; None when unreadable.
    Checked whole first, so the pairs found are the pairs written (none from inside a quoted value)."""
    if _LABELS.fullmatch(text) is None:
        return None
    return {name: _unescape(quoted) for name, quoted in _LABEL.findall(text)}


def parse_metrics(text: str, prefixes: tuple[str, ...] | None = None, *, strict: bool = False) -> Metrics:
    """``{sample name: [Sample(labels, value), ...]}`` from Prometheus text, keeping only the lines that
    start with one of ``prefixes`` (all when None). Unreadable lines are skipped, or with ``strict``
    raise ``PrometheusTextError`` naming the first one (lines outside ``prefixes`` are never read)."""
    out: Metrics = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line or line[0] == "#" or (prefixes is not None and not line.startswith(prefixes)):
            continue
        sample = _sample(line)
        if sample is None:
            if strict and line.strip():
                raise PrometheusTextError(f"line {number} is not a Prometheus sample: {line[:120]!r}")
            continue
        out.setdefault(sample[0], []).append(sample[1])
    return out


def _sample(line: str) -> tuple[str, Sample] | None:
    """``(name, Sample)`` of one sample line; None when it is not one."""
    m = _SAMPLE.match(line)
    if m is None:
        return None
    labels = {} if m.group(2) is None else _labels(m.group(2))
    if labels is None:
        return None
    try:
        return m.group(1), Sample(labels, float(m.group(3)))
    except ValueError:
        return None


def metric_sum(metrics: Metrics, name: str, **match: str) -> float | None:
    """Sum of the samples of ``name`` whose labels include ``match``; None when no sample has that name
    (so "no such metric" and "zero" stay distinguishable)."""
    samples = metrics.get(name)
    if samples is None:
        return None
    return sum(s.value for s in samples if all(s.labels.get(k) == want for k, want in match.items()))


def metric_by_label(metrics: Metrics, name: str, label: str) -> dict[str, float]:
    """``{value of label: summed value}`` over the other labels; samples without ``label`` are left out."""
    out: dict[str, float] = {}
    for labels, value in metrics.get(name, ()):
        key = labels.get(label)
        if key is not None:
            out[key] = out.get(key, 0.0) + value
    return out


def histogram_buckets(metrics: Metrics, name: str) -> list[tuple[float, float]]:
    """Cumulative ``(le, count)`` of histogram ``name`` (without ``_bucket``), summed over the other
    labels (routes, model names), sorted by bound; a bucket without a numeric ``le`` is left out."""
    sums: dict[float, float] = {}
    for labels, value in metrics.get(f"{name}_bucket", ()):
        try:
            le = float(labels.get("le", "nan"))
        except ValueError:
            continue
        if not math.isnan(le):
            sums[le] = sums.get(le, 0.0) + value
    return sorted(sums.items())


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile`` over cumulative ``(le, count)`` buckets (``histogram_buckets``):
    linear interpolation inside the bucket holding rank ``q*n``.

    The lowest bucket interpolates from 0; a rank in the ``+Inf`` bucket returns the highest finite
    bound (nothing better is known). None when the histogram holds no observation."""
    if not buckets or not 0.0 <= q <= 1.0:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank and count > 0:
            if math.isinf(le):
                return lower_le
            if count == lower_count:
                return le
            return lower_le + (le - lower_le) * (rank - lower_count) / (count - lower_count)
        lower_le, lower_count = (le if not math.isinf(le) else lower_le), count
    return lower_le
