"""``rl-launch status``: what the dashboard shows for a known fleet, and how it degrades.

The known fleet is real: a GenerationRouter in front of three simulated engines on 127.0.0.1, with
traffic flowing through it, plus a fourth engine the fake fleet state calls DEAD (its port refuses).
The job directory is written by hand the way the driver and the fleet controller write it.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from launcher.cli.main import main
from launcher.engines.sim import SimFleet
from launcher.jobdir import JobDir
from launcher.status.charts import sparkline
from launcher.status.collect import StatusCollector, collect_snapshot
from launcher.status.figures import lowest_bucket_bound
from router import GenerationRouter
from router.config import RouterConfig
from router.ports import free_port
from router.prometheus import (
    histogram_buckets,
    histogram_quantile,
    metric_by_label,
    metric_sum,
    parse_metrics,
)
from tests.support.status_frame import frame_text

PROMPT = "The quick brown fox jumps over the lazy dog and keeps running. " * 8  # ~130 tokens: 8 blocks


def _refused_url() -> str:
    """An address nothing listens on (bound, then released): connecting is refused at once."""
    return f"http://127.0.0.1:{free_port()}"


def _post(url: str, body: dict[str, Any]) -> int:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()
        return resp.status


class Traffic:
    """Requests through the router from a background thread, so rates over any window are non-zero."""

    def __init__(self, router_url: str) -> None:
        self.url = f"{router_url}/v1/completions"
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            _post(self.url, {"model": "sim", "prompt": PROMPT, "max_tokens": 4})
            self.sent += 1
            self._stop.wait(0.02)

    def start(self) -> Traffic:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, Any]]:
    sims = SimFleet(3, speed=50)
    urls = sims.start()
    router = GenerationRouter(RouterConfig(host="127.0.0.1", port=0, insecure_admin=True), urls)
    router_url = router.serve_in_background()
    for _ in range(9):  # warm every engine's prefix cache, so hit % is a real figure
        assert (
            _post(f"{router_url}/v1/completions", {"model": "sim", "prompt": PROMPT, "max_tokens": 4}) == 200
        )
    traffic = Traffic(router_url).start()
    try:
        yield {"urls": urls, "router_url": router_url, "dead_url": _refused_url(), "traffic": traffic}
    finally:
        traffic.stop()
        router.stop()
        sims.stop()


def write_job(
    job_dir: Path,
    state: dict[str, Any] | None,
    events: list[dict[str, Any]] = (),  # type: ignore[assignment]
    listing: list[dict[str, Any]] | None = None,
    result: dict[str, Any] | None = None,
) -> Path:
    (job_dir / "engines").mkdir(parents=True, exist_ok=True)
    JobDir(job_dir).new_api_key()  # as the driver does first: the engines' /metrics are scraped with it
    if state is not None:
        (job_dir / "state.json").write_text(json.dumps(state))
    if events:
        (job_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if listing is not None:
        (job_dir / "engines" / "node-0.urls.json").write_text(
            json.dumps({"node": "gpu-0", "engines": [{"index": i, **e} for i, e in enumerate(listing)]})
        )
    if result is not None:
        (job_dir / "result.json").write_text(json.dumps(result))
    return job_dir


@pytest.fixture
def running_job(tmp_path: Path, fleet: dict[str, Any]) -> Path:
    urls, dead = fleet["urls"], fleet["dead_url"]
    t0 = time.time() - 3723  # 1 h 02 min 03 s ago
    states = [
        ("HEALTHY", 0, ""),
        ("HEALTHY", 0, ""),
        ("SUSPECT", 0, "1 failed probe"),
        ("DEAD", 1, "3 failures"),
    ]
    fleet_state = {
        "engines": [
            {"id": i, "node": "gpu-0", "url": url, "state": st, "restarts": n, "last_reason": why}
            for i, (url, (st, n, why)) in enumerate(zip([*urls, dead], states, strict=True))
        ],
        "budget": {"per_engine": 3, "run_total": 8, "run_used": 1, "run_left": 7},
    }
    state = {
        "phase": "training",
        "detail": "training command running",
        "router_url": fleet["router_url"],
        "policy": "prefix_affinity",
        "nodes": {"training": ["cpu-0"], "generation": ["gpu-0"]},
        "updated": time.time(),
        "fleet": fleet_state,
    }
    events = [
        {"t": t0, "phase": "starting", "detail": "driver on cpu-0"},
        {"t": t0 + 5, "phase": "engines_ready", "detail": "4/4 engines ready"},
        {"t": t0 + 6, "phase": "router_serving", "detail": f"router serving {fleet['router_url']}/v1"},
        {"t": t0 + 7, "phase": "training", "detail": "training command running"},
        {"t": t0 + 60, "phase": "engine_dead", "engine": 3, "state": "DEAD", "detail": "3 failures in a row"},
        {  # the fleet controller's own shape
            "time": t0 + 61,
            "engine_id": "3",
            "node": "gpu-0",
            "url": dead,
            "from_state": "SUSPECT",
            "to_state": "DEAD",
            "reason": "3 failing ticks since HEALTHY",
            "restarts": 1,
            "level": "warning",
        },
    ]
    listing = [{"url": u, "api_url": f"{u}/v1", "node": "gpu-0"} for u in [*urls, dead]]
    return write_job(tmp_path / "demo-local-20250101-1", state, events, listing)


def _line_with(text: str, needle: str) -> str:
    lines = [line for line in text.splitlines() if needle in line and not line.startswith("!")]
    assert lines, f"no line with {needle!r} in:\n{text}"
    return lines[0]


# -- the known fleet ----------------------------------------------------------------------------------------
def test_frame_shows_the_known_fleet(running_job: Path, fleet: dict[str, Any]) -> None:
    snap = collect_snapshot(running_job, window_s=0.5)
    text = frame_text(snap)
    print(text)

    assert snap["condition"] == "running", snap["message"]
    assert snap["engine_source"] == "fleet"
    assert [e["state"] for e in snap["engines"]] == ["HEALTHY", "HEALTHY", "SUSPECT", "DEAD"]
    router = snap["router"]
    assert router["reachable"] is True
    assert router["req_per_s"] is not None and router["req_per_s"] > 0
    assert router["requests_total"] >= 9
    assert router["p50_s"] is not None and router["p99_s"] >= router["p50_s"]
    assert router["http_500"] == 0 and router["no_backend"] == 0
    assert router["serving_backends"] == 3
    assert snap["history"], "the first rate was not kept for the sparkline"

    assert "demo-local-20250101-1" in text
    assert "01:02:0" in text  # elapsed since the starting event
    assert fleet["router_url"] in text and "prefix_affinity" in text
    assert "req/s" in text and "p99" in text and "throughput" in text
    assert "1 DEAD" in text and "1 SUSPECT" in text and "2 HEALTHY" in text
    live = snap["engines"][:3]
    assert any(e["prefix_hit_pct"] for e in live), "repeated prompts must hit the prefix cache somewhere"
    for e in live:
        assert e["reachable"] is True and e["in_rotation"] is True
        assert e["kv_usage_pct"] is not None and e["running"] is not None and e["waiting"] is not None
        row = _line_with(text, e["url"])
        assert e["state"] in row
        assert f"{e['prefix_hit_pct']:.1f}%" in row
        assert f"{e['kv_usage_pct']:.1f}%" in row
        assert f"{int(e['running'])}/{int(e['waiting'])}" in row
        # sim engines at speed 50 answer far below vLLM's lowest e2e bucket (0.3 s): shown as a bound
        assert e["p50_below_s"] == 0.3 and "<300 ms" in row
    dead = snap["engines"][3]
    assert dead["reachable"] is False and dead["error"] == "cannot connect (connection refused)"
    assert dead["req_per_s"] is None  # the router never sent it anything: unknown, not 0
    assert not snap["problems"]  # a DEAD engine is expected to be silent
    dead_row = _line_with(text, fleet["dead_url"])
    assert "DEAD" in dead_row and "unreachable" in dead_row
    assert "SUSPECT" in _line_with(text, fleet["urls"][2])
    assert "1 failed probe" in text  # last_reason
    # the last events, the fleet's own included
    assert "last events" in text and "engine_dead [3]" in text and "3 failures in a row" in text
    assert "SUSPECT -> DEAD" in _line_with(text, "3 failing ticks since HEALTHY")
    assert "restarts 1/8 of the run's budget" in text


def test_engine_rates_come_from_the_router_window(running_job: Path) -> None:
    snap = collect_snapshot(running_job, window_s=0.6)
    live = snap["engines"][:3]
    assert sum(e["req_per_s"] for e in live) > 0
    for e in live:
        assert e["error_rate"] in (None, 0.0)
        assert e["in_flight"] is not None
    assert snap["engines"][3]["in_rotation"] is False  # the DEAD engine is not in the router's set


def test_json_output_parses_and_matches_the_snapshot(running_job: Path) -> None:
    result = CliRunner().invoke(main, ["status", str(running_job), "--json", "--interval", "0.3"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    snap = collect_snapshot(running_job, window_s=0.3)
    assert set(data) == set(snap)
    assert data["version"] == snap["version"]
    assert data["condition"] == snap["condition"] == "running"
    assert data["job"]["router_url"] == snap["job"]["router_url"]

    def ident(s: dict[str, Any]) -> list[tuple[Any, ...]]:
        return [
            (e["id"], e["node"], e["url"], e["state"], e["restarts"], e["reachable"]) for e in s["engines"]
        ]

    assert ident(data) == ident(snap)
    assert data["summary"] == snap["summary"] == {"HEALTHY": 2, "SUSPECT": 1, "DEAD": 1}
    assert data["router"]["req_per_s"] > 0
    assert data["events"] == snap["events"]


def test_once_prints_one_frame(running_job: Path, fleet: dict[str, Any]) -> None:
    # Piped with no COLUMNS/LINES, as a user's script has it (a value left in this process's environment
    # would size the frame for a terminal it is not drawn on).
    env = {"COLUMNS": None, "LINES": None}
    result = CliRunner().invoke(main, ["status", str(running_job), "--once", "--interval", "0.2"], env=env)
    assert result.exit_code == 0, result.output
    for url in [*fleet["urls"], fleet["dead_url"]]:
        assert url in result.output
    assert "DEAD" in result.output and "SUSPECT" in result.output


def test_no_job_argument_picks_the_newest_job(tmp_path: Path) -> None:
    old = write_job(
        tmp_path / "old-local-1-1", {"phase": "finished"}, result={"exit_code": 0, "reason": "ok"}
    )
    new = write_job(
        tmp_path / "new-local-2-2", {"phase": "failed"}, result={"exit_code": 3, "reason": "boom"}
    )
    now = time.time()

    os.utime(old, (now - 100, now - 100))
    os.utime(new, (now, now))
    result = CliRunner().invoke(main, ["status", "--json", "--root", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["job"]["name"] == "new-local-2-2"
    empty = CliRunner().invoke(main, ["status", "--root", str(tmp_path / "nothing")])
    assert empty.exit_code != 0 and "no jobs under" in empty.output


def test_listing_without_fleet_state_is_marked_unknown(tmp_path: Path, fleet: dict[str, Any]) -> None:
    urls = fleet["urls"]
    job = write_job(
        tmp_path / "plain-local-1-1",
        {"phase": "training", "router_url": fleet["router_url"], "policy": "round_robin"},
        listing=[{"url": u, "api_url": f"{u}/v1", "node": "gpu-0"} for u in urls],
    )
    snap = collect_snapshot(job, window_s=0.2)
    assert snap["engine_source"] == "listing"
    assert [e["state"] for e in snap["engines"]] == ["HEALTHY?"] * 3
    # the ids rl-launch logs --engine takes (and the fleet controller uses)
    assert [e["id"] for e in snap["engines"]] == ["node0-0", "node0-1", "node0-2"]
    text = frame_text(snap)
    assert "HEALTHY?" in _line_with(text, urls[0])
    assert "not judged" in text


def test_500s_no_backend_answers_and_error_rate(tmp_path: Path) -> None:
    """A router whose only backend refuses: the 500 counts, the engine's error rate over the interval is
    100 %; emptied, the router answers no-backend (409), counted separately."""
    dead = _refused_url()
    # No active probing: the refused backend must stay in the set long enough to be counted.
    config = RouterConfig(host="127.0.0.1", port=0, max_attempts=1, probe_interval_s=0, insecure_admin=True)
    router = GenerationRouter(config, [dead])
    url = router.serve_in_background()
    try:
        job = write_job(
            tmp_path / "demo-local-1-1",
            {
                "phase": "training",
                "router_url": url,
                "fleet": {"engines": [{"id": "0", "node": "n", "url": f"{dead}/v1", "state": "SUSPECT"}]},
            },
        )
        body = {"model": "sim", "prompt": "hi", "max_tokens": 1}

        async def frames() -> list[dict[str, Any]]:
            async with StatusCollector(job, timeout_s=0.5) as c:
                first = await c.collect()
                for _ in range(2):
                    with pytest.raises(urllib.error.HTTPError) as failed:
                        await asyncio.to_thread(_post, f"{url}/v1/completions", body)
                    assert failed.value.code == 500
                second = await c.collect()
                router.set_serving_backends([])
                with pytest.raises(urllib.error.HTTPError) as empty:
                    await asyncio.to_thread(_post, f"{url}/v1/completions", body)
                assert empty.value.code == 409
                return [first, second, await c.collect()]

        first, second, third = asyncio.run(frames())
    finally:
        router.stop()
    assert first["engines"][0]["error_rate"] is None  # no interval yet
    engine = second["engines"][0]
    assert engine["error_rate"] == 1.0 and engine["req_per_s"] > 0 and engine["in_rotation"] is True
    assert second["router"]["http_500"] == 2 and second["router"]["no_backend"] == 0
    assert third["router"]["no_backend"] == 1 and third["router"]["serving_backends"] == 0
    assert third["engines"][0]["in_rotation"] is False
    text = frame_text(second)
    assert "500s 2" in text and "100.0%" in _line_with(text, dead)
    assert "no-backend 1" in frame_text(third)


def test_fleet_fatal_reason_is_shown(tmp_path: Path) -> None:
    dead = _refused_url()
    fatal = "no engine can serve: all 1 engine(s) are RETIRED (2/2 run restarts used)"
    job = write_job(
        tmp_path / "demo-local-1-1",
        {
            "phase": "training",
            "router_url": _refused_url(),
            "fleet": {"engines": [{"id": "0", "node": "n", "url": dead, "state": "RETIRED"}], "fatal": fatal},
        },
    )
    snap = collect_snapshot(job, window_s=0.2)
    assert snap["problems"][0] == f"fleet: {fatal}"
    assert snap["fleet"]["fatal"] == fatal
    text = frame_text(snap)
    assert fatal in text and "RETIRED" in _line_with(text, dead)


# -- degraded jobs --------------------------------------------------------------------------------------
def test_queued_job_says_so(tmp_path: Path) -> None:
    job = write_job(tmp_path / "demo-4242", None)
    snap = collect_snapshot(job, window_s=0.2, slurm_state_fn=lambda job_id: "PENDING")
    assert snap["condition"] == "queued"
    assert snap["job"]["slurm_job_id"] == "4242" and snap["job"]["slurm_state"] == "PENDING"
    text = frame_text(snap)
    assert "job queued (Slurm: PENDING)" in text and "no router" in text


def test_queued_slurm_job_without_a_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from launcher.slurm import queue

    monkeypatch.setattr(queue, "describe_state", lambda job_id: "PENDING" if job_id == "777" else "?")
    result = CliRunner().invoke(main, ["status", "777", "--once", "--root", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "job queued (Slurm: PENDING)" in result.output
    unknown = CliRunner().invoke(main, ["status", "778", "--once", "--root", str(tmp_path)])
    assert unknown.exit_code != 0 and "no job '778'" in unknown.output


def test_starting_job_has_no_router_yet(tmp_path: Path) -> None:
    job = write_job(
        tmp_path / "demo-local-1-1",
        {"phase": "engines_ready", "detail": "2/4 engines ready"},
        [{"t": time.time() - 30, "phase": "starting", "detail": "driver on cpu-0"}],
    )
    snap = collect_snapshot(job, window_s=0.2)
    assert snap["condition"] == "starting"
    text = frame_text(snap)
    assert "job starting (phase engines_ready: 2/4 engines ready); no router yet" in text


def test_finished_job_shows_result_and_final_events(tmp_path: Path) -> None:
    dead = _refused_url()
    t0 = time.time() - 100
    job = write_job(
        tmp_path / "demo-local-1-1",
        {
            "phase": "failed",
            "detail": "training command exited with 1",
            "router_url": dead,
            "updated": t0 + 90,
        },
        [
            {"t": t0, "phase": "starting", "detail": "driver on cpu-0"},
            {"t": t0 + 90, "phase": "failed", "detail": "training command exited with 1", "exit_code": 1},
        ],
        listing=[{"url": dead, "node": "gpu-0"}],
        result={"exit_code": 1, "reason": "training command exited with 1", "timings": {}},
    )
    snap = collect_snapshot(job, window_s=0.5)
    assert snap["condition"] == "finished"
    assert snap["router"]["reachable"] is None  # a finished job is not scraped
    assert snap["engines"][0]["reachable"] is None
    assert snap["job"]["elapsed_s"] == pytest.approx(90, abs=1)
    text = frame_text(snap)
    assert "job failed: exit 1 (training command exited with 1)" in text
    assert "last events" in text and "failed" in _line_with(text, "training command exited with 1")
    assert "00:01:30" in text


def test_slurm_ended_job_without_result(tmp_path: Path) -> None:
    job = write_job(tmp_path / "demo-99", {"phase": "training", "router_url": _refused_url()})
    snap = collect_snapshot(job, window_s=0.2, slurm_state_fn=lambda job_id: "CANCELLED by 0")
    assert snap["condition"] == "finished"
    assert "Slurm says CANCELLED by 0; the driver wrote no result.json" in frame_text(snap)


def test_unreachable_router_is_named(tmp_path: Path) -> None:
    router = _refused_url()
    job = write_job(tmp_path / "demo-local-1-1", {"phase": "training", "router_url": router}, listing=[])
    started = time.monotonic()
    snap = collect_snapshot(job, window_s=1.0)
    assert time.monotonic() - started < 1.0, "nothing answered: no second scrape to wait for"
    assert snap["condition"] == "unreachable"
    text = frame_text(snap)
    assert f"router {router} unreachable: cannot connect" in text


def test_a_wedged_engine_costs_one_timeout_not_a_frozen_frame(tmp_path: Path, fleet: dict[str, Any]) -> None:
    """256 engines that accept connections and never answer: every scrape runs at once, each gives up
    after the timeout, and the frame comes back in about one timeout with every row marked."""
    with socket.socket() as wedged:
        wedged.bind(("127.0.0.1", 0))
        wedged.listen(1024)  # the kernel completes the handshakes; nobody ever reads
        url = f"http://127.0.0.1:{wedged.getsockname()[1]}"
        engines = [{"id": i, "node": f"n{i // 8}", "url": url, "state": "HEALTHY"} for i in range(256)]
        job = write_job(
            tmp_path / "big-local-1-1",
            {"phase": "training", "router_url": fleet["router_url"], "fleet": {"engines": engines}},
        )

        async def once() -> dict[str, Any]:
            async with StatusCollector(job, timeout_s=0.5) as c:
                return await c.collect()

        started = time.monotonic()
        snap = asyncio.run(once())
        took = time.monotonic() - started
    print(f"256 wedged engines: one frame collected in {took:.2f} s (timeout 0.5 s)")
    assert took < 3.0
    assert snap["condition"] == "running"  # the router answered
    assert all(e["reachable"] is False and "no answer within 0.5 s" in e["error"] for e in snap["engines"])
    assert "256 of 256 engine(s) that should serve did not answer /metrics" in snap["problems"][0]


# -- 256 engines on screen ----------------------------------------------------------------------------------
def synthetic_snapshot(n: int = 256) -> dict[str, Any]:
    states = ["HEALTHY"] * 10 + ["SUSPECT", "DEAD", "RESTARTING", "RECOVERING", "RETIRED"]
    engines = []
    for i in range(n):
        st = states[i % len(states)]
        engines.append(
            {
                "id": i,
                "node": f"gpu-{i // 8:03d}",
                "url": f"http://10.0.{i // 250}.{i % 250}:8000",
                "state": st,
                "restarts": i % 3,
                "last_reason": "3 failures in a row" if st == "DEAD" else "",
                "reachable": st != "DEAD",
                "error": "cannot connect (Connection refused)" if st == "DEAD" else None,
                "in_rotation": st == "HEALTHY",
                "in_flight": float(i % 17),
                "req_per_s": 3.5 + i % 5,
                "error_rate": 0.01 if st == "SUSPECT" else 0.0,
                "p50_s": 0.25 + (i % 7) / 10,
                "prefix_hit_pct": 40.0 + i % 50,
                "kv_usage_pct": 10.0 + i % 80,
                "running": float(i % 30),
                "waiting": float(i % 4),
            }
        )
    summary: dict[str, int] = {}
    for e in engines:
        summary[e["state"]] = summary.get(e["state"], 0) + 1
    return {
        "version": 1,
        "t": time.time(),
        "job": {
            "name": "big-123",
            "slurm_job_id": "123",
            "slurm_state": "RUNNING",
            "phase": "training",
            "nodes": {"generation": [f"gpu-{i:03d}" for i in range(32)], "training": ["cpu-0"]},
            "elapsed_s": 90061.0,
            "router_url": "http://10.0.0.1:9000",
            "policy": "prefix_affinity",
        },
        "condition": "running",
        "message": "",
        "problems": [],
        "result": None,
        "router": {
            "url": "http://10.0.0.1:9000",
            "reachable": True,
            "req_per_s": 1100.0,
            "in_flight": 512.0,
            "p50_s": 0.4,
            "p99_s": 3.2,
            "latency_window": "interval",
            "http_500": 3.0,
            "no_backend": 0.0,
            "serving_backends": 171.0,
        },
        "engines": engines,
        "engine_source": "fleet",
        "summary": summary,
        "history": [1000 + (i * 37) % 200 for i in range(120)],
        "events": [{"t": time.time(), "phase": "engine_dead", "engine": 11, "detail": "3 failures"}] * 8,
    }


def test_256_engines_render_quickly() -> None:
    snap = synthetic_snapshot(256)
    started = time.perf_counter()
    text = frame_text(snap)
    took = time.perf_counter() - started
    print(f"256-engine frame rendered in {took * 1000:.0f} ms ({len(text.splitlines())} lines)")
    assert took < 5.0
    assert "http://10.0.1.5:8000" in text  # engine 255
    assert "1d 01:01:01" in text
    assert text.count("DEAD") >= 256 // 15
    # A short terminal keeps the troubled engines and says how many it hid.
    short = frame_text(snap, max_rows=40)
    assert "more engine(s) not shown" in short
    rows = [line for line in short.splitlines() if ":8000" in line]
    assert len(rows) == 40
    dead = sum(e["state"] == "DEAD" for e in snap["engines"])
    assert 0 < dead < 40 and sum(" DEAD " in line for line in rows) == dead  # worst first
    assert not any(" HEALTHY " in line for line in rows)  # more troubled engines than rows


# -- the arithmetic -----------------------------------------------------------------------------------------
def test_histogram_quantile_interpolates_like_prometheus() -> None:
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (float("inf"), 40.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1 * 10 / 10)
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.04)  # first bucket from 0
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * (39.6 - 30) / 10)
    assert histogram_quantile(0.5, [(1.0, 0.0), (float("inf"), 4.0)]) == 1.0  # in +Inf: highest bound
    assert histogram_quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) is None
    assert lowest_bucket_bound(0.25, buckets) == 0.1
    assert lowest_bucket_bound(0.5, buckets) is None


def test_parse_metrics_reads_router_and_vllm_names() -> None:
    text = "\n".join(
        [
            "# HELP rl_router_requests_total Requests answered",
            'rl_router_requests_total{route="/v1/completions",status="200"} 12.0',
            'rl_router_requests_total{route="/v1/completions",status="500"} 2.0',
            'rl_router_backend_in_flight{backend="http://127.0.0.1:1"} 3.0',
            'vllm:prefix_cache_hits_total{model_name="m \\"x\\""} 75.0',
            'vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 4.0',
            "garbage line",
        ]
    )
    m = parse_metrics(text)
    assert metric_sum(m, "rl_router_requests_total") == 14
    assert metric_by_label(m, "rl_router_requests_total", "status") == {"200": 12, "500": 2}
    assert m["vllm:prefix_cache_hits_total"][0][0]["model_name"] == 'm "x"'
    assert histogram_buckets(m, "vllm:e2e_request_latency_seconds") == [(float("inf"), 4.0)]
    only = parse_metrics(text, ("vllm:",))
    assert set(only) == {"vllm:prefix_cache_hits_total", "vllm:e2e_request_latency_seconds_bucket"}


def test_sparkline() -> None:
    assert sparkline([0, 1, 2, 4]) == "▁▃▅█"
    assert sparkline([0, 0]) == "▁▁"
    assert sparkline([]) == ""
    assert len(sparkline(list(range(500)), width=60)) == 60


# -- where the dashboard's credentials go ----------------------------------------------------------------
# A front whose /metrics mimics our router's (the refit figures are read from the rl_router_ pause gauges).
MIMIC_METRICS = "\n".join(
    [
        "rl_router_fleet_paused 1",
        "rl_router_held_requests 3",
        "rl_router_pauses_total 1",
        'rl_router_requests_total{route="/v1/chat/completions",status="200"} 10',
        "",
    ]
)
ENGINE_METRICS = "vllm:num_requests_running 2\nvllm:request_success_total 5\n"


def _in_thread(fn: Any, *args: Any) -> Any:
    return asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args))


async def test_a_front_the_job_does_not_own_never_gets_a_credential(tmp_path: Path) -> None:
    """An external vllm-router's owner serves a /metrics that looks like ours: it receives no
    Authorization at all; the step comes from the job's own fleet endpoint (admin token), each engine's
    /metrics gets the job's API key, and an engine answering with a redirect is not followed."""
    from launcher.fleet.client import FleetClient
    from launcher.gateways.fleet_endpoint import FleetEndpoint
    from launcher.status.collect import acollect_snapshot
    from tests.support.recording_server import RecordingServer

    front = await RecordingServer(
        {
            "/metrics": (200, MIMIC_METRICS, {}),
            "/fleet/step": (200, json.dumps({"step": 7, "fleet": {}}), {"Content-Type": "application/json"}),
        }
    ).start()
    engines = [await RecordingServer({"/metrics": (200, ENGINE_METRICS, {})}).start() for _ in range(2)]
    target = await RecordingServer({"/metrics": (200, ENGINE_METRICS, {})}).start()
    redirect = {"/metrics": (307, "", {"Location": target.url + "/metrics"})}
    redirecting = await RecordingServer(redirect).start()
    job = JobDir(tmp_path / "ext-local-1-1").create()
    job.new_api_key()
    job.new_admin_token()
    endpoint = await _in_thread(lambda: FleetEndpoint("127.0.0.1", 0, job.read_admin_token(), None).start())
    try:
        await _in_thread(endpoint.serving, [e.url for e in engines])
        assert await _in_thread(FleetClient(endpoint.url, job.read_admin_token()).begin_step) == 1
        rows = [*engines, redirecting]
        state = {
            "phase": "training",
            "router_url": front.url,
            "fleet_url": endpoint.url,
            "fleet": {"engines": [{"id": i, "url": e.url, "state": "HEALTHY"} for i, e in enumerate(rows)]},
        }
        write_job(job.path, state)
        snap = await acollect_snapshot(StatusCollector(job.path, timeout_s=2.0), 0.0)
    finally:
        await _in_thread(endpoint.stop)
        for server in (front, *engines, target, redirecting):
            await server.stop()
    key = f"Bearer {job.read_api_key()}"
    print(f"\nforeign front saw {front.seen}; engine 0 saw {engines[0].seen}; redirect target {target.seen}")
    assert front.authorizations() == []
    assert all(e.authorizations() == [key] for e in engines)  # the collector's scrape (the fleet's: none)
    assert redirecting.authorizations() == [key] and target.seen == []
    assert snap["engines"][2]["error"] == "HTTP 307 from /metrics"
    assert snap["refit"]["pause"] is None  # no pause figures from it
    assert snap["refit"]["transaction"]["active"] is None  # the job's own fleet endpoint's answer
    assert snap["refit"]["step"]["step"] == 1  # the job's own fleet endpoint's, not the front's 7


async def test_dashboard_works_when_the_api_key_is_unreadable(tmp_path: Path) -> None:
    from launcher.status.collect import acollect_snapshot
    from tests.support.recording_server import RecordingServer

    engine = await RecordingServer({"/metrics": (200, ENGINE_METRICS, {})}).start()
    router = await RecordingServer({"/metrics": (200, MIMIC_METRICS, {})}).start()
    try:
        state = {
            "phase": "training",
            "router_url": router.url,
            "fleet": {"engines": [{"id": 0, "url": engine.url, "state": "HEALTHY"}]},
        }
        job = write_job(tmp_path / "nokey-local-1-1", state)
        key_file = JobDir(job).api_key_file
        key_file.unlink()
        key_file.mkdir()  # unreadable as a file, whoever runs the test (root reads any mode)
        snap = await acollect_snapshot(StatusCollector(job, timeout_s=2.0), 0.0)
    finally:
        await engine.stop()
        await router.stop()
    assert snap["condition"] == "running"
    assert snap["engines"][0]["reachable"] is True and snap["engines"][0]["running"] == 2
    assert engine.authorizations() == []
    assert any("API key is unreadable" in p for p in snap["problems"]), snap["problems"]
    assert "API key is unreadable" in frame_text(snap)
