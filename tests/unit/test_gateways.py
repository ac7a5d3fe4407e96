"""The gateway interface: kinds chosen by name, and the front's own view shown beside the fleet's."""

from __future__ import annotations

import io
import socket
from pathlib import Path

import pytest
from rich.console import Console

from launcher.gateways import GATEWAY_KINDS, GatewayError, GatewayMember, GatewayView, make_gateway
from launcher.jobdir import EngineEntry, EngineListing, JobDir, StateWriter
from launcher.status import collect_snapshot, render_snapshot


def _frame(snap: dict[str, object]) -> str:
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(render_snapshot(snap))
    return console.export_text()


def _refused_urls(n: int) -> list[str]:
    """Loopback addresses nothing listens on: the dashboard's scrape of them is refused at once."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in socks]
    for s in socks:
        s.close()
    return urls


def _job_with_two_engines(tmp_path: Path, urls: list[str]) -> JobDir:
    job = JobDir(tmp_path / "demo-local-1-1").create()
    job.write_listing(
        EngineListing(
            node="gpu-0",
            node_index=0,
            engines=[EngineEntry(index=i, url=urls[i], node="gpu-0", node_index=0) for i in range(2)],
        )
    )
    return job


def test_unknown_kind_names_the_known_ones() -> None:
    with pytest.raises(GatewayError, match=r"unknown router\.kind 'nginx'; choose one of: builtin"):
        make_gateway("nginx", None)  # type: ignore[arg-type]
    assert "builtin" in GATEWAY_KINDS


def test_view_serialises_members_with_their_health() -> None:
    view = GatewayView("builtin", "http://r:1", True, (GatewayMember("http://e:2", True), GatewayMember("x")))
    assert view.to_json() == {
        "kind": "builtin",
        "base_url": "http://r:1",
        "reachable": True,
        "detail": "",
        "members": [
            {"url": "http://e:2", "healthy": True, "detail": ""},
            {"url": "x", "healthy": None, "detail": ""},
        ],
    }


def test_dashboard_shows_the_gateways_view_beside_the_fleets(tmp_path: Path) -> None:
    urls = _refused_urls(3)
    job = _job_with_two_engines(tmp_path, urls)
    engines = [{"id": f"node0-{i}", "node": "gpu-0", "url": urls[i], "state": "HEALTHY"} for i in range(2)]
    # The front routes to engine 0 and to an engine the fleet does not know; engine 1 is missing there.
    view = GatewayView(
        "vllm-router",
        "http://127.0.0.1:20001",
        True,
        (GatewayMember(urls[0], True), GatewayMember(urls[2], False)),
    )
    StateWriter(job).update(phase="training", fleet={"engines": engines}, gateway=view.to_json())
    snap = collect_snapshot(job.path, window_s=0, timeout_s=0.2)
    assert snap["gateway"] == {
        "kind": "vllm-router",
        "base_url": "http://127.0.0.1:20001",
        "reachable": True,
        "detail": "",
        "final": False,
        "members": 2,
        "healthy": 1,
        "extra": [urls[2]],
    }
    assert [e["in_gateway"] for e in snap["engines"]] == [True, False]
    for row in snap["engines"]:  # as if the engines' own /metrics answered (the note ranks below that)
        row.update(reachable=True, error=None)
    text = _frame(snap)
    assert "gateway vllm-router  routes to 2 (1 healthy by its own checks)" in text
    assert f"1 the fleet does not know: {urls[2]}" in text
    row1 = next(line for line in text.splitlines() if line.lstrip().startswith("node0-1"))
    assert "not in the gateway's view" in row1


def test_finished_job_shows_the_gateway_stopped(tmp_path: Path) -> None:
    urls = _refused_urls(2)
    job = _job_with_two_engines(tmp_path, urls)
    view = GatewayView("builtin", "http://r:1", True, (GatewayMember(urls[0], True),))
    StateWriter(job).update(
        phase="finished",
        gateway={**view.to_json(), "reachable": False, "detail": "stopped with the job", "final": True},
    )
    snap = collect_snapshot(job.path, window_s=0, timeout_s=0.2)
    assert "gateway builtin  stopped with the job" in _frame(snap)
