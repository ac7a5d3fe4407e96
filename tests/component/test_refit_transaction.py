"""The refit transaction (``router.fleet.refit``) against simulated engines behind a real router.

The simulator loads a checkpoint directory the way vLLM 0.32 does through ``/collective_rpc
reload_weights`` (its "weights" become the directory's checksum) and is left without weights the way
vLLM's engine is when the load fails (its next generation step kills it), so what is checked here is
what a trainer meets on real engines (``tests/vllm/test_refit_vllm.py`` runs the same load on real vLLM): one
call moves every engine, a broken directory quarantines its engine and the rest serve the new version, a
trainer that dies mid-refit leaves a fleet the router resumed on its own, bad input never pauses the
fleet, and the NCCL path is refused on CPU engines before anything is sent to them.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.fleet.client import FleetClient, RefitError
from launcher.gateways.fleet_endpoint import FleetEndpoint
from router import GenerationRouter
from tests.support.checkpoints import CONFIG, checkpoint, unloadable
from tests.support.http_backends import router_factory
from tests.support.refit_calls import TOKEN, admin, chat, checksums, in_thread, send

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def router_over() -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(policy="round_robin", probe_interval_s=0, admin_token=TOKEN) as make:
        yield make


async def test_one_call_loads_a_directory_into_every_engine(sims, router_over, tmp_path: Path) -> None:
    engines = await sims(3)
    r = router_over([e.url for e in engines])
    client = FleetClient(r.base_url(), TOKEN)
    a, b = checkpoint(tmp_path, "a", b"a"), checkpoint(tmp_path, "b", b"b")
    before = checksums(engines)
    txn = await in_thread(client.load_weights, a, "step-1")
    assert txn["ok"] and txn["phase"] == "done" and sorted(txn["verified"]) == sorted(e.url for e in engines)
    assert [s["phase"] for s in txn["steps"]] == [
        "pausing",
        "canary",  # one engine loads and is verified first, then the rest
        "loading",
        "verifying",
        "resetting",
        "stamping",
        "resuming",
    ]
    after_a = checksums(engines)
    assert after_a[0] == after_a[1] == after_a[2] != before[0]
    assert all(e.rl.weight_version == "step-1" for e in engines)
    txn = await in_thread(client.load_weights, b, "step-2")
    assert txn["ok"] and txn["checksum"] != txn["previous_checksum"] and txn["previous_version"] == "step-1"
    assert checksums(engines)[0] != after_a[0]
    assert (await send(r.base_url(), chat()))[0] == 200
    versions = await in_thread(client.weight_version)
    assert versions.result["current"] == "step-2" and set(versions.result["engines"].values()) == {"step-2"}
    assert not r.gate.paused and r.backends.stale == {}
    print(f"\n[refit txn] 3 sims from a directory: {[(s['phase'], s['took_s']) for s in txn['steps']]}")


async def test_a_broken_directory_quarantines_its_engine_and_the_rest_serve_the_new_version(
    sims, router_over, tmp_path: Path
) -> None:
    engines = await sims(3)
    r = router_over([e.url for e in engines])
    client = FleetClient(r.base_url(), TOKEN)
    good, bad = checkpoint(tmp_path, "good"), unloadable(tmp_path, "bad")
    url = r.base_url()
    # Rollouts keep coming during the refit; none may fail.
    sent = [asyncio.create_task(send(url, chat(max_tokens=30, content=f"during {i}"))) for i in range(12)]
    await asyncio.sleep(0.05)
    txn = await in_thread(client.load_weights, good, "step-1", per_engine={engines[2].url: bad})
    results = await asyncio.gather(*sent)
    assert [s for s, _ in results] == [200] * 12, results
    assert txn["moved"] and not txn["ok"]
    assert sorted(txn["verified"]) == sorted(e.url for e in engines[:2])
    why = txn["quarantined"][engines[2].url]
    assert "reload from" in why and str(bad) in why and "Cannot find any model weights" in why, why
    assert engines[2].url in r.backends.stale and engines[2].url not in r.backends.serving
    assert not r.gate.paused
    after = [await send(url, chat(content=f"after {i}")) for i in range(6)]
    assert all(s == 200 for s, _ in after)
    # The fleet restores it from the directory it verified (router.fleet.restore): no trainer call.
    for _ in range(100):  # at most 5 s
        if engines[2].url in r.backends.serving:
            break
        await asyncio.sleep(0.05)
    assert engines[2].url in r.backends.serving and r.backends.stale == {}
    assert engines[2].rl.weight_version == "step-1" and checksums(engines)[2] == checksums(engines)[0]


async def test_an_engine_that_misses_the_deadline_is_quarantined(sims, router_over, tmp_path: Path) -> None:
    engines = await sims(2)
    slow = await sims(1, reload_delay_s=100.0)  # scaled by the sims' speed (20): a 5 s load
    r = router_over([e.url for e in engines + slow])
    client = FleetClient(r.base_url(), TOKEN)
    t0 = time.monotonic()
    txn = await in_thread(client.load_weights, checkpoint(tmp_path, "a"), "step-1", deadline_s=1.0)
    assert time.monotonic() - t0 < 4.0
    assert sorted(txn["verified"]) == sorted(e.url for e in engines)
    assert "deadline" in txn["quarantined"][slow[0].url], txn["quarantined"]
    assert not r.gate.paused


TRAINER = textwrap.dedent(
    """\
    import os, sys
    from launcher.fleet.client import FleetClient
    url, token, directory, when = sys.argv[1:5]
    fleet = FleetClient(url, token)
    with fleet.refit("step-9", source="directory", lease_s=1.5) as txn:
        if when == "after-load":
            txn.load_weights(directory)
        print("refit begun", flush=True)
        os.kill(os.getpid(), 9)  # the trainer dies mid-refit: no commit, no abort, no more renewals
    """
)


@pytest.mark.parametrize("when", ["after-load", "before-load"])
async def test_a_trainer_killed_mid_refit_leaves_a_fleet_the_router_resumed(
    sims, router_over, tmp_path: Path, when: str
) -> None:
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    url = r.base_url()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        TRAINER,
        url,
        TOKEN,
        str(checkpoint(tmp_path, "a")),
        when,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    killed = time.monotonic()
    assert r.gate.paused  # the trainer held the pause when it died
    held = asyncio.create_task(send(url, chat(content="sent while the dead trainer's pause stood")))
    for _ in range(200):  # at most 10 s
        if not r.gate.paused:
            break
        await asyncio.sleep(0.05)
    resumed_after = time.monotonic() - killed
    assert not r.gate.paused and resumed_after < 1.5 + 1.5, resumed_after  # within the lease (+ a tick)
    state = await in_thread(FleetClient(url, TOKEN).refit_state)
    assert state["active"] is None and state["last"]["phase"] == "expired", state
    assert "lease ran out" in state["last"]["error"]
    assert not any(e.scheduler.gen_paused for e in engines)
    status, body = await asyncio.wait_for(held, 30)
    if when == "after-load":  # every engine got weights nobody verified: none serves
        assert set(r.backends.stale) == {e.url for e in engines} and not r.backends.serving
        assert status == 409, body  # the no-healthy status, not a hang
        assert sorted(state["last"]["quarantined"]) == sorted(e.url for e in engines)
    else:  # nothing was sent to the engines: they resume on the old weights
        assert r.backends.stale == {} and status == 200, body
    print(
        f"\n[refit txn] trainer killed {when}: router resumed {resumed_after:.2f} s later; held -> {status}"
    )


async def test_bad_input_never_pauses_the_fleet(sims, router_over, tmp_path: Path) -> None:
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    url = r.base_url()
    client = FleetClient(url, TOKEN)
    assert (await in_thread(client.load_weights, checkpoint(tmp_path, "a"), "step-1"))["ok"]
    pauses = r.gate.stats().pauses_total
    other = checkpoint(tmp_path, "other", config={**CONFIG, "hidden_size": 128, "architectures": ["X"]})
    unreadable = checkpoint(tmp_path, "unreadable")
    (unreadable / "model.safetensors").unlink()
    (unreadable / "model.safetensors").symlink_to(tmp_path / "nowhere.safetensors")
    no_config = checkpoint(tmp_path, "noconfig")
    (no_config / "config.json").unlink()
    cases = {
        str(tmp_path / "missing"): "does not exist",
        str(unreadable): "not readable",
        str(no_config): "has no config.json",
        str(other): "does not match the served model",
        "relative/dir": "is relative",
    }
    for path, why in cases.items():
        status, body = await admin(url, "POST", "/fleet/refit", {"version": "step-2", "from": path})
        assert status == 400 and why in body["error"], (path, body)
    assert (
        "hidden_size: served 64, checkpoint 128"
        in (await admin(url, "POST", "/fleet/refit", {"version": "s", "from": str(other)}))[1]["error"]
    )
    for body in ({"from": str(tmp_path / "a")}, {"version": "", "from": str(tmp_path / "a")}):
        assert (await admin(url, "POST", "/fleet/refit", body))[0] == 400
    assert (await admin(url, "POST", "/fleet/refit", {"version": "v", "from": "/x", "deadline_s": 0}))[
        0
    ] == 400
    with pytest.raises(ValueError, match="does not exist"):
        await in_thread(client.load_weights, tmp_path / "missing", "step-2")
    assert r.gate.stats().pauses_total == pauses and not any(e.scheduler.gen_paused for e in engines)
    assert all(e.rl.weight_version == "step-1" for e in engines)


async def test_a_second_refit_and_plain_pauses_wait_for_the_one_running(
    sims, router_over, tmp_path: Path
) -> None:
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    url = r.base_url()
    status, txn = await admin(url, "POST", "/fleet/refit/begin", {"version": "v1", "lease_s": 5})
    assert status == 200 and txn["phase"] == "paused", txn
    for method, path, body in (
        ("POST", "/fleet/refit/begin", {"version": "v2"}),
        ("POST", "/fleet/pause?mode=keep", None),
        ("POST", "/fleet/resume", None),
        ("POST", "/fleet/weight_version", {"version": "v9"}),
    ):
        status, answer = await admin(url, method, path, body)
        assert status == 409 and txn["id"] in answer["error"], (path, answer)
    status, done = await admin(url, "POST", "/fleet/refit/commit", {"id": txn["id"]})
    assert status == 200 and done["ok"] and done["phase"] == "done", done  # external: all touched
    assert (await admin(url, "POST", "/fleet/refit/commit", {"id": txn["id"]}))[0] == 409  # ended


async def test_an_expected_checksum_decides_which_engines_are_right(
    sims, router_over, tmp_path: Path
) -> None:
    engines = await sims(3)
    r = router_over([e.url for e in engines])
    client = FleetClient(r.base_url(), TOKEN)
    a, b = checkpoint(tmp_path, "a", b"a"), checkpoint(tmp_path, "b", b"b")
    first = await in_thread(client.load_weights, a, "v1")
    right = first["checksum"]
    # Two engines read a stale node-local copy (b), one the right one: the majority is wrong, and only
    # the trainer's expected checksum can tell.
    per = {engines[0].url: b, engines[1].url: b}
    txn = await in_thread(client.load_weights, a, "v2", expected_checksum=right, per_engine=per)
    assert txn["verified"] == [engines[2].url] and sorted(txn["quarantined"]) == sorted(per)
    assert f"differs from the fleet's {right}" in txn["quarantined"][engines[0].url]
    with pytest.raises(RefitError, match="did not move"):
        await in_thread(client.load_weights, a, "v3", expected_checksum="0" * 16)


async def test_the_fleet_endpoint_beside_vllm_router_runs_the_same_transaction(sims, tmp_path: Path) -> None:
    engines = await sims(2)
    endpoint = FleetEndpoint("127.0.0.1", 0, TOKEN, None)
    await asyncio.to_thread(endpoint.start)
    try:
        await asyncio.to_thread(endpoint.serving, [e.url for e in engines])
        client = FleetClient(endpoint.url, TOKEN)
        txn = await in_thread(client.load_weights, checkpoint(tmp_path, "a"), "step-1")
        assert txn["ok"] and txn["router_holding"] is False
        assert all(e.rl.weight_version == "step-1" for e in engines)
        assert endpoint.weight_version == "step-1"
    finally:
        await asyncio.to_thread(endpoint.stop)


async def test_nccl_weight_transfer_is_refused_on_cpu_engines_before_anything_is_sent(
    sims, router_over
) -> None:
    plain = await sims(1)
    nccl = await sims(1, weight_transfer_config={"backend": "nccl"}, world_size=2)
    r = router_over([e.url for e in plain + nccl])
    url = r.base_url()
    client = FleetClient(url, TOKEN)
    with pytest.raises(RuntimeError, match="HTTP 409") as err:
        await in_thread(client.weight_transfer_plan)
    message = str(err.value)
    assert "runs on the CPU" in message and "without --weight-transfer-config" in message
    assert plain[0].url in message
    body = {"master_address": "127.0.0.1", "master_port": 29555}
    status, answer = await admin(url, "POST", "/fleet/weight_transfer/init", body)
    assert status == 409 and "NCCL weight transfer needs GPU engines" in answer["error"]
    # Nothing reached the engines: both still serve (on vLLM a failed weight-transfer call can leave an
    # engine without weights).
    assert [(await send(url, chat(content=f"still serving {i}")))[0] for i in range(4)] == [200] * 4
    status, answer = await admin(url, "POST", "/fleet/refit/begin", {"version": "v", "source": "stream"})
    assert status == 409 and "weight-transfer group" in answer["error"]
    assert not r.gate.paused


def test_the_rank_plan_gives_each_engine_its_offset() -> None:
    """The trainer is rank 0; each engine's ranks follow the ones before it, by its TP x PP size."""
    from router.fleet.refit_routes import rank_plan

    plan = rank_plan([("http://a:1", 2), ("http://b:1", 4), ("http://c:1", 1)])
    assert plan == {
        "trainer_rank": 0,
        "world_size": 8,
        "engines": [
            {"url": "http://a:1", "world_size": 2, "rank_offset": 1},
            {"url": "http://b:1", "world_size": 4, "rank_offset": 3},
            {"url": "http://c:1", "world_size": 1, "rank_offset": 7},
        ],
    }


