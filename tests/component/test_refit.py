"""The refit window through the front, against simulated engines (vLLM's RL routes, same semantics)
behind a real router on 127.0.0.1: pause/hold/resume in order, bounds, abort, weight versions and stale
engines, checksums, per-step counters, and the trainer's client. The same against real vLLM engines is
``tests/vllm/test_refit_vllm.py``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launcher.engines.sim.config import SimConfig
from launcher.engines.sim.server import SimServer
from launcher.fleet import EngineState, HealthPolicy
from launcher.fleet.client import FleetClient, FleetHttpError, FleetOpError, flatten
from launcher.fleet.controller import FleetController
from launcher.gateways.base import Gateway, GatewayView
from launcher.jobdir import EngineEntry, EngineListing, JobDir, StateWriter
from launcher.spec.snapshot import write_spec
from router import GenerationRouter
from router.config import RouterConfig
from router.consumers import add_admin_key, add_consumer
from router.fleet.engine_counters import delta, parse_counters
from router.state.pause_gate import PauseGate
from tests.support.http_backends import router_factory
from tests.support.refit_calls import CHAT, TOKEN, admin, chat, in_thread, send


@pytest.fixture
def router_over() -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(policy="round_robin", probe_interval_s=0, admin_token=TOKEN) as make:
        yield make


# -- the pause gate alone ------------------------------------------------------------------------------
async def test_gate_releases_in_arrival_order_and_bounds() -> None:
    gate = PauseGate(max_held=3, max_wait_s=5.0)
    order: list[int] = []

    async def one(i: int) -> None:
        if await gate.hold():
            order.append(i)

    gate.close("keep")
    tasks = [asyncio.create_task(one(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    assert not await gate.hold()  # a fourth is over the count bound
    assert gate.stats().held == 3
    assert gate.open() == 3
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    assert gate.stats().last_max_wait_s > 0 and gate.stats().refused_total == 1

    quick = PauseGate(max_held=10, max_wait_s=0.05)
    quick.close("keep")
    assert not await quick.hold()  # past the time bound


def test_counters_parse_and_delta_survive_restart() -> None:
    text = (
        "# TYPE vllm:prompt_tokens counter\n"
        'vllm:prompt_tokens_total{model_name="m",engine="0"} 10.0\n'
        "# TYPE vllm:request_success counter\n"
        'vllm:request_success_total{finished_reason="length",model_name="m"} 2.0\n'
        'vllm:request_success_total{finished_reason="stop",model_name="m"} 1.0\n'
        "# TYPE vllm:num_requests_running gauge\n"
        "vllm:num_requests_running 3.0\n"
    )
    c = parse_counters(text)
    assert c == {"prompt_tokens": 10.0, "finished_length": 2.0, "finished_stop": 1.0}
    d = delta(
        {"a": {"prompt_tokens": 4.0}, "b": {"prompt_tokens": 50.0}}, {"a": c, "b": {"prompt_tokens": 7.0}}
    )
    assert d["a"]["prompt_tokens"] == 6.0 and d["b"]["prompt_tokens"] == 7.0  # b restarted: from zero


# -- through the router ----------------------------------------------------------------------------------
async def test_keep_pause_holds_and_releases_in_order(sims, router_over) -> None:
    engines = await sims(2)
    r = router_over([e.url + "/v1" for e in engines])
    url = r.base_url()
    # In flight when the pause comes: frozen on the engine, completes after resume.
    inflight = asyncio.create_task(send(url, chat(max_tokens=400)))
    await asyncio.sleep(0.1)
    status, rep = await admin(url, "POST", "/fleet/pause?mode=keep")
    assert status == 200 and rep["ok"], rep
    assert all(e.scheduler.gen_paused for e in engines)
    done_order: list[int] = []

    async def held(i: int) -> None:
        st, body = await send(url, chat(content=f"held {i}"))
        assert st == 200, body
        done_order.append(i)

    holders = []
    for i in range(5):
        holders.append(asyncio.create_task(held(i)))
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)
    assert not inflight.done()
    _, paused = await admin(url, "GET", "/fleet/is_paused")
    assert paused["result"]["paused"] and paused["result"]["held"] == 5
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as m:
        fams = {f.name: f for f in text_string_to_metric_families(await m.text())}
    assert fams["rl_router_fleet_paused"].samples[0].value == 1
    assert fams["rl_router_held_requests"].samples[0].value == 5
    assert fams["rl_router_held_longest_wait_seconds"].samples[0].value > 0.2
    status, rep = await admin(url, "POST", "/fleet/resume")
    assert status == 200 and rep["result"]["released"] == 5
    assert rep["result"]["held_longest_wait_s"] > 0.2
    await asyncio.gather(*holders)
    st, body = await inflight
    assert st == 200 and body["usage"]["completion_tokens"] == 400
    assert sorted(done_order) == list(range(5))
    assert not any(e.scheduler.gen_paused for e in engines)


async def test_pause_abort_mode_ends_in_flight_requests_and_stream(sims, router_over) -> None:
    engines = await sims(1)
    r = router_over([engines[0].url])
    url = r.base_url()
    plain = asyncio.create_task(send(url, chat(max_tokens=3000)))
    body = {**chat(max_tokens=3000), "stream": True}
    async with aiohttp.ClientSession() as s, s.post(url + CHAT, json=body) as resp:
        await asyncio.sleep(0.2)
        assert (await admin(url, "POST", "/fleet/pause?mode=abort"))[0] == 200
        events = [line for line in (await resp.read()).decode().splitlines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]" and '"finish_reason":"abort"' in events[-2].replace(" ", "")
    st, answer = await plain
    assert st == 200 and answer["choices"][0]["finish_reason"] == "abort"
    assert engines[0].scheduler.gen_paused
    assert (await admin(url, "POST", "/fleet/resume"))[0] == 200


async def test_pause_bounds_answer_the_no_healthy_status(sims, router_over) -> None:
    engines = await sims(1)
    r = router_over([engines[0].url], pause_max_held=1, pause_max_wait_s=0.3)
    url = r.base_url()
    assert (await admin(url, "POST", "/fleet/pause?mode=keep"))[0] == 200
    first = asyncio.create_task(send(url, chat()))
    await asyncio.sleep(0.05)
    status, body = await send(url, chat())  # over the count bound
    assert status == 409 and body["error"]["type"] == "no_healthy_backend", body
    status, _ = await first  # over the time bound
    assert status == 409
    assert (await admin(url, "POST", "/fleet/resume"))[0] == 200
    assert (await send(url, chat()))[0] == 200


async def test_abort_reaches_client_as_engine_answered_without_retry(sims, router_over) -> None:
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    url = r.base_url()
    task = asyncio.create_task(send(url, chat(max_tokens=2000), {"X-Request-Id": "rid-7"}))
    await asyncio.sleep(0.2)
    status, rep = await admin(url, "POST", "/fleet/abort", {"request_ids": ["chatcmpl-rid-7"]})
    assert status == 200 and rep["result"]["aborted"] is None  # by id: every engine acknowledges it
    assert sorted(rep["result"]["per_engine"].values()) == [1, 1]
    st, body = await task
    # As vLLM answers it: 200, finish_reason "abort", the tokens generated so far; relayed as is.
    assert st == 200 and body["choices"][0]["finish_reason"] == "abort", body
    assert body["usage"]["completion_tokens"] < 2000
    assert sum(e.stats.aborted for e in engines) == 1  # aborted once, not retried on the other engine


async def test_weight_version_stale_engine_held_out_until_stamped(sims, router_over) -> None:
    engines = await sims(3)
    urls = [e.url for e in engines]
    r = router_over(urls[:2])
    url = r.base_url()
    status, rep = await admin(url, "POST", "/fleet/weight_version", {"version": "step-1"})
    assert status == 200 and rep["result"]["current"] == "step-1", rep
    assert all(e.rl.weight_version == "step-1" for e in engines[:2])
    # The controller pushes a set with a restarted engine (still on the checkpoint's version).
    r.set_serving_backends(urls)
    assert urls[2] not in r.serving_backends()  # held out before any check answered
    await asyncio.sleep(0.3)
    _, stale = await admin(url, "GET", "/fleet/stale")
    assert list(stale["stale"]) == [urls[2]] and "'default'" in stale["stale"][urls[2]]
    for _ in range(6):
        assert (await send(url, chat()))[0] == 200
    assert engines[2].stats.prompt_tokens == 0  # never served
    status, rep = await admin(url, "GET", "/fleet/weight_version")
    assert status == 200 and rep["result"]["engines"][urls[2]] == "default"
    status, rep = await admin(
        url, "POST", "/fleet/weight_version", {"version": "step-0", "engines": [urls[2]]}
    )
    assert status == 400  # a single engine cannot leave the fleet's version
    status, rep = await admin(
        url, "POST", "/fleet/weight_version", {"version": "step-1", "engines": [urls[2]]}
    )
    assert status == 200 and rep["result"]["stale"] == {}
    assert urls[2] in r.serving_backends()


async def test_checksums_agree_and_disagree(sims, router_over) -> None:
    same = await sims(2)
    odd = await sims(1, weights_tag="other-copy")
    r = router_over([e.url for e in same])
    url = r.base_url()
    status, rep = await admin(url, "POST", "/fleet/checksum")
    assert status == 200 and len(rep["result"]["groups"]) == 1, rep
    r.set_serving_backends([e.url for e in [*same, *odd]])
    status, rep = await admin(url, "POST", "/fleet/checksum")
    assert status == 500 and len(rep["result"]["groups"]) == 2
    assert odd[0].url in rep["error"]


async def test_step_metrics_delta_matches_tokens_sent(sims, router_over) -> None:
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    url = r.base_url()
    client = FleetClient(url, TOKEN)
    await asyncio.sleep(0)
    await in_thread(client.begin_step)
    for i in range(6):
        assert (await send(url, chat(max_tokens=5, content=f"prompt {i}")))[0] == 200
    step = await in_thread(client.step_metrics)
    assert step["fleet"]["generation_tokens"] == 30
    assert step["fleet"]["finished_length"] == 6
    assert step["fleet"]["prompt_tokens"] == sum(e.stats.prompt_tokens for e in engines)
    assert set(step["engines"]) == {e.url for e in engines}
    flat = flatten(step)
    assert flat["generation/generation_tokens"] == 30 and "generation/engine1/generation_tokens" in flat


async def test_each_consumer_has_its_own_step(sims, router_over, tmp_path: Path) -> None:
    """Two trainers on one fleet (LoRA tenants, each with its admin key): when one began its step, the
    other's step was reset mid-way (one snapshot for the fleet). Each caller now has its own; the figures
    are the engines' and so the whole fleet's."""
    consumers = tmp_path / "consumers.json"
    for name in ("tenant-a", "tenant-b"):
        add_consumer(consumers, name, f"{name}-client-key-0123456789")
        add_admin_key(consumers, name, f"{name}-admin-key-0123456789")
    engines = await sims(2)
    r = router_over([e.url for e in engines], consumers_file=str(consumers))
    url = r.base_url()
    a, b = (FleetClient(url, f"tenant-{t}-admin-key-0123456789") for t in "ab")
    owner = FleetClient(url, TOKEN)
    client = {"Authorization": "Bearer tenant-a-client-key-0123456789"}
    assert await in_thread(a.begin_step) == 1
    for i in range(3):
        assert (await send(url, chat(max_tokens=5, content=f"a {i}"), client))[0] == 200
    assert await in_thread(b.begin_step) == 1  # b's first step: a's goes on
    for i in range(2):
        assert (await send(url, chat(max_tokens=5, content=f"b {i}"), client))[0] == 200
    assert (await in_thread(a.step_metrics))["fleet"]["generation_tokens"] == 25
    assert await in_thread(a.begin_step) == 2  # a's next step: b's goes on
    step_b = await in_thread(b.step_metrics)
    assert step_b["step"] == 1 and step_b["fleet"]["generation_tokens"] == 10, step_b
    step_a = await in_thread(a.step_metrics)
    assert step_a["step"] == 2 and step_a["fleet"]["generation_tokens"] == 0, step_a
    with pytest.raises(FleetHttpError, match="no step begun"):  # the owner began none
        await in_thread(owner.step_metrics)


async def test_client_refit_cycle_and_loud_failure(sims, router_over) -> None:
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    client = FleetClient(r.base_url() + "/v1", TOKEN)

    def cycle() -> float:
        t0 = time.perf_counter()
        with client.refit("v2"):
            assert client.is_paused()
        return time.perf_counter() - t0

    took = await in_thread(cycle)
    txn = client.last_refit
    assert took < 5 and txn is not None and txn["ok"] and txn["phase"] == "done", txn
    assert [s["phase"] for s in txn["steps"]] == ["pausing", "verifying", "resetting", "stamping", "resuming"]
    assert all(e.rl.weight_version == "v2" for e in engines)
    assert (await in_thread(client.weight_version)).result["current"] == "v2"
    await engines[1].stop()  # one engine gone: every operation now fails loudly, naming it
    with pytest.raises(FleetOpError, match=engines[1].url.split("//")[1]):
        await in_thread(client.pause, "keep")
    assert r.gate.paused  # the router holds; the trainer must resume (refit() does, see below)
    rep = await in_thread(client.resume, check=False)
    assert not rep.ok and [e.ok for e in rep.engines].count(True) == 1
    with pytest.raises(RuntimeError, match="HTTP 401"):
        await in_thread(FleetClient(r.base_url(), "wrong").stale_engines)


# -- the fleet controller follows the same rule ----------------------------------------------------------
class RouterGateway(Gateway):
    """The builtin kind's contract over a real in-process router (the builtin kind itself needs Ray)."""

    kind = "builtin"
    guards_weight_version = True

    def __init__(self, router: GenerationRouter) -> None:
        self.router = router

    def start(self, engine_urls: Any) -> str:
        return self.router.base_url()

    def base_url(self) -> str:
        return self.router.base_url()

    def set_serving(self, urls: Any) -> None:
        self.router.set_serving_backends(urls)

    def weight_version(self) -> str | None:
        return self.router.current_weight_version()

    def restore_weight_version(self, version: str) -> None:
        self.router.restore_weight_version(version)

    def stale_engines(self) -> dict[str, str]:
        return self.router.stale_backends()

    identity = "1"
    """Its process identity; a test changes it to stand for a restart."""

    def instance(self) -> str | None:
        return self.identity

    def restore_pause(self) -> bool:
        return self.router.restore_pause("keep")

    def view(self) -> GatewayView:
        return GatewayView(self.kind, self.base_url(), True)

    def stop(self) -> None:
        pass


