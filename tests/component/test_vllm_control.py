"""vLLM's control API on the router (``/control/*``, ``router.fleet.vllm_control``): a trainer written for one
vLLM refits the whole fleet as one transaction, over HTTP, against simulated engines behind a real router.

The calls are the ones NeMo-RL's ``remote_vllm`` backend sends to its ``control_base_url`` (preflight:
``/health``, ``/v1/models``, ``/server_info``; each refit: ``/pause?mode=<inflight_policy>&clear_cache=``,
``/collective_rpc`` ``reload_weights``, ``/reset_prefix_cache``, ``/resume``), with the job's admin token as
the Bearer, as plain HTTP.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from launcher.engines.sim.server import SimServer
from launcher.gateways.fleet_endpoint import FleetEndpoint
from router import GenerationRouter
from tests.support.checkpoints import checkpoint, unloadable
from tests.support.http_backends import router_factory
from tests.support.refit_calls import (
    TOKEN,
    chat,
    checksums,
    router_over_fixture,  # noqa: F401 (the fixture router_over)
    send,
    until,
)

AUTH = {"Authorization": f"Bearer {TOKEN}"}
HEADERS: dict[str, str | None] = {}
"""The ``x-rl-weight-version`` header of the last answer of each path (``control`` keeps them)."""


async def control(
    url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """One call to the router's control URL (``url`` + ``/control``), as a trainer's client sends it."""
    async with (
        aiohttp.ClientSession() as s,
        s.request(
            method, f"{url}/control{path}", json=body, headers=AUTH if headers is None else headers
        ) as r,
    ):
        raw = await r.read()
        HEADERS[path.split("?")[0]] = r.headers.get("x-rl-weight-version")
        try:
            return r.status, orjson.loads(raw)
        except orjson.JSONDecodeError:
            return r.status, raw.decode()


async def nemo_rl_refit(url: str, weights: Path, mode: str = "keep") -> list[tuple[str, int, Any]]:
    """NeMo-RL's refit, in its order of calls; each call's path, status and answer."""
    calls = [
        ("POST", f"/pause?mode={mode}&clear_cache=false", None),
        ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(weights)}}),
        ("POST", "/reset_prefix_cache", None),
        ("POST", "/resume", None),
    ]
    out = []
    for method, path, body in calls:
        status, answer = await control(url, method, path, body)
        out.append((path, status, answer))
        if status != 200:
            break
    return out


def engine_versions(engines: list[SimServer]) -> set[str]:
    return {e.rl.weight_version for e in engines}


def untouched(engines: list[SimServer], before: list[dict[str, str]]) -> bool:
    """Every engine on its weights and version from before, serving, not paused."""
    return (
        checksums(engines) == before
        and engine_versions(engines) == {"default"}
        and not any(e.scheduler.gen_paused for e in engines)
    )


async def test_nemo_rl_preflight_sees_one_fleet_with_control_fanout(sims, router_over) -> None:
    engines = await sims(2)
    r: GenerationRouter = router_over([e.url for e in engines])
    url = r.base_url()
    async with aiohttp.ClientSession() as s, s.get(url + "/health") as got:
        generation_health = (got.status, await got.read())
    status, health = await control(url, "GET", "/health")
    assert status == 200, health
    # NeMo-RL's check: an integer total_backends other than 1 needs "control_fanout": true.
    assert type(health["total_backends"]) is int and health["total_backends"] == 2, health
    assert health["control_fanout"] is True and health["healthy_backends"] == 2
    status, models = await control(url, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["sim"], models
    assert all("root" not in m for m in models["data"])
    status, info = await control(url, "GET", "/server_info")
    assert status == 200 and isinstance(info, dict) and info["fleet"]["total_backends"] == 2, info
    assert {e["url"] for e in info["fleet"]["engines"]} == {e.url for e in engines}
    status, paused = await control(url, "GET", "/is_paused")
    assert (status, paused["is_paused"]) == (200, False)
    # The generation URL's /health is what probes and Gym expect: open, 200, its status; it says the
    # origin fans control calls out (its root is the control URL too) but counts no backends.
    async with aiohttp.ClientSession() as s, s.get(url + "/health") as got:
        assert (got.status, await got.read()) == generation_health
    assert generation_health == (200, b'{"status":"ok","control_fanout":true}')


async def test_server_info_is_read_once_per_engine_and_shared_by_callers_that_come_together(
    sims, router_over
) -> None:
    """vLLM's first ``/server_info`` waits while it collects its environment (the simulator: 3 s here),
    and every later one answers at once. The router keeps what each engine said: two preflights at once
    share one read (the engine collects once, where two reads of its own would each collect), a later one
    is answered from what was kept, and the router sends no read of its own accord. An engine that starts
    serving again (a restart) is read afresh."""
    engines = await sims(2, env_collect_s=60.0)  # 3 s at the fixture's speed 20
    r: GenerationRouter = router_over([e.url for e in engines])
    url = r.base_url()
    await asyncio.sleep(0.5)
    assert [e.rl.server_info_reads for e in engines] == [0, 0]  # nothing read unasked
    both = await asyncio.gather(control(url, "GET", "/server_info"), control(url, "GET", "/server_info"))
    assert [status for status, _ in both] == [200, 200]
    assert all(
        isinstance(info["vllm_config"], str) and info["fleet"]["total_backends"] == 2 for _, info in both
    )
    read = [e for e in engines if e.rl.server_info_reads]
    assert len(read) == 1 and read[0].rl.server_info_reads == 1 and read[0].rl.env_collections == 1
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    status, info = await control(url, "GET", "/server_info")
    assert status == 200 and "vllm_config" in info and loop.time() - t0 < 1.0, loop.time() - t0
    status, info = await control(url, "GET", "/server_info?config_format=json")
    assert status == 200 and isinstance(info["vllm_config"], dict)
    assert read[0].rl.server_info_reads == 2  # the text answer was kept; json was read once, on the same
    assert sum(e.rl.server_info_reads for e in engines) == 2

    def restart() -> None:  # on the router's loop, as its prober ejects and readmits an engine
        r.backends.eject(read[0].url)
        r.backends.readmit(read[0].url)

    assert r._loop is not None
    r._loop.call_soon_threadsafe(restart)
    await asyncio.sleep(0.2)
    assert (await control(url, "GET", "/server_info?config_format=json"))[0] == 200
    assert sum(e.rl.server_info_reads for e in engines) == 3  # read afresh, on one engine or the other


@pytest.mark.parametrize("mode", ["keep", "wait", "abort"])
async def test_nemo_rl_refit_moves_the_fleet_as_one_transaction(
    sims, router_over, tmp_path: Path, mode: str
) -> None:
    engines = await sims(3)
    r = router_over([e.url for e in engines])
    url = r.base_url()
    weights = checkpoint(tmp_path, "step_7", b"7")
    tokens = 3000 if mode == "abort" else 60  # long enough to be in flight at the pause
    rollouts = [
        asyncio.create_task(send(url, chat(max_tokens=tokens, content=f"rollout {i}"))) for i in range(6)
    ]
    await asyncio.sleep(0.1)
    calls = await nemo_rl_refit(url, weights, mode)
    assert [(p.split("?")[0], s) for p, s, _ in calls] == [
        ("/pause", 200),
        ("/collective_rpc", 200),
        ("/reset_prefix_cache", 200),
        ("/resume", 200),
    ], calls
    pause, rpc, reset, resume = (a for _, _, a in calls)
    assert pause["status"] == "paused" and pause["weight_version"] == "control-c1"
    assert rpc["results"] == [None, None, None] and rpc["refit"]["canary"] is not None
    assert reset["success"] is True
    assert resume["status"] == "resumed" and resume["refit"]["phase"] == "done"
    # The version NeMo-RL never sent is derived (the directory's name and the transaction's number),
    # shown on every answer from the load on, stamped on every engine and kept by the router.
    assert rpc["weight_version"] == reset["weight_version"] == resume["weight_version"] == "step_7-c1"
    assert (
        HEADERS["/resume"] == HEADERS["/collective_rpc"] == "step_7-c1" and HEADERS["/pause"] == "control-c1"
    )
    assert engine_versions(engines) == {"step_7-c1"} and r.fleet.current_version == "step_7-c1"
    assert all(e.worker.model_path == str(weights) for e in engines)
    assert len({tuple(sorted(c.items())) for c in checksums(engines)}) == 1  # one checksum
    assert not r.gate.paused and not any(e.scheduler.gen_paused for e in engines)
    results = await asyncio.gather(*rollouts)
    assert [s for s, _ in results] == [200] * 6, results
    reasons = {b["choices"][0]["finish_reason"] for _, b in results}
    assert ("abort" in reasons) == (mode == "abort"), reasons  # only abort ends rollouts in flight
    status, answer = await control(url, "GET", "/weight_info")
    assert (status, answer) == (200, {"weight_version": "step_7-c1"})
    # NeMo-RL's async loop resets the cache after the resume, outside any refit: vLLM's answer.
    reset_after = await control(url, "POST", "/reset_prefix_cache")
    assert reset_after == (200, {"success": True, "weight_version": "step_7-c1"})
    assert (await send(url, chat()))[0] == 200


async def test_a_failed_canary_is_a_500_in_vllms_shape_and_the_fleet_serves_on(
    sims, router_over, tmp_path: Path
) -> None:
    engines = await sims(3)
    r = router_over([e.url for e in engines])
    url = r.base_url()
    good = checkpoint(tmp_path, "good", b"g")
    assert [s for _, s, _ in await nemo_rl_refit(url, good)] == [200] * 4
    on_good = checksums(engines)[0]
    bad = unloadable(tmp_path, "bad")  # passes the router's check, fails in the engine's loader
    calls = await nemo_rl_refit(url, bad)
    assert [s for _, s, _ in calls] == [200, 500], calls
    error = calls[1][2]["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 500, error
    assert error["type"] == "InternalServerError" and "canary" in error["message"], error
    assert "stays on 'good-c1'" in error["message"], error
    # The fleet serves on at once, on its version: the canary is held out and restored, the others were
    # never touched, nothing waits for the trainer's /resume.
    assert not r.gate.paused and r.fleet.current_version == "good-c1"
    assert await until(lambda: len(r.backends.serving) == 3), r.backends.stale
    assert all(c == on_good for c in checksums(engines)) and engine_versions(engines) == {"good-c1"}
    assert [(await send(url, chat(content=f"after {i}")))[0] for i in range(6)] == [200] * 6
    # The trainer's client raised; a /resume it sends anyway finds nothing paused (vLLM's answer).
    status, resumed = await control(url, "POST", "/resume")
    assert status == 200 and resumed["weight_version"] == "good-c1", resumed


async def test_a_refused_checkpoint_is_a_400_before_any_engine_reads_it(
    sims, router_over, tmp_path: Path
) -> None:
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    url = r.base_url()
    before = checksums(engines)
    half = checkpoint(tmp_path, "half", b"h")
    data = (half / "model.safetensors").read_bytes()
    (half / "model.safetensors").write_bytes(data[: len(data) // 2])  # cut short
    rollouts = [asyncio.create_task(send(url, chat(max_tokens=40, content=f"r {i}"))) for i in range(8)]
    await asyncio.sleep(0.05)
    calls = await nemo_rl_refit(url, half)
    assert [s for _, s, _ in calls] == [200, 400], calls
    results = await asyncio.wait_for(asyncio.gather(*rollouts), 30)
    assert [s for s, _ in results] == [200] * 8, results  # 0 failed rollouts: held, then served
    error = calls[1][2]["error"]
    assert error["code"] == 400 and error["param"] == "kwargs.weights_path" and str(half) in error["message"]
    assert untouched(engines, before) and not r.gate.paused and r.fleet.current_version is None
    # A directory every engine cannot read (relative): refused, and the fleet serves on at once too.
    assert (await control(url, "POST", "/pause?mode=keep"))[0] == 200
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": "relative/step_1"}}
    status, answer = await control(url, "POST", "/collective_rpc", rpc)
    assert status == 400 and "absolute checkpoint directory" in answer["error"]["message"], answer
    assert untouched(engines, before) and not r.gate.paused


async def test_a_trainer_gone_after_pause_is_ended_by_its_lease(sims, router_over, tmp_path: Path) -> None:
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    url = r.base_url()
    r.fleet.control.session.lease_s = 1.0
    before = checksums(engines)
    status, _ = await control(url, "POST", "/pause?mode=keep")
    assert status == 200 and r.gate.paused and all(e.scheduler.gen_paused for e in engines)
    held = asyncio.create_task(send(url, chat(content="sent while the gone trainer's pause stood")))

    async def monitor() -> None:  # a dashboard polling the reads does not keep the pause alive
        while True:
            assert (await control(url, "GET", "/is_paused"))[0] == 200
            await asyncio.sleep(0.1)

    polling = asyncio.create_task(monitor())
    assert await until(lambda: not r.gate.paused, 5.0)  # the lease ran out: the router resumed
    polling.cancel()
    assert (await asyncio.wait_for(held, 10))[0] == 200
    assert untouched(engines, before) and r.backends.stale == {}
    assert r.fleet.refit.last is not None and r.fleet.refit.last.phase == "expired"
    # A trainer that was only slow is told at its next call, in vLLM's shape.
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint(tmp_path, "late"))}}
    status, answer = await control(url, "POST", "/collective_rpc", rpc)
    assert status == 409 and "lease ran out" in answer["error"]["message"], answer
    assert untouched(engines, before)


async def test_out_of_order_calls_are_refused_with_the_reason_and_reach_no_engine(
    sims, router_over, tmp_path: Path
) -> None:
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    url = r.base_url()
    before = checksums(engines)
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint(tmp_path, "a"))}}
    status, answer = await control(url, "POST", "/collective_rpc", rpc)
    assert status == 409 and "call POST /pause first" in answer["error"]["message"], answer
    status, answer = await control(url, "POST", "/update_weight_version", {"new_version": "v9"})
    assert status == 409 and "between /pause and /resume" in answer["error"]["message"], answer
    status, answer = await control(url, "POST", "/start_weight_update")
    assert status == 409, answer
    assert untouched(engines, before)
    # A /resume with nothing paused is vLLM's no-op; it does not resume a pause someone else made.
    assert (await control(url, "POST", "/resume"))[0] == 200
    async with aiohttp.ClientSession() as s, s.post(url + "/fleet/pause?mode=keep", headers=AUTH) as got:
        assert got.status == 200
    status, answer = await control(url, "POST", "/resume")
    assert status == 409 and "POST /fleet/resume" in answer["error"], answer
    status, answer = await control(url, "POST", "/pause")
    assert status == 409 and "POST /fleet/pause" in answer["error"], answer
    async with aiohttp.ClientSession() as s, s.post(url + "/fleet/resume", headers=AUTH) as got:
        assert got.status == 200
    # A second /pause while the first one's transaction is open.
    assert (await control(url, "POST", "/pause?mode=wait"))[0] == 200
    status, answer = await control(url, "POST", "/pause?mode=wait")
    assert status == 409 and "already paused by /pause" in answer["error"], answer
    status, answer = await control(url, "POST", "/pause?mode=later")
    assert status == 400 and answer["error"]["param"] == "query.mode", answer
    status, answer = await control(url, "POST", "/resume")
    assert status == 200 and "no weights were loaded" in answer["note"], answer
    assert untouched(engines, before) and not r.gate.paused and r.fleet.current_version is None


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", "/sleep?level=1", None, 404),
        ("POST", "/wake_up", None, 404),
        ("GET", "/is_sleeping", None, 404),
        ("POST", "/collective_rpc", {"method": "reset_weights"}, 400),
        ("POST", "/collective_rpc", {"method": "rl_launch_weight_checksums"}, 400),
        ("GET", "/pause", None, 405),
    ],
)
async def test_unsupported_calls_name_what_is_supported_and_reach_no_engine(
    sims, router_over, method: str, path: str, body: Any, status: int
) -> None:
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    before = [e.stats_snapshot() for e in engines]
    got, answer = await control(r.base_url(), method, path, body)
    assert got == status, answer
    message = answer["error"]["message"]
    assert answer["error"]["code"] == status and "reload_weights" in message and "/pause" in message, message
    assert "Nothing was sent to the engines" in message or "nothing was sent to the engines" in message
    assert [e.stats_snapshot() for e in engines] == before


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/health"),
        ("GET", "/server_info"),
        ("POST", "/pause"),
        ("POST", "/resume"),
        ("POST", "/sleep"),
    ],
)
async def test_the_control_url_refuses_callers_without_the_admin_token(
    sims, router_over, method: str, path: str
) -> None:
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    for headers in ({}, {"Authorization": "Bearer not-the-token"}):
        status, answer = await control(r.base_url(), method, path, headers=headers)
        assert status == 401, (headers, answer)
    assert not r.gate.paused and not any(e.scheduler.gen_paused for e in engines)


async def prime_rl_update(url: str, weight_dir: Path, attempts: int = 3) -> list[tuple[str, int, Any]]:
    """prime-rl's ``update_weights``: pause (keep), the ``NCCL_READY`` marker, its directory
    ``/update_weights`` retried on a 5xx (never on a 4xx), ``/resume`` in a ``finally``."""
    out = [("/pause", *await control(url, "POST", "/pause?mode=keep&clear_cache=false"))]
    try:
        (weight_dir / "NCCL_READY").touch()
        for _ in range(attempts):
            body = {"weight_dir": weight_dir.as_posix()}
            status, answer = await control(url, "POST", "/update_weights", body)
            out.append(("/update_weights", status, answer))
            if status < 500:
                break
    finally:
        out.append(("/resume", *await control(url, "POST", "/resume")))
    return out


async def test_prime_rl_directory_update_weights_is_the_same_transaction(
    sims, router_over, tmp_path: Path
) -> None:
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    url = r.base_url()
    calls = await prime_rl_update(url, checkpoint(tmp_path, "step_3", b"3"))
    assert [(p, s) for p, s, _ in calls] == [("/pause", 200), ("/update_weights", 200), ("/resume", 200)]
    assert calls[1][2]["status"] == "ok" and engine_versions(engines) == {"step_3-c1"}, calls
    on_3 = checksums(engines)
    # A checkpoint the canary fails on: 500, prime-rl retries, the retry is told why (409, not retried),
    # its resume in finally finds the fleet already serving on step_3-c1.
    calls = await prime_rl_update(url, unloadable(tmp_path, "step_4"))
    assert [s for _, s, _ in calls] == [200, 500, 409, 200], calls
    assert "canary" in calls[1][2]["error"]["message"]
    retry = calls[2][2]["error"]["message"]
    assert "call POST /pause first" in retry and "failed" in retry and "stays on 'step_3-c1'" in retry, retry
    assert calls[3][2]["weight_version"] == "step_3-c1" and not r.gate.paused
    assert await until(lambda: len(r.backends.serving) == 2)
    assert checksums(engines) == on_3 and engine_versions(engines) == {"step_3-c1"}


STREAM_ROUND = {"names": ["model.layers.0.weight"], "dtype_names": ["bfloat16"], "shapes": [[64, 64]]}


async def test_trl_streamed_sequence_joins_each_engine_at_its_rank_offset(
    sims, router_over, tmp_path: Path
) -> None:
    """TRL 1.16's calls over HTTP: each engine (TP 2 here) joins the trainer's group at its own rank offset
    in the fleet's world size, and each sync is one transaction. ``rl_launch_gloo`` is the backend that
    runs on CPU engines (the simulator takes a round as broadcast: it has no wire)."""
    engines = await sims(2, weight_transfer_config={"backend": "rl_launch_gloo"}, world_size=2)
    r = router_over([e.url for e in engines])
    url = r.base_url()
    before = checksums(engines)
    assert (await control(url, "GET", "/health"))[0] == 200
    status, info = await control(url, "GET", "/server_info?config_format=json")
    assert status == 200 and info["vllm_config"]["model_config"]["dtype"] == "torch.bfloat16", info
    status, size = await control(url, "GET", "/get_world_size")
    assert (status, size["world_size"]) == (200, 4), size  # two engines of 2 ranks
    # A trainer that sized its group for one engine is refused before anything is sent.
    init = {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "packed": True}
    status, answer = await control(
        url, "POST", "/init_weight_transfer_engine", {"init_info": {**init, "world_size": 3}}
    )
    assert status == 400 and "the fleet's group is 5" in answer["error"]["message"], answer
    assert all(e.worker.transfer_group is None for e in engines)
    status, answer = await control(
        url, "POST", "/init_weight_transfer_engine", {"init_info": {**init, "world_size": 5}}
    )
    assert status == 200 and answer["message"] == "Weight transfer initialized", answer
    groups = {e.url: e.worker.transfer_group for e in engines}
    order = [e["url"] for e in answer["plan"]["engines"]]
    assert [groups[u]["rank_offset"] for u in order] == [1, 3], groups
    assert {g["world_size"] for g in groups.values()} == {5} and all(g["packed"] for g in groups.values())
    for path, body in (
        ("/pause?mode=keep", None),
        ("/start_weight_update", {"is_checkpoint_format": True}),
        ("/update_weights", {"update_info": STREAM_ROUND}),
        ("/finish_weight_update", None),
        ("/resume", None),
    ):
        status, answer = await control(url, "POST", path, body)
        assert status == 200, (path, answer)
    assert answer["refit"]["phase"] == "done" and answer["weight_version"] == "stream-c1", answer
    after = checksums(engines)
    assert after[0] == after[1] and after[0] != before[0]  # one checksum, the round's
    assert engine_versions(engines) == {"stream-c1"} and not r.gate.paused
    # Out of order: an update with no start, a finish with no start, a start with no pause.
    assert (await control(url, "POST", "/start_weight_update"))[0] == 409
    assert (await control(url, "POST", "/pause?mode=keep"))[0] == 200
    status, answer = await control(url, "POST", "/update_weights", {"update_info": STREAM_ROUND})
    assert status == 409 and "start_weight_update must be called" in answer["error"]["message"], answer
    status, answer = await control(url, "POST", "/finish_weight_update", {"weight_version": "v2"})
    assert status == 409, answer
    assert (await control(url, "POST", "/resume"))[0] == 200 and engine_versions(engines) == {"stream-c1"}
    # A directory reload on the same fleet later is tried on a canary first, transfer group or not.
    calls = await nemo_rl_refit(url, checkpoint(tmp_path, "step_9", b"9"))
    assert [s for _, s, _ in calls] == [200] * 4 and calls[1][2]["refit"]["canary"] is not None, calls
    assert engine_versions(engines) == {"step_9-c3"}


async def test_a_trainer_gone_after_its_reload_leaves_the_fleet_on_its_verified_weights(
    sims, router_over, tmp_path: Path
) -> None:
    """Killed between the load and ``/resume``: the lease ends the transaction, the engines that loaded
    unverified weights are held out and restored from the fleet's last verified directory."""
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    url = r.base_url()
    assert [s for _, s, _ in await nemo_rl_refit(url, checkpoint(tmp_path, "v1", b"1"))] == [200] * 4
    on_v1 = checksums(engines)
    r.fleet.control.session.lease_s = 1.0
    assert (await control(url, "POST", "/pause?mode=keep"))[0] == 200
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint(tmp_path, "v2", b"2"))}}
    assert (await control(url, "POST", "/collective_rpc", rpc))[0] == 200  # then the trainer is gone
    assert checksums(engines) != on_v1
    # Rollouts sent meanwhile are held by the pause. Every engine took weights nobody verified, so when
    # the lease ends them all, the held rollouts wait for the restore instead of finding no engine (they
    # were answered 409 'no healthy backend' before).
    held = [asyncio.create_task(send(url, chat(content=f"held {i}"))) for i in range(4)]
    assert await until(lambda: r.fleet.refit.last is not None and r.fleet.refit.last.phase == "expired", 5.0)
    last = r.fleet.refit.last
    assert last is not None and "lease ran out" in last.error
    assert await until(lambda: len(r.backends.serving) == 2, 10.0), r.backends.stale
    assert [(await asyncio.wait_for(h, 15))[0] for h in held] == [200] * 4
    assert await until(lambda: not r.gate.paused, 5.0)
    assert checksums(engines) == on_v1 and engine_versions(engines) == {"v1-c1"}
    assert r.fleet.current_version == "v1-c1"
    assert [(await send(url, chat(content=f"after {i}")))[0] for i in range(4)] == [200] * 4