async def test_a_gated_request_is_held_until_its_version_is_stamped(sims, router_over) -> None:
    engines = await sims(2)
    r = router_over([e.url for e in engines], pause_max_wait_s=2.0)
    url = r.base_url()
    status, first = await admin(url, "POST", "/fleet/refit/begin", {"version": "v1"})
    assert (await admin(url, "POST", "/fleet/refit/commit", {"id": first["id"]}))[0] == 200
    status, txn = await admin(url, "POST", "/fleet/refit/begin", {"version": "v2", "lease_s": 10})
    assert status == 200, txn
    gated = asyncio.create_task(send_with_headers(url, {"x-rl-weight-version": "v2"}))
    newer = asyncio.create_task(send_with_headers(url, {"x-rl-weight-version": ">=v1"}))
    t0 = time.monotonic()
    status, _, body = await send_with_headers(url, {"x-rl-weight-version": "v7"})
    assert status == 400 and time.monotonic() - t0 < 1.0, body  # unknown: at once, with what is known
    assert "'v1'" in body["error"]["message"] and "'v2'" in body["error"]["message"], body
    await asyncio.sleep(0.5)
    assert not gated.done() and not newer.done()  # held: the fleet is paused for the refit to v2
    status, done = await admin(url, "POST", "/fleet/refit/commit", {"id": txn["id"]})
    assert status == 200 and done["ok"], done
    for task in (gated, newer):
        status, headers, body = await asyncio.wait_for(task, 30)
        assert status == 200 and headers["x-rl-weight-version"] == "v2", (headers, body)
    status, _, body = await send_with_headers(url, {"x-rl-weight-version": "v1"})
    # Nobody serves v1 any more and no refit moves to it: answered at once, never held (issue 28 #4).
    assert status == 400 and "'v1' is no longer served" in body["error"]["message"], body