async def test_controller_keeps_restarted_engine_stale_until_stamped(sims, router_over, tmp_path) -> None:
    engines = await sims(3)
    e0, e1, replacement = (e.url for e in engines)
    job = JobDir(tmp_path / "job").create()
    job.write_listing(
        EngineListing(
            node="n0",
            node_index=0,
            engines=[EngineEntry(index=i, url=u, node="n0", node_index=0) for i, u in enumerate((e0, e1))],
        )
    )
    router = router_over([e0, e1])
    controller = FleetController(job, StateWriter(job), RouterGateway(router), 1, HealthPolicy())
    url = router.base_url()
    assert (await admin(url, "POST", "/fleet/weight_version", {"version": "v1"}))[0] == 200
    await in_thread(controller.tick)
    assert controller.last_version == "v1" and job.read_state()["fleet"]["current_version"] == "v1"
    # Engine 1 dies and comes back on the checkpoint's version (the replacement sim says "default").
    controller.fleet.mark_dead("node0-1", "process exited")
    await in_thread(controller.tick)
    assert controller.fleet.state("node0-1") is EngineState.RESTARTING
    controller.fleet.restarted("node0-1", replacement)
    for _ in range(3):
        await in_thread(controller.tick)
    assert controller.fleet.state("node0-1") is EngineState.STALE
    await asyncio.sleep(0.2)  # the router's own version check of the pushed member
    _, stale = await admin(url, "GET", "/fleet/stale")
    assert list(stale["stale"]) == [replacement] and router.serving_backends() == [e0]
    fleet_state = job.read_state()["fleet"]
    assert {e["id"]: e["state"] for e in fleet_state["engines"]}["node0-1"] == "STALE"
    # The trainer refits it and stamps it through the front: both the router and the controller agree.
    status, _ = await admin(url, "POST", "/fleet/weight_version", {"version": "v1", "engines": [replacement]})
    assert status == 200 and sorted(router.serving_backends()) == sorted([e0, replacement])
    await in_thread(controller.tick)
    assert controller.fleet.state("node0-1") is EngineState.HEALTHY
    # A router that restarted and forgot the version is re-seeded by the controller.
    router.fleet.current_version = None
    await in_thread(controller.tick)
    assert router.current_weight_version() == "v1"
    controller.stop()


