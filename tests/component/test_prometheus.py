"""The project's one Prometheus text reader (``router.prometheus``), checked against ``prometheus_client``'s
own parser on what the real emitters write: the simulator's and the router's ``/metrics`` over HTTP, and
a registry whose label values hold every character the format escapes or that a naive reader trips on.
(Real vLLM's ``/metrics`` is checked the same way in ``tests/vllm/test_refit_vllm.py``.)"""

from __future__ import annotations

import math

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, generate_latest

from router import GenerationRouter
from router.fleet.engine_counters import parse_counters
from router.prometheus import (
    PrometheusTextError,
    Sample,
    histogram_buckets,
    metric_by_label,
    metric_sum,
    parse_metrics,
)
from tests.support.http_backends import router_factory
from tests.support.prometheus_readers import ours, reference


def test_reads_every_sample_prometheus_client_writes_with_awkward_labels() -> None:
    registry = CollectorRegistry()
    awkward = [
        'quote " inside',
        "back\\slash and \\n literally",
        "new\nline",
        "brace } and { and , comma",
        "hash # not an exemplar",
        "equals = sign",
        "  spaces  ",
        "unicode: é 模型",
        "",
    ]
    c = Counter("vllm:request_success", "requests", ["finished_reason", "model_name"], registry=registry)
    g = Gauge("vllm:num_requests_running", "running", ["model_name"], registry=registry)
    h = Histogram("vllm:e2e_request_latency_seconds", "e2e", ["model_name"], registry=registry)
    s = Summary("rl_x_seconds", "summary", registry=registry)
    for i, value in enumerate(awkward):
        c.labels("stop", value).inc(i + 1)
        g.labels(value).set(float("inf") if i % 2 else -0.5)
        h.labels(value).observe(0.1 * i)
    g.labels("not a number").set(float("nan"))
    s.observe(1e6)
    text = generate_latest(registry).decode()
    assert ours(text) == reference(text) and len(ours(text)) > 100
    m = parse_metrics(text)
    assert metric_by_label(m, "vllm:request_success_total", "model_name") == {
        v: float(i + 1) for i, v in enumerate(awkward)
    }
    assert math.isnan(metric_sum(m, "vllm:num_requests_running", model_name="not a number") or 0.0)


async def test_reads_the_simulator_and_the_router_as_prometheus_client_does(sims) -> None:
    engines = await sims(2)
    with router_factory(policy="round_robin", probe_interval_s=0) as make:
        r: GenerationRouter = make([e.url + "/v1" for e in engines])
        chat = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with aiohttp.ClientSession() as http:
            for _ in range(4):
                async with http.post(r.base_url() + "/v1/chat/completions", json=chat) as resp:
                    assert resp.status == 200, await resp.text()
            texts = {}
            for name, url in [("router", r.base_url()), *((f"sim{i}", e.url) for i, e in enumerate(engines))]:
                async with http.get(url + "/metrics") as resp:
                    texts[name] = await resp.text()
    for name, text in texts.items():
        assert ours(text) == reference(text), name
    router = parse_metrics(texts["router"], ("rl_router_",))
    assert metric_by_label(router, "rl_router_requests_total", "status") == {"200": 4.0}
    assert histogram_buckets(router, "rl_router_request_duration_seconds")[-1] == (math.inf, 4.0)
    per_engine = [parse_counters(texts[f"sim{i}"]) for i in range(2)]
    assert sum(c["finished_length"] for c in per_engine) == 4  # max_tokens reached on every request
    assert sum(c["generation_tokens"] for c in per_engine) == 16


def test_the_format_s_corners() -> None:
    text = "\n".join(
        [
            "# HELP a_total with a } brace",
            "# TYPE a_total counter",
            'a_total{x="1",} 1',  # trailing comma
            'a_total{ x = "2" , y="z" } 2 1700000000000',  # blanks around labels, a timestamp
            'a_total{x="3"}3',  # no blank between the labels and the value
            'b{x="q"} 4 # {trace_id="abc"} 9.0 1.5',  # an OpenMetrics exemplar is not the value
            'c{v="a\\\\nb"} 5',  # an escaped backslash then n: not a newline
            'c{v="a\\nb"} 6',  # \n: a newline
            "d +Inf",
            "d\t-Inf",
            "e 1e+06",
            "# EOF",
        ]
    )
    m = parse_metrics(text, strict=True)
    assert m["a_total"] == [
        Sample({"x": "1"}, 1.0),
        Sample({"x": "2", "y": "z"}, 2.0),
        Sample({"x": "3"}, 3.0),
    ]
    assert m["b"] == [Sample({"x": "q"}, 4.0)]
    assert [s.labels["v"] for s in m["c"]] == ["a\\nb", "a\nb"]
    assert [s.value for s in m["d"]] == [math.inf, -math.inf] and m["e"][0].value == 1e6
    assert set(m) == {"a_total", "b", "c", "d", "e"}
    assert ours(text) == reference(text)


@pytest.mark.parametrize(
    "line",
    [
        "garbage line",
        "<html><body>502 Bad Gateway</body></html>",
        'x{a="unterminated} 1',
        "x{a=unquoted} 1",
        "x1",
        "x not-a-number",
        '{"quoted.name"} 1',
    ],
)
def test_an_unreadable_line_is_skipped_or_named(line: str) -> None:
    text = f"good 1\n{line}\nalso_good 2\n"
    assert parse_metrics(text) == {"good": [Sample({}, 1.0)], "also_good": [Sample({}, 2.0)]}
    with pytest.raises(PrometheusTextError, match=r"line 2 is not a Prometheus sample"):
        parse_metrics(text, strict=True)
    assert isinstance(PrometheusTextError("x"), ValueError)
    # The engines' counters keep their contract: an answer that is not Prometheus text is an error.
    with pytest.raises(ValueError, match="line 2"):
        parse_counters(text)


def test_prefixes_select_lines_before_reading_them() -> None:
    text = 'vllm:a_total{m="x"} 1\nrl_router_b 2\nnot prometheus at all\nvllm:c 3\n'
    only = parse_metrics(text, ("vllm:",), strict=True)  # the unreadable line is outside the prefixes
    assert set(only) == {"vllm:a_total", "vllm:c"}
    assert set(parse_metrics(text)) == {"vllm:a_total", "rl_router_b", "vllm:c"}


def test_sums_labels_and_buckets() -> None:
    m = parse_metrics(
        "\n".join(
            [
                'req_total{route="/a",status="200"} 12',
                'req_total{route="/b",status="200"} 3',
                'req_total{route="/a",status="500"} 2',
                "zero_total 0",
                'lat_bucket{le="0.5",route="/a"} 1',
                'lat_bucket{le="+Inf",route="/a"} 4',
                'lat_bucket{le="0.5",route="/b"} 2',
                'lat_bucket{le="+Inf",route="/b"} 2',
                'lat_bucket{le="nope"} 7',
                "lat_bucket 9",
            ]
        )
    )
    assert metric_sum(m, "req_total") == 17
    assert metric_sum(m, "req_total", status="200") == 15
    assert metric_sum(m, "req_total", status="200", route="/a") == 12
    assert metric_sum(m, "req_total", status="404") == 0
    assert metric_sum(m, "zero_total") == 0 and metric_sum(m, "absent_total") is None
    assert metric_by_label(m, "req_total", "status") == {"200": 15, "500": 2}
    assert metric_by_label(m, "zero_total", "status") == {} and metric_by_label(m, "absent", "x") == {}
    assert histogram_buckets(m, "lat") == [(0.5, 3.0), (math.inf, 6.0)]
    assert histogram_buckets(m, "absent") == []
