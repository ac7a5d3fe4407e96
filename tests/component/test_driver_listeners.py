"""The driver's own listeners (``GET /status``, the fleet endpoint beside vllm-router), which bind the node's
address and so are reachable by anyone on the cluster: a token on every route, and the router's head
deadline and connection cap (``launcher.net.listener``), against real sockets on 127.0.0.1.

The floods are bounded: 300 connections (the attacker review's figure), held for at most the head
deadline plus a few seconds.
"""

from __future__ import annotations

import json
import os
import select
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.driver.status_server import StatusServer
from launcher.gateways.fleet_endpoint import FleetEndpoint
from launcher.jobdir import JobDir, StateWriter
from launcher.net.listener import LISTENER_LIMITS
from router.http.limits import HttpLimits

FLOOD = 300


@pytest.fixture
def job(tmp_path: Path) -> JobDir:
    job = JobDir(tmp_path / "job").create()
    job.new_api_key()
    job.new_admin_token()
    state = StateWriter(job)
    state.update(phase="training", router_url="http://127.0.0.1:1")
    for i in range(3):
        state.event("training", f"e{i}")
    return job


def _get(url: str, token: str | None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _flood(url: str, n: int = FLOOD) -> list[socket.socket]:
    """``n`` connections that never complete a request: half send nothing, half a head begun."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    socks = []
    for i in range(n):
        s = socket.create_connection((host, int(port)), timeout=5)
        if i % 2:
            s.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    return socks


def _closed_by_server(socks: list[socket.socket], within_s: float) -> int:
    """How many of ``socks`` the server closed (EOF or reset) within ``within_s`` (bounded wait)."""
    pending, closed = set(socks), 0
    deadline = time.monotonic() + within_s
    while pending and time.monotonic() < deadline:
        readable, _, _ = select.select(list(pending), [], [], 0.2)
        for s in readable:
            pending.discard(s)
            try:
                closed += s.recv(1) == b""
            except OSError:
                closed += 1
    return closed


@pytest.fixture
def flood_sockets() -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    yield socks
    for s in socks:
        s.close()


def test_status_endpoint_answers_only_with_the_jobs_api_key(job: JobDir) -> None:
    server = StatusServer(job, "127.0.0.1", 0).start()
    try:
        for path in ("/status", "/events?n=2", "/elsewhere"):
            for token in (None, "wrong", job.read_admin_token()):  # the admin token is not the key
                status, body = _get(server.url + path, token)
                assert status == 401, (path, token, body)
                assert b"training" not in body
        status, body = _get(server.url + "/status", job.read_api_key())
        assert status == 200 and json.loads(body)["phase"] == "training"
        status, body = _get(server.url + "/events?n=2", job.read_api_key())
        assert status == 200 and [e["detail"] for e in json.loads(body)["events"]] == ["e1", "e2"]
    finally:
        server.stop()
    empty = JobDir(job.path.parent / "no-key").create()
    with pytest.raises(FileNotFoundError):
        StatusServer(empty, "127.0.0.1", 0)  # never served open


def test_status_endpoint_idle_flood_holds_no_thread_and_is_closed_at_the_head_deadline(
    job: JobDir, flood_sockets: list[socket.socket]
) -> None:
    server = StatusServer(job, "127.0.0.1", 0).start()
    try:
        threads, fds = threading.active_count(), _open_fds()
        flood_sockets.extend(_flood(server.url))
        time.sleep(0.5)
        extra_threads = threading.active_count() - threads
        status, _ = _get(server.url + "/status", job.read_api_key())  # served during the flood
        t0 = time.monotonic()
        closed = _closed_by_server(flood_sockets, LISTENER_LIMITS.head_timeout_s + 3)
        took = time.monotonic() - t0
        held = _open_fds() - fds - FLOOD  # the server's descriptors (the FLOOD client sockets are ours)
        print(
            f"\n/status, {FLOOD} idle connections: +{extra_threads} threads, {closed} closed by the server "
            f"{took:.1f} s later, {held} server descriptors left; a real request answered {status}"
        )
        assert extra_threads <= 2  # no thread per connection (the stdlib server had 300)
        assert status == 200
        assert closed == FLOOD and took < LISTENER_LIMITS.head_timeout_s + 2
        assert held <= 2
        assert _get(server.url + "/status", job.read_api_key())[0] == 200
    finally:
        server.stop()


def test_fleet_endpoint_idle_flood_is_closed_at_the_head_deadline(
    job: JobDir, flood_sockets: list[socket.socket]
) -> None:
    token = job.read_admin_token()
    endpoint = FleetEndpoint("127.0.0.1", 0, token, None).start()
    try:
        fds = _open_fds()
        flood_sockets.extend(_flood(endpoint.url))
        time.sleep(0.5)
        status, _ = _get(endpoint.url + "/fleet/stale", token)  # served during the flood
        t0 = time.monotonic()
        closed = _closed_by_server(flood_sockets, LISTENER_LIMITS.head_timeout_s + 3)
        took = time.monotonic() - t0
        held = _open_fds() - fds - FLOOD
        print(
            f"\nfleet endpoint, {FLOOD} idle connections: {closed} closed by the server {took:.1f} s "
            f"later, {held} server descriptors left; a real request answered {status}"
        )
        assert status == 200
        assert closed == FLOOD and took < LISTENER_LIMITS.head_timeout_s + 2
        assert held <= 2
        assert _get(endpoint.url + "/fleet/stale", token)[0] == 200
        assert _get(endpoint.url + "/fleet/stale", None)[0] == 401
    finally:
        endpoint.stop()


def test_connections_above_the_cap_are_closed_at_once(
    job: JobDir, flood_sockets: list[socket.socket]
) -> None:
    limits = HttpLimits(head_timeout_s=30.0, keepalive_timeout_s=5.0, max_client_connections=20)
    server = StatusServer(job, "127.0.0.1", 0, limits=limits).start()
    try:
        flood_sockets.extend(_flood(server.url, 60))
        assert _closed_by_server(flood_sockets, 2.0) == 40  # the 20 admitted wait for their deadline
        assert server.listener.gate is not None and server.listener.gate.open == 20
    finally:
        server.stop()