async def test_controller_restores_the_pause_in_a_router_that_restarted_mid_pause(
    sims, router_over, tmp_path
) -> None:
    engines = await sims(2)
    urls = [e.url for e in engines]
    job = JobDir(tmp_path / "job").create()
    job.write_listing(
        EngineListing(
            node="n0",
            node_index=0,
            engines=[EngineEntry(index=i, url=u, node="n0", node_index=0) for i, u in enumerate(urls)],
        )
    )
    router = router_over(urls)
    gateway = RouterGateway(router)
    controller = FleetController(job, StateWriter(job), gateway, 1, HealthPolicy())
    url = router.base_url()
    await in_thread(controller.tick)  # takes the router's identity
    assert (await admin(url, "POST", "/fleet/pause?mode=keep"))[0] == 200
    # The router process restarts mid-pause: it comes back with an open gate and another identity.
    router.gate.open()
    gateway.identity = "2"
    await in_thread(controller.tick)
    assert router.gate.paused
    phases = [e["phase"] for e in job.read_events()]
    assert "router_restarted" in phases and "router_pause_restored" in phases
    held = asyncio.create_task(send(url, chat()))
    await asyncio.sleep(0.3)
    assert not held.done()  # held by the router again, not queued unbounded on the paused engines
    status, rep = await admin(url, "POST", "/fleet/resume")
    assert status == 200 and rep["result"]["released"] == 1
    assert (await asyncio.wait_for(held, 10))[0] == 200
    # A restart while nothing is paused leaves the gate open.
    gateway.identity = "3"
    await in_thread(controller.tick)
    assert not router.gate.paused
    controller.stop()