async def send_with_headers(url: str, headers: dict[str, str]) -> tuple[int, dict[str, str], Any]:
    import aiohttp
    import orjson

    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", json=chat(), headers=headers) as r,
    ):
        return r.status, {k.lower(): v for k, v in r.headers.items()}, orjson.loads(await r.read())


def test_status_shows_the_transaction_step_by_step() -> None:
    """``rl-launch status``'s refit line, from ``GET /fleet/refit`` (the shape ``RefitTxn.to_json`` owns)."""
    from launcher.status.refit import refit_line

    running = {
        "active": {
            "version": "step-7",
            "phase": "loading",
            "elapsed_s": 1.25,
            "lease_left_s": 900,
            "steps": [{"phase": "pausing", "took_s": 0.02, "engines": 2, "failed": {}}],
            "engines": {"http://a:1": {}, "http://b:1": {}},
            "verified": [],
            "quarantined": {"http://b:1": "did not pause: cannot connect"},
        },
        "last": None,
    }
    text = refit_line(None, None, running)
    assert text is not None
    line = text.plain
    assert "refit 'step-7' LOADING" in line and "pausing 0.02s" in line and "0/2 verified" in line
    assert "OUT http://b:1: did not pause" in line
    done = {
        "active": None,
        "last": {**running["active"], "phase": "done", "verified": ["http://a:1"], "ok": False},
    }
    assert "refit 'step-7' done" in refit_line(None, None, done).plain  # type: ignore[union-attr]


async def test_a_refit_past_its_deadline_still_resumes_every_engine(sims, router_over) -> None:
    """The deadline bounds the steps that move weights, never the resume: a transaction that ran out of
    time leaves no engine paused (before, the resume was cut by the same deadline and never sent)."""
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    url = r.base_url()
    body = {"version": "v1", "lease_s": 30, "deadline_s": 0.5}  # the lease outlives the deadline
    status, txn = await admin(url, "POST", "/fleet/refit/begin", body)
    assert status == 200 and all(e.scheduler.gen_paused for e in engines), txn
    for _ in range(100):  # at most 5 s
        if not r.gate.paused:
            break
        await asyncio.sleep(0.05)
    state = await in_thread(FleetClient(url, TOKEN).refit_state)
    assert state["last"]["phase"] == "expired" and "deadline ran out" in state["last"]["error"], state
    assert not r.gate.paused and not any(e.scheduler.gen_paused for e in engines)
