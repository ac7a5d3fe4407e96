"""The fleet's three weight paths run on one transaction core (``router.fleet.txn``, issue 39 item 1): the
full refit, the adapter refit and the restore each report in the core's shape (id, phase, times,
deadline, steps with their timings and failures, canary, per-engine states, verified, error, moved), and
the restore, which before kept no record at all (a failed one left only its last reason in the stale
list), now shows its last attempt per engine, step by step, under ``GET /fleet/stale``'s ``restores``.
On simulated engines behind a real router.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import router.fleet.restore as restore
from launcher.fleet.client import FleetClient
from router import GenerationRouter
from router.fleet.txn import RetryPolicy
from tests.support.adapters import write_adapter
from tests.support.checkpoints import checkpoint
from tests.support.http_backends import router_factory
from tests.support.refit_calls import (
    TOKEN,
    admin,
    in_thread,
    router_over_fixture,  # noqa: F401 (the fixture router_over)
    until,
)

CORE = {"id", "phase", "started_at", "ended_at", "elapsed_s", "deadline_s", "steps", "canary"}
CORE |= {"engines", "verified", "error", "moved"}
"""The fields every transaction's report has (``Txn.report``)."""
STEP = {"phase", "took_s", "engines", "failed"}
LORA = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 4}
LORA.update(allow_runtime_lora_updating=True, model_name="tiny")


@pytest.fixture
def lora_routers() -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(policy="round_robin", probe_interval_s=0, admin_token=TOKEN) as make:
        yield make


def in_core_shape(report: dict[str, Any]) -> list[str]:
    """Each step's phase, after checking the report and its steps have the core's fields."""
    assert CORE <= set(report), sorted(CORE - set(report))
    for step in report["steps"]:
        assert STEP <= set(step) and step["took_s"] >= 0, step
    return [step["phase"] for step in report["steps"]]


async def test_the_refit_the_adapter_refit_and_the_restore_report_in_one_shape(
    sims, router_over, lora_routers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(restore, "BACKOFF_S", 0.05)
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    client = FleetClient(r.base_url(), TOKEN)
    a = checkpoint(tmp_path, "a")
    refit = await in_thread(client.load_weights, a, "v1")
    assert refit["ok"] and in_core_shape(refit) == [
        "pausing",
        "canary",
        "loading",
        "verifying",
        "resetting",
        "stamping",
        "resuming",
    ]
    # A restore that succeeds: an engine joins on its start checkpoint and is brought to v1.
    joining = (await sims(1))[0]
    r.set_serving_backends([e.url for e in engines] + [joining.url])
    assert await until(lambda: joining.url in r.backends.serving and not r.backends.stale)
    _, stale = await admin(r.base_url(), "GET", "/fleet/stale")
    done = stale["restores"][joining.url]
    assert done["moved"] and done["phase"] == "done" and done["verified"] == [joining.url], done
    assert in_core_shape(done) == ["checking", "loading", "verifying", "resetting", "stamping"]
    # A restore that fails: the directory is gone, every attempt stops at its check.
    shutil.rmtree(a)
    late = (await sims(1))[0]
    r.set_serving_backends([e.url for e in [*engines, joining, late]])
    assert await until(
        lambda: not r.fleet.restorer.pending() and "restore from" in r.backends.stale.get(late.url, "")
    )
    _, stale = await admin(r.base_url(), "GET", "/fleet/stale")
    failed = stale["restores"][late.url]
    assert not failed["moved"] and failed["phase"] == "failed" and failed["path"] == str(a), failed
    assert in_core_shape(failed) == ["checking"] and "does not exist" in failed["error"], failed
    assert failed["engines"][late.url]["state"] == "quarantined"
    assert f"restore from {failed['error']}" == r.backends.stale[late.url]

    # The adapter refit, on engines that serve adapters.
    lora = await sims(2, **LORA)
    lr = lora_routers([e.url for e in lora], lora={"max_adapters": 2, "max_lora_rank": 8})
    body = {"adapter": "policy-a", "from": str(write_adapter(tmp_path / "adapter")), "version": "v1"}
    for _ in range(100):  # a router that just started reads what its engines hold first (409 meanwhile)
        status, txn = await admin(lr.base_url(), "POST", "/fleet/adapters/load", body)
        if status != 409:
            break
        await asyncio.sleep(0.05)
    assert status == 200 and txn["ok"], txn
    assert in_core_shape(txn) == ["checking", "canary", "loading", "stamped"]
    assert {u: e["state"] for u, e in txn["engines"].items()} == {e.url: "verified" for e in lora}


async def test_the_retry_policy_tries_again_after_a_growing_pause() -> None:
    tried: list[float] = []
    t0 = time.monotonic()

    async def failing(n: int) -> bool:
        tried.append(time.monotonic() - t0)
        return False

    assert not await RetryPolicy(attempts=3, backoff_s=0.05, factor=2.0).run(failing)
    assert len(tried) == 3
    assert 0.05 <= tried[1] - tried[0] < tried[2] - tried[1]  # 0.05 s, then 0.1 s
    assert await RetryPolicy(attempts=3).run(lambda n: asyncio.sleep(0, result=n == 2))
