"""LoRA tenants through the router (``router.adapters``) over simulated engines that answer the adapter
routes as vLLM 0.32 does (``launcher.engines.sim.lora``): two consumers of one fleet, each with its own
adapter, an owner, a broken directory, a full plan, a restarted engine.

Real servers on 127.0.0.1 with OS-chosen ports: the router in its thread, the simulators on the test's
loop (so every call to the router here is async), adapter directories under ``tmp_path``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from launcher.engines.sim import SimConfig
from router import GenerationRouter
from tests.support.adapter_tenants import (
    ADMIN,
    API,
    KEYS,
    consumers,
    lora_engine,
    routers_fixture,  # noqa: F401 (the fixture routers)
    served_on,
)
from tests.support.adapters import write_adapter
from tests.support.refit_calls import TOKEN

LORA = lora_engine(max_cpu_loras=4)


async def call(url: str, path: str, key: str, body: Any = None, **headers: str) -> tuple[int, Any, Any]:
    method = "GET" if body is None else "POST"
    hdrs = {"Authorization": f"Bearer {key}", **headers}
    async with aiohttp.ClientSession() as s, s.request(method, url + path, json=body, headers=hdrs) as r:
        raw = await r.read()
        return r.status, orjson.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode(), r.headers


async def load(url: str, key: str, name: str, path: Path, version: str | None = None) -> tuple[int, Any]:
    body = {"adapter": name, "from": str(path), **({"version": version} if version else {})}
    status, data, _ = await call(url, "/fleet/adapters/load", key, body)
    return status, data


async def complete(url: str, key: str, model: str, **headers: str) -> tuple[int, Any, str | None]:
    body = {"model": model, "prompt": "hello world", "max_tokens": 4, "temperature": 0}
    status, data, h = await call(url, "/v1/completions", key, body, **headers)
    return status, data, h.get("x-rl-weight-version")


async def on_version(url: str, version: str, in_flight: int) -> None:
    """Wait until the router counts ``in_flight`` requests on ``version`` of policy-a."""
    for _ in range(200):
        _, view, _ = await call(url, "/fleet/adapters", TOKEN)
        a = view["adapters"]["policy-a"]
        if any(
            v["version"] == version and v["in_flight"] == in_flight for v in [a["current"], *a["draining"]]
        ):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"policy-a {version} never had {in_flight} request(s) in flight: {view}")


async def test_two_tenants_refit_their_own_adapters_and_neither_touches_the_others(
    make_server: Callable[..., Any], routers: Callable[..., GenerationRouter], tmp_path: Path
) -> None:
    # speed 1: a request of 300 tokens takes ~2 s, long enough to be in flight across a refit
    engines = [await make_server(SimConfig(speed=1.0, **LORA), index=i) for i in range(2)]
    r = routers([e.url for e in engines], consumers_file=str(consumers(tmp_path)), lora={"max_adapters": 2})
    url = r.base_url()
    a1 = write_adapter(tmp_path / "a1", fill=b"a")
    status, txn = await load(url, ADMIN["a"], "policy-a", a1, "step-0")
    assert status == 200 and txn["ok"] and txn["served_name"] == "policy-a@step-0", txn
    assert [s["phase"] for s in txn["steps"]] == ["checking", "canary", "loading", "stamped"]
    assert {e.url for e in engines} == set(txn["verified"])
    for e in engines:
        assert "policy-a@step-0" in await served_on(e)
    # its tenant samples from it: the answer names the version, in the body and the header
    status, body, version = await complete(url, KEYS["a"], "policy-a")
    assert (status, body["model"], version) == (200, "policy-a@step-0", "step-0")
    # the other tenant may neither call it (by either name) nor load over it
    for model in ("policy-a", "policy-a@step-0"):
        status, body, _ = await complete(url, KEYS["b"], model)
        assert status == 403 and "belongs to consumer 'tenant-a'" in body["error"]["message"], body
    status, body = await load(url, ADMIN["b"], "policy-a", write_adapter(tmp_path / "evil"))
    assert status == 403 and "may not load or unload" in body["error"], body
    status, body, _ = await call(url, "/fleet/adapters/unload", ADMIN["b"], {"adapter": "policy-a"})
    assert status == 403
    # its own, reserved and not loaded yet: refused with the reason, never an engine's 404
    status, body, _ = await complete(url, KEYS["b"], "policy-b")
    assert status == 409 and "not loaded on this fleet yet" in body["error"]["message"], body
    assert (await complete(url, KEYS["b"], "tiny"))[0] == 200  # the base model is everyone's
    status, txn = await load(url, ADMIN["b"], "policy-b", write_adapter(tmp_path / "b1", fill=b"b"))
    assert status == 200 and txn["version"] == "v1", txn
    _, body, version = await complete(url, KEYS["b"], "policy-b")
    assert (body["model"], version) == ("policy-b@v1", "v1")

    # a new version while a request is on the old one: that request ends on the old version, the next
    # ones go to the new, and the old is unloaded from every engine once nothing is in flight on it
    long = {"model": "policy-a", "prompt": "hello", "max_tokens": 300, "ignore_eos": True}
    in_flight = asyncio.ensure_future(call(url, "/v1/completions", KEYS["a"], long))
    await on_version(url, "step-0", 1)
    status, txn = await load(url, ADMIN["a"], "policy-a", write_adapter(tmp_path / "a2", fill=b"c"), "step-1")
    assert status == 200 and txn["previous_version"] == "step-0"
    _, body, version = await complete(url, KEYS["a"], "policy-a")
    assert (body["model"], version) == ("policy-a@step-1", "step-1")
    status, old, headers = await in_flight
    assert status == 200 and old["model"] == "policy-a@step-0" and headers["x-rl-weight-version"] == "step-0"
    for _ in range(100):
        listed = [await served_on(e) for e in engines]
        if not any("policy-a@step-0" in names for names in listed):
            break
        await asyncio.sleep(0.05)
    for e in engines:
        assert await served_on(e) == {"tiny", "policy-a@step-1", "policy-b@v1"}
    # a refit that follows while the version before drains waits for it first: no engine holds a third
    # version of one adapter (the plan's --max-cpu-loras has room for two)
    in_flight = asyncio.ensure_future(call(url, "/v1/completions", KEYS["a"], long))
    await on_version(url, "step-1", 1)
    assert (await load(url, ADMIN["a"], "policy-a", write_adapter(tmp_path / "a3", fill=b"d"), "step-2"))[
        0
    ] == 200
    status, txn = await load(url, ADMIN["a"], "policy-a", write_adapter(tmp_path / "a4", fill=b"e"), "step-3")
    assert status == 200 and txn["steps"][1]["phase"] == "draining", txn["steps"]
    assert in_flight.done()  # the load waited for it
    assert (await in_flight)[1]["model"] == "policy-a@step-1"
    for _ in range(100):
        listed = [await served_on(e) for e in engines]
        if all(names == {"tiny", "policy-a@step-3", "policy-b@v1"} for names in listed):
            break
        await asyncio.sleep(0.05)
    assert listed == [{"tiny", "policy-a@step-3", "policy-b@v1"}] * 2
    # a gate on the adapter's versions
    assert (await complete(url, KEYS["a"], "policy-a", **{"x-rl-weight-version": ">=step-0"}))[2] == "step-3"
    status, body, _ = await complete(url, KEYS["a"], "policy-a", **{"x-rl-weight-version": "step-7"})
    assert status == 400 and "no version 'step-7'" in body["error"]["message"]
    # a version used before is refused: its name on the engines would be the old one's
    status, body = await load(url, ADMIN["a"], "policy-a", a1, "step-0")
    assert status == 409 and "already had version 'step-0'" in body["error"]
    # on a fleet of tenants the base weights and the pause are the owner's: no tenant moves them
    for path, body in (
        ("/fleet/refit", {"version": "x", "from": str(a1)}),
        ("/fleet/pause", {}),
        ("/fleet/refit/begin", {"version": "x"}),
        ("/fleet/weight_version", {"version": "x"}),
    ):
        status, answer, _ = await call(url, path, ADMIN["a"], body)
        assert status == 403 and "fleet owner's alone" in answer["error"]["message"], (path, answer)
    # a tenant sees its own adapters only
    status, mine, _ = await call(url, "/fleet/adapters", ADMIN["b"])
    assert status == 200 and set(mine["adapters"]) == {"policy-b"} and set(mine["last"]) == {"policy-b"}
    assert all(names == ["policy-b@v1"] for names in mine["engines"].values()), mine["engines"]
    # the table, as the dashboard reads it
    status, view, _ = await call(url, "/fleet/adapters", TOKEN)
    assert (
        view["adapters"]["policy-a"]["owner"] == "tenant-a"
        and view["adapters"]["policy-a"]["version"] == "step-3"
    )
    assert view["reserved"] == {"policy-a": "tenant-a", "policy-b": "tenant-b"}


async def test_a_broken_adapter_stops_at_the_checks_or_the_canary_and_the_fleet_serves_on(
    sims: Callable[..., Any], routers: Callable[..., GenerationRouter], tmp_path: Path
) -> None:
    engines = await sims(2, **LORA)
    r = routers([e.url for e in engines], lora={"max_adapters": 2, "max_lora_rank": 8})
    url = r.base_url()
    status, txn = await load(url, TOKEN, "policy-a", write_adapter(tmp_path / "good"), "v1")
    assert status == 200
    # what the router can see is refused before any engine is asked, naming the file
    for bad, words in (
        (write_adapter(tmp_path / "garbage", broken=True), "is not a safetensors file"),
        (write_adapter(tmp_path / "wide", rank=16), "rank 16 is above the fleet's max_lora_rank 8"),
        (tmp_path / "missing", "does not exist"),
    ):
        status, body = await load(url, TOKEN, "policy-a", bad, "v2")
        assert status == 400 and words in body["error"], body
        assert body["canary"] is None
    # an adapter of another model's width passes every check and fails the engine's load: the canary
    # finds it, no other engine is asked, the canary keeps serving, the adapter stays on v1
    other = write_adapter(tmp_path / "other-base", hidden=67)
    status, txn = await load(url, TOKEN, "policy-a", other, "v2")
    assert status == 500 and txn["phase"] == "failed" and not txn["moved"], txn
    canary = txn["canary"]
    assert (
        "must match the size of tensor b (67)" in txn["error"] and "no other engine was asked" in txn["error"]
    )
    assert [u for u, e in txn["engines"].items() if e["state"] == "untouched"] == [
        e.url for e in engines if e.url != canary
    ]
    assert txn["quarantined"] == {} and sorted(r.serving_backends()) == sorted(e.url for e in engines)
    for e in engines:
        assert "policy-a@v2" not in await served_on(e)
    for _ in range(4):
        status, body, version = await complete(url, API, "policy-a")
        assert (status, body["model"], version) == (200, "policy-a@v1", "v1")
    assert (await complete(url, API, "tiny"))[0] == 200


async def test_the_plan_bounds_the_adapters_and_a_restarted_engine_gets_them_back_first(
    sims: Callable[..., Any], routers: Callable[..., GenerationRouter], tmp_path: Path
) -> None:
    engines = await sims(2, **LORA)
    r = routers([e.url for e in engines], lora={"max_adapters": 1, "max_lora_rank": 8})
    url = r.base_url()
    assert (await load(url, TOKEN, "policy-a", write_adapter(tmp_path / "a"), "v1"))[0] == 200
    status, body = await load(url, TOKEN, "policy-b", write_adapter(tmp_path / "b"), "v1")
    assert status == 409 and "generation.lora.max_adapters: 1" in body["error"], body
    # an engine that comes back without its adapters (a restart) is given them before any adapter
    # request reaches it
    gone = engines[1]
    async with aiohttp.ClientSession() as s:
        await s.post(gone.url + "/v1/unload_lora_adapter", json={"lora_name": "policy-a@v1"})
    r.set_serving_backends([engines[0].url])
    r.set_serving_backends([e.url for e in engines])
    for _ in range(100):
        if "policy-a@v1" in await served_on(gone):
            break
        await asyncio.sleep(0.05)
    assert "policy-a@v1" in await served_on(gone)
    for _ in range(8):
        status, body, _ = await complete(url, API, "policy-a")
        assert status == 200 and body["model"] == "policy-a@v1", body


async def test_an_lm_head_adapter_on_cpu_engines_serving_the_base_model_is_refused(
    sims: Callable[..., Any], routers: Callable[..., GenerationRouter], tmp_path: Path
) -> None:
    """vLLM 0.32's CPU build applies a loaded adapter's lm_head to requests of the base model (the
    simulator does too): on a fleet that serves the base model such an adapter is refused before any
    engine is asked; a fleet that serves adapters only takes it and refuses base-model requests."""
    engines = await sims(2, **LORA)
    head = write_adapter(tmp_path / "head", targets=("q_proj", "v_proj", "lm_head"))
    r = routers([e.url for e in engines], lora={"max_adapters": 2})
    url = r.base_url()
    _, before, _ = await complete(url, API, "tiny")
    status, body = await load(url, TOKEN, "policy-a", head)
    assert status == 400 and "adapts lm_head" in body["error"] and "base_model: false" in body["error"], body
    for e in engines:
        assert await served_on(e) == {"tiny"}
    _, after, _ = await complete(url, API, "tiny")
    assert after["choices"][0]["text"] == before["choices"][0]["text"]

    only = routers([e.url for e in engines], lora={"max_adapters": 2, "base_model": False})
    url = only.base_url()
    status, txn = await load(url, TOKEN, "policy-a", head, "v1")
    assert status == 200, txn
    status, body, _ = await complete(url, API, "tiny")
    assert status == 404 and "serves its LoRA adapters only" in body["error"]["message"], body
    status, body, version = await complete(url, API, "policy-a")
    assert (status, body["model"], version) == (200, "policy-a@v1", "v1")
    # what the refusal protects: an engine with that adapter loaded answers the base model with its head
    leaked = (
        await call(
            engines[0].url,
            "/v1/completions",
            "",
            {"model": "tiny", "prompt": "hello world", "max_tokens": 4, "temperature": 0},
        )
    )[1]
    assert leaked["choices"][0]["text"] != before["choices"][0]["text"]
