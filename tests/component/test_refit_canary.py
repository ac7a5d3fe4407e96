"""A refit never costs more than one engine: the canary (``router.fleet.refit``) and the fleet restoring
engines without its weights by itself (``router.fleet.restore``), on simulated engines behind a real
router.

The simulator loads a checkpoint directory as vLLM 0.32 does and is left without weights when the load
fails (its checksum read fails, its next generation step kills its engine core), so what is checked
here is what a fleet meets on real engines (``tests/vllm/test_refit_vllm.py`` runs the same on real vLLM).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

import router.fleet.restore as restore
from launcher.engines.sim.server import SimServer
from launcher.engines.sim.worker import WorkerError
from launcher.fleet import EngineState
from launcher.fleet.client import FleetClient, RefitError
from router import GenerationRouter
from tests.support.checkpoints import checkpoint, unloadable
from tests.support.fleet_health import front_tick, make
from tests.support.refit_calls import (
    TOKEN,
    admin,
    chat,
    checksums,
    in_thread,
    router_over_fixture,  # noqa: F401 (the fixture router_over)
    send,
    until,
)

STREAM_REQUESTS = 40
"""Requests sent while a refit runs and after it (a bounded stream: one every 25 ms)."""


async def stream(url: str, n: int = STREAM_REQUESTS) -> list[tuple[int, Any]]:
    """``n`` requests, one every 25 ms, all in flight together: the rollouts that keep coming."""

    async def one(i: int) -> tuple[int, Any]:
        await asyncio.sleep(0.025 * i)
        return await send(url, chat(max_tokens=20, content=f"rollout {i}"))

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def served_by(engine: SimServer) -> int:
    """Tokens the engine generated so far (its own counter)."""
    return int(engine.stats.generation_tokens)


async def test_a_checkpoint_that_fails_in_the_loader_costs_one_engine_and_the_fleet_restores_it(
    sims, router_over, tmp_path: Path
) -> None:
    engines = await sims(3)
    r: GenerationRouter = router_over([e.url for e in engines])
    url = r.base_url()
    client = FleetClient(url, TOKEN)
    good = checkpoint(tmp_path, "good", b"g")
    first = await in_thread(client.load_weights, good, "step-1")
    assert first["ok"] and first["canary"] in first["verified"], first
    on_good = checksums(engines)[0]
    bad = unloadable(tmp_path, "bad")  # passes the router's check, fails in the engine's loader
    rollouts = asyncio.create_task(stream(url))
    await asyncio.sleep(0.1)
    with pytest.raises(RefitError, match="did not move") as err:
        await in_thread(client.load_weights, bad, "step-2")
    txn = err.value.txn
    canary = txn["canary"]
    others = [e for e in engines if e.url != canary]
    assert txn["phase"] == "failed" and not txn["moved"], txn
    assert list(txn["quarantined"]) == [canary], txn["quarantined"]
    why = txn["quarantined"][canary]
    assert why.startswith("canary: reload from") and str(bad) in why and "Cannot find any model" in why
    assert [s["phase"] for s in txn["steps"]] == ["pausing", "canary", "resuming", "resuming"], txn["steps"]
    assert {u: e["state"] for u, e in txn["engines"].items() if u != canary} == {
        e.url: "pending" for e in others
    }
    # The others were never touched: still the good weights, version and path, serving.
    assert all(e.rl.checksums() == on_good and e.rl.weight_version == "step-1" for e in others)
    assert all(e.worker.model_path == str(good) for e in others)
    assert all(e.url in r.backends.serving for e in others) and not r.gate.paused
    assert (await in_thread(client.weight_version)).result["current"] == "step-1"
    # The canary is restored from the directory the fleet verified, without a trainer call.
    assert await until(lambda: canary in r.backends.serving and not r.backends.stale), r.backends.stale
    restored = next(e for e in engines if e.url == canary)
    assert restored.rl.checksums() == on_good and restored.rl.weight_version == "step-1"
    assert r.fleet.refit.last is not None and r.fleet.refit.last.id == txn["id"]  # no refit since
    results = await asyncio.wait_for(rollouts, 60)
    assert [s for s, _ in results] == [200] * STREAM_REQUESTS, [s for s, _ in results]
    before = served_by(restored)
    after = [await send(url, chat(content=f"after {i}")) for i in range(6)]
    assert [s for s, _ in after] == [200] * 6 and served_by(restored) > before
    aborted = sum(b["choices"][0]["finish_reason"] == "abort" for _, b in results)
    print(
        f"\n[refit canary] canary {canary} quarantined ({why[:90]}...), restored to step-1;"
        f" {STREAM_REQUESTS} rollouts: {len(results)} answered 200 ({aborted} aborted on the canary)"
    )


async def test_a_canary_whose_checksum_is_not_the_expected_one_holds_the_fleet_back(
    sims, router_over, tmp_path: Path
) -> None:
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    client = FleetClient(r.base_url(), TOKEN)
    first = await in_thread(client.load_weights, checkpoint(tmp_path, "a", b"a"), "v1")
    other = checkpoint(tmp_path, "b", b"b")  # loads fine, but is not what the trainer saved
    with pytest.raises(RefitError) as err:
        await in_thread(client.load_weights, other, "v2", expected_checksum=first["checksum"])
    txn = err.value.txn
    assert f"differs from the expected {first['checksum']}" in txn["quarantined"][txn["canary"]]
    assert sum(e.worker.model_path == str(other) for e in engines) == 1  # the canary alone loaded it
    assert await until(lambda: len(r.backends.serving) == 2)  # restored from a
    assert checksums(engines)[0] == checksums(engines)[1] and {e.rl.weight_version for e in engines} == {"v1"}


async def test_a_restarted_engine_is_restored_and_readmitted(sims, router_over, tmp_path: Path) -> None:
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    client = FleetClient(r.base_url(), TOKEN)
    a = checkpoint(tmp_path, "a", b"a")
    assert (await in_thread(client.load_weights, a, "step-1"))["ok"]
    # Engine 1 restarts: a new process on a new port, on the weights and version it started with.
    replacement = (await sims(1))[0]
    assert replacement.rl.weight_version == "default" and replacement.rl.checksums() != checksums(engines)[0]
    await engines[1].stop()
    r.set_serving_backends([engines[0].url, replacement.url])  # what the fleet controller pushes
    assert await until(lambda: replacement.url in r.backends.serving), r.backends.stale
    assert replacement.rl.weight_version == "step-1" and replacement.rl.checksums() == checksums(engines)[0]
    assert [(await send(r.base_url(), chat(content=f"r {i}")))[0] for i in range(4)] == [200] * 4
    assert served_by(replacement) > 0


async def test_streamed_or_external_weights_are_not_restored(sims, router_over, tmp_path: Path) -> None:
    """The weights came by the trainer's means: no directory holds them, so a joining engine stays STALE
    (as before) and says why; a directory refit afterwards makes the fleet restore again."""
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    url = r.base_url()
    client = FleetClient(url, TOKEN)
    assert (await in_thread(client.load_weights, checkpoint(tmp_path, "a"), "v1"))["ok"]
    status, txn = await admin(url, "POST", "/fleet/refit/begin", {"version": "v2", "source": "external"})
    assert status == 200
    assert (await admin(url, "POST", "/fleet/refit/commit", {"id": txn["id"]}))[0] == 200
    joining = (await sims(1))[0]
    r.set_serving_backends([e.url for e in engines] + [joining.url])
    assert await until(lambda: "not restored" in r.backends.stale.get(joining.url, ""))
    assert "by stream or by the trainer's own means" in r.backends.stale[joining.url]
    assert joining.rl.weight_version == "default"
    assert (await in_thread(client.load_weights, checkpoint(tmp_path, "b", b"b"), "v3"))["ok"]
    assert not r.backends.stale and {e.rl.weight_version for e in [*engines, joining]} == {"v3"}


async def test_a_restore_from_a_directory_gone_leaves_the_engine_stale_with_the_reason(
    sims, router_over, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(restore, "BACKOFF_S", 0.05)
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    client = FleetClient(r.base_url(), TOKEN)
    a = checkpoint(tmp_path, "a")
    assert (await in_thread(client.load_weights, a, "v1"))["ok"]
    shutil.rmtree(a)  # the trainer cleaned up its old checkpoints
    joining = (await sims(1))[0]
    r.set_serving_backends([e.url for e in engines] + [joining.url])

    def given_up() -> bool:
        return not r.fleet.restorer.pending() and "restore from" in r.backends.stale.get(joining.url, "")

    assert await until(given_up)
    why = r.backends.stale[joining.url]
    assert why.startswith(f"restore from {a} failed:") and "does not exist" in why, why
    assert not restore.needs_restart(why)  # the engine's weights are whole: nothing to restart
    assert joining.rl.weight_version == "default" and r.fleet.restorer.failed_total == 1


async def test_an_engine_whose_weights_a_reload_cannot_bring_back_is_marked_for_a_restart(
    sims, router_over, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What vLLM 0.32 does after a reload failed on a tensor of the wrong shape (every later reload
    fails the same way, with an empty message), played by an engine whose reloads all fail so: its
    weights stay detached, and its reason tells the fleet controller to restart it."""
    monkeypatch.setattr(restore, "BACKOFF_S", 0.05)
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    client = FleetClient(r.base_url(), TOKEN)
    assert (await in_thread(client.load_weights, checkpoint(tmp_path, "a"), "v1"))["ok"]
    poisoned = engines[1]

    async def refuse(weights_path: str | None = None, weights_iterator: object = None) -> None:
        poisoned.worker.detached = True
        raise WorkerError("")

    monkeypatch.setattr(poisoned.worker, "reload_weights", refuse)
    txn = await in_thread(client.load_weights, checkpoint(tmp_path, "b", b"b"), "v2", check=False)
    assert txn["canary"] == engines[0].url and txn["moved"], txn  # the canary: first in the set, idle
    assert list(txn["quarantined"]) == [poisoned.url], txn["quarantined"]
    assert await until(lambda: restore.needs_restart(r.backends.stale.get(poisoned.url, "")))
    why = r.backends.stale[poisoned.url]
    assert why.startswith(f"restore from {tmp_path / 'b'} failed:") and "HTTP 500" in why, why
    assert r.fleet.restorer.failed_total == 1 and engines[0].url in r.backends.serving


def test_a_stale_engine_is_never_restarted_for_being_stale() -> None:
    """The fleet controller's judge (``launcher.fleet.health``): STALE for another version, ticks on with
    passing probes, is never condemned; STALE with the front's ``needs_restart`` reason is."""
    fleet, clock = make(2)
    other = "http://10.0.0.1:8001"
    for _ in range(20):
        result = front_tick(fleet, clock, {other: "serves version 'default', the fleet is on 'v1'"})
        assert result.to_restart == []
    assert fleet.state("e1") is EngineState.STALE
    lost = f"restore from /ckpt/a failed: HTTP 500; {restore.LOST}"
    result = front_tick(fleet, clock, {other: lost})
    assert [e["to_state"] for e in result.events] == ["DEAD", "RESTARTING"], result.events
    assert result.to_restart == ["e1"] and "lost" in result.events[0]["reason"]
