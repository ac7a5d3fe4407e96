"""The launcher's credentials stay where they are sent (``launcher.net.http_call``): a redirect is refused,
never followed with ``Authorization``, and no proxy named in the environment sees a call. Against real servers
on 127.0.0.1 that record what reaches them (``tests/support/recording_server.py``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from launcher.fleet.client import FleetClient
from launcher.jobdir import JobDir, StateWriter
from launcher.spec.snapshot import write_spec
from tests.support.recording_server import RecordingServer

TOKEN = "admin-token-that-must-stay-home"
REPORT = json.dumps(
    {
        "op": "weight_version",
        "engines": [{"url": "http://127.0.0.1:1", "ok": True, "status": 200, "detail": "v1"}],
        "result": {"current": "v1"},
    }
)


def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """The clients are synchronous (urllib); run them off the test's loop, which serves the recorders."""
    return asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args))


async def _redirect_to_target(path: str, status: int) -> tuple[RecordingServer, RecordingServer]:
    """``(front, target)``: the front answers ``path`` with a redirect to the same path on the target
    (urllib follows a 307 for GET, and a 302 for POST as a GET, carrying ``Authorization`` either way)."""
    target = await RecordingServer({path: (200, REPORT, {"Content-Type": "application/json"})}).start()
    front = await RecordingServer({path: (status, "", {"Location": target.url + path})}).start()
    return front, target


async def test_fleet_client_refuses_a_redirect_and_the_target_never_sees_the_token() -> None:
    front, target = await _redirect_to_target("/fleet/weight_version", 307)
    try:
        client = FleetClient(front.url, TOKEN, timeout_s=5)
        with pytest.raises(RuntimeError) as info:
            await in_thread(client.weight_version)
        print(f"\nfleet client redirected: {info.value}; the target saw {target.seen}")
        assert "HTTP 307" in str(info.value) and "refused" in str(info.value)
        assert front.authorizations() == [f"Bearer {TOKEN}"]  # the fleet URL it was given, once
        assert target.seen == []
    finally:
        await front.stop()
        await target.stop()


async def test_fleet_reset_cache_refuses_a_redirect_from_the_fleet_url(tmp_path: Path) -> None:
    from launcher.cli.fleet import fleet_group
    from launcher.spec import load_resolved

    front, target = await _redirect_to_target("/fleet/reset_prefix_cache", 302)
    try:
        job = JobDir(tmp_path / "jobs" / "j1").create()
        job.new_admin_token()
        write_spec(job, load_resolved("examples/local.yaml"))  # the builtin router: through its route
        StateWriter(job).update(router_url=front.url, fleet_url=front.url, phase="training")
        result = await in_thread(
            lambda: CliRunner().invoke(fleet_group, ["reset-cache", "j1", "--root", str(tmp_path / "jobs")])
        )
        print(f"\nreset-cache redirected: exit {result.exit_code}: {result.output.strip()}")
        assert result.exit_code == 1 and "302" in result.output and "refused" in result.output
        assert front.authorizations() == [f"Bearer {job.read_admin_token()}"]
        assert target.seen == []
    finally:
        await front.stop()
        await target.stop()


async def test_no_proxy_from_the_environment_sees_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    fleet = await RecordingServer(
        {"/fleet/weight_version": (200, REPORT, {"Content-Type": "application/json"})}
    ).start()
    proxy = await RecordingServer().start()
    try:
        for name in ("no_proxy", "NO_PROXY"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("http_proxy", proxy.url)
        report = await in_thread(FleetClient(fleet.url, TOKEN, timeout_s=5).weight_version)
        assert report.ok and fleet.authorizations() == [f"Bearer {TOKEN}"]
        assert proxy.seen == []
    finally:
        await fleet.stop()
        await proxy.stop()