# -- rl-launch fleet ... JOB ----------------------------------------------------------------------------
async def test_fleet_cli_drives_the_window_and_refuses_other_kinds(sims, tmp_path) -> None:
    from click.testing import CliRunner

    from launcher.cli.fleet import fleet_group
    from launcher.spec import load_resolved

    engines = await sims(2)
    job = JobDir(tmp_path / "jobs" / "j1").create()
    job.new_admin_token()
    token = job.read_admin_token()
    router = GenerationRouter(
        RouterConfig(host="127.0.0.1", port=0, admin_token=token, probe_interval_s=0),
        [e.url for e in engines],
    )
    router.serve_in_background()
    try:
        write_spec(job, load_resolved("examples/local.yaml"))
        StateWriter(job).update(router_url=router.base_url(), fleet_url=router.base_url(), phase="running")
        root = ["--root", str(tmp_path / "jobs")]

        def cli(*args: str) -> Any:
            return CliRunner().invoke(fleet_group, [*args, "j1", *root], catch_exceptions=False)

        for args, expect_out in (
            (("pause", "--mode", "keep"), "fleet paused (keep)"),
            (("is-paused",), "engines paused: 2/2"),
            (("resume",), "fleet resumed"),
            (("version", "--set", "v9"), "fleet version: 'v9'"),
            (("version",), "'v9'"),
            (("checksum",), "1 checksum group(s)"),
            (("abort",), "0 request(s) aborted"),
            (("step", "--begin"), "step 1 begun"),
            (("step",), '"generation_tokens"'),
        ):
            result = await in_thread(cli, *args)
            assert result.exit_code == 0 and expect_out in result.output, (args, result.output)
        events = [e["phase"] for e in job.read_events()]
        assert {"fleet_pause", "fleet_resume", "fleet_version", "fleet_checksum"} <= set(events)
        await engines[1].stop()
        result = await in_thread(cli, "pause")
        assert result.exit_code == 1 and "did not comply" in result.output and "FAIL" in result.output
        write_spec(job, load_resolved("examples/local-dynamo.yaml"))
        StateWriter(job).update(fleet_url=None)  # a front without /fleet routes records none
        result = await in_thread(cli, "resume")
        assert result.exit_code == 1 and "router.kind 'dynamo'" in result.output
        # the refusal says what Dynamo's workers offer instead and why rl-launch does not drive it
        assert "/engine/update_weights_from_disk" in result.output and "cannot be held out" in result.output
    finally:
        router.stop()


