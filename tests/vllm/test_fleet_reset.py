"""Fleet-wide prefix-cache invalidation (``POST /fleet/reset_prefix_cache`` on our router,
``rl-launch fleet reset-cache``): against real simulated engines, a real router, real vLLM (CPU) and a
local job; one engine that does not comply fails the call loudly."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from launcher.engines.sim import SimConfig, SimServer
from router import GenerationRouter
from router.config import RouterConfig
from tests.support.cli import RL_LAUNCH
from tests.support.http_backends import FakeEngine
from tests.support.specs import local_spec, sim, write_spec

RESET = "/fleet/reset_prefix_cache"


@pytest.fixture
async def sims() -> AsyncIterator[list[SimServer]]:
    servers = [SimServer(SimConfig(speed=50.0), api_key="engine-key", index=i) for i in range(2)]
    for s in servers:
        await s.start()
    yield servers
    for s in servers:
        await s.stop()


def router_for(urls: list[str], backend_api_key: str = "engine-key") -> GenerationRouter:
    config = RouterConfig(
        host="127.0.0.1",
        port=0,
        policy="cache_aware",
        probe_interval_s=0,
        api_key="client-key",
        admin_token="admin-token",
        backend_api_key=backend_api_key,
    )
    router = GenerationRouter(config, urls)
    router.serve_in_background()
    return router


async def _post(http: aiohttp.ClientSession, url: str, token: str | None, **kw: Any) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with http.post(url, headers=headers, **kw) as r:
        return r.status, await r.json(content_type=None)


async def test_reset_flushes_every_engine_and_the_router_index(sims: list[SimServer]) -> None:
    router = router_for([s.url for s in sims])
    try:
        async with aiohttp.ClientSession() as http:
            base = router.base_url()
            for turn in range(4):  # fill both engines' caches and the router's prefix index
                prompt = "system prompt " * 200 + f"user {turn % 2}"
                body = {"model": "sim", "prompt": prompt, "max_tokens": 2}
                status, _ = await _post(http, base + "/v1/completions", "client-key", json=body)
                assert status == 200
            assert sum(s.scheduler.pool.num_cached for s in sims) > 0
            assert (await _post(http, base + RESET, None))[0] == 401  # the admin surface is never open
            assert (await _post(http, base + RESET, "client-key"))[0] == 401  # a rollout key is not enough
            status, report = await _post(http, base + RESET, "admin-token")
        assert status == 200, report
        assert report["ok"] and len(report["engines"]) == 2 and all(e["ok"] for e in report["engines"])
        assert report["router_entries_dropped"] > 0
        assert [s.scheduler.pool.num_cached for s in sims] == [0, 0]
    finally:
        router.stop()


async def test_an_engine_without_the_route_fails_the_reset_loudly(sims: list[SimServer]) -> None:
    plain = await FakeEngine(name="no-reset", mode="status", status=404).start()  # no reset route
    router = router_for([sims[0].url, plain.url])
    try:
        async with aiohttp.ClientSession() as http:
            status, report = await _post(http, router.base_url() + RESET, "admin-token")
        assert status == 500
        bad = [e for e in report["engines"] if not e["ok"]]
        assert not report["ok"] and [e["url"] for e in bad] == [plain.url.rstrip("/")]
        assert "404" in bad[0]["detail"]
    finally:
        router.stop()
        await plain.stop()


@pytest.mark.vllm
async def test_real_vllm_prefix_cache_is_reset_through_the_router(shared_lora_engines: list[Any]) -> None:
    """On a real engine (``tests/vllm/conftest.py``'s shared engines: keyed, dev routes on; this test loads
    no adapter on them and what it flushes is a cache nobody else's check reads)."""
    from tests.support.shared_vllm import ENGINE_KEY

    engine = shared_lora_engines[0]
    router = router_for([engine.url], backend_api_key=ENGINE_KEY)
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": "tiny", "prompt": [1, 2, 3, 4] * 40, "max_tokens": 2}
            base = router.base_url()
            assert (await _post(http, base + "/v1/completions", "client-key", json=body))[0] == 200
            status, report = await _post(http, base + RESET, "admin-token")
        assert status == 200 and report["ok"], report
        assert "Reset prefix cache" in engine.log_tail(200) or report["engines"][0]["status"] == 200
    finally:
        router.stop()


@pytest.mark.ray
@pytest.mark.parametrize("kind", ["builtin", "vllm-router"])
def test_cli_resets_a_running_local_job_and_status_shows_it(tmp_path: Path, kind: str) -> None:
    """Through our router's fleet route (builtin), or straight at the job's engines behind a front that
    has none (vllm-router)."""
    spec = local_spec(
        "reset",
        root=tmp_path / "jobs",
        command=(
            'rl-launch fleet reset-cache "$RL_JOB_DIR" --json > "$RL_JOB_DIR/reset.out" && '
            'rl-launch status "$RL_JOB_DIR" --once > "$RL_JOB_DIR/status.out" 2>&1; true'
        ),
        generation=sim(2, speed=20, served_model_name=None),
        router={"kind": kind},
    )
    path = write_spec(tmp_path / "spec.yaml", spec)
    t = time.monotonic()
    proc = subprocess.run([RL_LAUNCH, "submit", str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (job,) = list((tmp_path / "jobs").iterdir())
    report = json.loads((job / "reset.out").read_text())
    assert report["ok"] and len(report["engines"]) == 2, report
    recorded = json.loads((job / "cache_reset.json").read_text())
    assert recorded["ok"] and t < time.monotonic()
    assert (
        "cache reset" in (job / "status.out").read_text()
        and "2/2 engines flushed" in (job / "status.out").read_text()
    )