async def test_the_control_url_through_a_router_with_worker_processes(sims, tmp_path: Path) -> None:
    """With ``workers``, the worker processes relay the control routes to the router process that holds
    the transaction (their marks: ``router.multiprocess.workers.worker_routes``)."""
    engines = await sims(2)
    with router_factory(policy="round_robin", probe_interval_s=0, admin_token=TOKEN, workers=2) as make:
        url = make([e.url for e in engines]).base_url()
        assert (await control(url, "GET", "/health"))[1]["total_backends"] == 2
        calls = await nemo_rl_refit(url, checkpoint(tmp_path, "w", b"w"), "wait")
        assert [s for _, s, _ in calls] == [200] * 4, calls
        assert engine_versions(engines) == {"w-c1"}
        status, answer = await control(url, "POST", "/sleep")
        assert status == 404 and "reload_weights" in answer["error"]["message"], answer
        assert (await control(url, "POST", "/pause", headers={}))[0] == 401


async def test_the_driver_fleet_endpoint_beside_vllm_router_serves_the_control_url(
    sims, tmp_path: Path
) -> None:
    """A job whose front is vllm-router or Ray Serve: its ``fleet_url`` is the driver's fleet endpoint,
    which registers the same ``FleetApi`` routes, ``/control`` included (the engines hold requests there)."""
    engines = await sims(2)
    endpoint = FleetEndpoint("127.0.0.1", 0, TOKEN, None)
    await asyncio.to_thread(endpoint.start)
    try:
        await asyncio.to_thread(endpoint.serving, [e.url for e in engines])
        assert (await control(endpoint.url, "GET", "/health"))[1]["total_backends"] == 2
        calls = await nemo_rl_refit(endpoint.url, checkpoint(tmp_path, "e", b"e"))
        assert [s for _, s, _ in calls] == [200] * 4, calls
        assert engine_versions(engines) == {"e-c1"} and endpoint.weight_version == "e-c1"
        assert (await control(endpoint.url, "GET", "/is_paused", headers={}))[0] == 401
    finally:
        await asyncio.to_thread(endpoint.stop)