async def test_refit_quarantines_an_engine_that_cannot_pause_and_moves_the_rest(sims, router_over) -> None:
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    client = FleetClient(r.base_url(), TOKEN)
    await engines[1].stop()

    def refit() -> dict:
        with client.refit("v3") as handle:
            assert list(handle.begun["quarantined"]) == [engines[1].url]
        assert handle.result is not None
        return handle.result

    txn = await in_thread(refit)
    assert txn["moved"] and not txn["ok"] and txn["verified"] == [engines[0].url]
    assert "did not pause" in txn["quarantined"][engines[1].url]
    assert engines[1].url in r.backends.stale and engines[0].rl.weight_version == "v3"
    assert not r.gate.paused and not engines[0].scheduler.gen_paused  # nothing left holding requests


async def test_a_body_that_raises_aborts_the_refit_and_keeps_touched_engines_out(sims, router_over) -> None:
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    client = FleetClient(r.base_url(), TOKEN)

    def failing_refit() -> None:
        with client.refit("v4"):  # source "external": the trainer's own push touched every engine
            raise RuntimeError("the trainer's NCCL push failed")

    with pytest.raises(RuntimeError, match="NCCL push failed"):
        await in_thread(failing_refit)
    assert client.last_refit is not None and client.last_refit["phase"] == "aborted"
    assert set(r.backends.stale) == {e.url for e in engines} and not r.backends.serving
    assert not any(e.scheduler.gen_paused for e in engines)
    # No engine is left serving: the requests the pause held wait for the restore (here nothing on disk
    # to restore from, so it gives up at once) before the gate opens.
    for _ in range(100):  # at most 5 s
        if not r.gate.paused:
            break
        await asyncio.sleep(0.05)
    assert not r.gate.paused and set(r.backends.stale) == {e.url for e in engines}


async def test_fleet_routes_present_the_engines_key(router_over) -> None:
    """Under the launcher engines take the clients' API key; the router's own engine calls carry it."""
    s = SimServer(SimConfig(speed=20.0), api_key="engine-key-1")
    await s.start()
    try:
        r = router_over([s.url], api_key="engine-key-1")
        status, rep = await admin(r.base_url(), "POST", "/fleet/pause?mode=keep")
        assert status == 200, rep
        assert (await admin(r.base_url(), "POST", "/fleet/resume"))[0] == 200
        assert (await admin(r.base_url(), "POST", "/fleet/reset_prefix_cache"))[0] == 200
    finally:
        await s.stop()


async def test_status_shows_pause_held_and_current_step(sims, router_over) -> None:
    from launcher.status.refit import fetch_step, pause_view, refit_line

    engines = await sims(2)
    r = router_over([e.url for e in engines])
    url = r.base_url()
    client = FleetClient(url, TOKEN)
    await in_thread(client.begin_step)
    assert (await send(url, chat(max_tokens=6)))[0] == 200
    await admin(url, "POST", "/fleet/pause?mode=keep")
    held = asyncio.create_task(send(url, chat()))
    await asyncio.sleep(0.3)
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as m:
            pause = pause_view(await m.text())
        step = await fetch_step(s, url, TOKEN, 5.0)
    assert pause is not None and pause["paused"] == 1 and pause["held"] == 1 and pause["longest_wait_s"] > 0.2
    line = refit_line(pause, step).plain
    assert "fleet PAUSED 1 held" in line and "step 1" in line and "gen 6 tok" in line, line
    await admin(url, "POST", "/fleet/resume")
    assert (await held)[0] == 200


async def test_a_stamp_no_engine_accepts_changes_nothing(sims, router_over) -> None:
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    for e in engines:
        await e.stop()  # stands for engines without dev mode: nobody can be stamped
    status, rep = await admin(r.base_url(), "POST", "/fleet/weight_version", {"version": "v1"})
    assert status == 500 and "unchanged" in rep["error"]
    assert r.current_weight_version() is None and r.fleet.backends.stale == {}
    assert sorted(r.serving_backends()) == sorted(e.url for e in engines)  # not taken down by it
    status, rep = await admin(r.base_url(), "POST", "/fleet/reset_prefix_cache")  # the shared fan-out
    assert status == 500 and not rep["ok"] and all("Error" in e["detail"] for e in rep["engines"]), rep


async def test_pause_wait_mode_returns_once_in_flight_requests_finished(sims, router_over) -> None:
    engines = await sims(1)
    r = router_over([engines[0].url])
    url = r.base_url()
    inflight = asyncio.create_task(send(url, chat(max_tokens=3000)))
    await asyncio.sleep(0.05)
    assert sum(engines[0].stats.success.values()) == 0
    status, _ = await admin(url, "POST", "/fleet/pause?mode=wait")
    # The pause answered only after the engine completed the request in flight.
    assert status == 200 and sum(engines[0].stats.success.values()) == 1
    st, body = await inflight
    assert st == 200 and body["choices"][0]["finish_reason"] == "length"
    assert (await admin(url, "POST", "/fleet/resume"))[0] == 200


# -- the driver's fleet endpoint, beside a front without /fleet routes (vllm-router) ------------------
async def test_fleet_endpoint_drives_the_engines_and_holds_stale_ones_out(sims) -> None:
    from launcher.gateways.fleet_endpoint import FleetEndpoint

    engines = await sims(3)
    e0, e1, replacement = (e.url for e in engines)
    endpoint = await in_thread(lambda: FleetEndpoint("127.0.0.1", 0, TOKEN, None).start())
    try:
        assert await in_thread(endpoint.serving, [e0, e1]) == [e0, e1]  # nothing stamped: all serve
        client = FleetClient(endpoint.url, TOKEN)
        pause = await in_thread(client.pause, "keep")
        assert pause.result == {"mode": "keep", "router_holding": False}  # the engines hold, not a gate
        assert engines[0].scheduler.gen_paused and engines[1].scheduler.gen_paused
        held = asyncio.create_task(send(e0, chat()))  # through the front, it reaches a paused engine
        await asyncio.sleep(0.3)
        assert not held.done()
        await in_thread(client.reset_prefix_cache)
        assert (await in_thread(client.set_weight_version, "v1")).result["current"] == "v1"
        await in_thread(client.resume)
        assert (await asyncio.wait_for(held, 10))[0] == 200
        assert endpoint.weight_version == "v1"
        # Engine 1 restarted on the checkpoint's version: held out of what the front may route to.
        assert await in_thread(endpoint.serving, [e0, replacement]) == [e0]
        deadline = time.monotonic() + 5
        while "weight version not verified yet" in (stale := await in_thread(client.stale_engines)).values():
            assert time.monotonic() < deadline, stale
            await asyncio.sleep(0.05)
        assert list(stale) == [replacement] and "'default'" in stale[replacement]
        assert await in_thread(endpoint.serving, [e0, replacement]) == [e0]  # still out on the next push
        await in_thread(client.set_weight_version, "v1", [replacement])
        assert await in_thread(endpoint.serving, [e0, replacement]) == [e0, replacement]
        async with aiohttp.ClientSession() as s, s.post(endpoint.url + "/fleet/pause") as r:
            assert r.status == 401  # never open: the admin token guards every route
    finally:
        await in_thread(endpoint.stop)
