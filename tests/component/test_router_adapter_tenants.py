"""LoRA tenants kept apart by construction (security findings 2026-12-05, #1 and #5): each way tenant B
reached tenant A's adapter, or took the slot the fleet's spec reserved for it, tried through the router
over simulated engines that answer the adapter routes and read bodies as vLLM 0.32 does.

The fleet serves the base model (the default, where the findings were made). Real servers on 127.0.0.1
with OS-chosen ports; adapter directories under ``tmp_path``. The same after a restart of the router
against real vLLM CPU engines: ``tests/vllm/test_lora_router_restart.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from launcher.engines.sim import SimConfig, SimServer
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

LORA = lora_engine(max_cpu_loras=6)
UNREADABLE = {
    # what vLLM 0.32 (FastAPI's json.loads) reads and orjson refuses (the simulator reads them as vLLM)
    "NaN": b'{"model": "%s", "prompt": "hello", "max_tokens": 4, "x": NaN}',
    "BOM": b'\xef\xbb\xbf{"model": "%s", "prompt": "hello", "max_tokens": 4}',
    "lone surrogate": b'{"model": "%s", "prompt": "hello", "max_tokens": 4, "user": "\\ud800"}',
}


async def call(url: str, path: str, key: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    method = "GET" if body is None and raw is None else "POST"
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    data = raw if raw is not None else (orjson.dumps(body) if body is not None else None)
    async with aiohttp.ClientSession() as s, s.request(method, url + path, data=data, headers=headers) as r:
        got = await r.read()
        return r.status, orjson.loads(got) if got[:1] in (b"{", b"[") else got.decode()


async def load(url: str, key: str, name: str, path: Path, version: str | None = None) -> tuple[int, Any]:
    body = {"adapter": name, "from": str(path), **({"version": version} if version else {})}
    return await call(url, "/fleet/adapters/load", key, body)


async def complete(url: str, key: str, model: str, max_tokens: int = 4) -> tuple[int, str]:
    """The status and the model that answered (or the error's message)."""
    body = {"model": model, "prompt": "hello world", "max_tokens": max_tokens, "ignore_eos": True}
    status, data = await call(url, "/v1/completions", key, body)
    if status == 200:
        return status, data["model"]
    return status, data["error"]["message"] if isinstance(data, dict) and "error" in data else str(data)


async def until(check: Callable[[], Any], what: str, tries: int = 200) -> None:
    for _ in range(tries):
        if await check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never: {what}")


async def test_a_draining_version_is_refused_to_another_tenant(
    make_server: Callable[..., Any], routers: Callable[..., GenerationRouter], tmp_path: Path
) -> None:
    """#1 (a): while tenant A's adapter drained after its unload, B's key sampled it by its served name."""
    engines = [await make_server(SimConfig(speed=1.0, **LORA), index=i) for i in range(2)]  # 300 tokens: ~2 s
    r = routers([e.url for e in engines], consumers_file=str(consumers(tmp_path)), lora={"max_adapters": 2})
    url = r.base_url()
    assert (await load(url, ADMIN["a"], "policy-a", write_adapter(tmp_path / "a1"), "v1"))[0] == 200
    in_flight = asyncio.ensure_future(complete(url, KEYS["a"], "policy-a", max_tokens=300))

    async def counted() -> bool:
        view = (await call(url, "/fleet/adapters", TOKEN))[1]
        a = view["adapters"].get("policy-a")
        return a is not None and a["current"]["in_flight"] == 1

    await until(counted, "A's request in flight on policy-a@v1")
    unload = asyncio.ensure_future(call(url, "/fleet/adapters/unload", ADMIN["a"], {"adapter": "policy-a"}))
    await until(lambda: _gone(url), "policy-a's entry dropped (its version draining)")
    assert not unload.done() and any(["policy-a@v1" in await served_on(e) for e in engines])
    status, answer = await complete(url, KEYS["b"], "policy-a@v1")
    print(f"\n[drain] while policy-a@v1 drains, tenant b asks for it: {status} {answer[:90]!r}")
    assert status == 403 and "belongs to consumer 'tenant-a'" in answer, (status, answer)
    status, answer = await complete(url, KEYS["a"], "policy-a@v1")
    assert status == 409 and "not served now" in answer, (status, answer)  # unloaded: not even its owner
    assert (await in_flight) == (200, "policy-a@v1")  # the request in flight ends on its version
    assert (await unload)[0] == 200
    for e in engines:
        assert await served_on(e) == {"tiny"}
    status, answer = await complete(url, KEYS["b"], "policy-a@v1")
    assert status == 403, (status, answer)  # reserved for A: refused by the router, never the engine's 404


async def _gone(url: str) -> bool:
    return "policy-a" not in (await call(url, "/fleet/adapters", TOKEN))[1]["adapters"]


async def test_a_restarted_router_rebuilds_who_owns_what_from_the_engines_and_the_consumers_file(
    sims: Callable[..., Any], routers: Callable[..., GenerationRouter], tmp_path: Path
) -> None:
    """#1 (b): after a router restart the table was empty; B sampled A's adapter by its served name and
    each tenant's own name was an engine 404. The router restarted here starts with no engine (a Ray
    actor restarts with its first arguments; the controller pushes the engines a moment later)."""
    engines = await sims(2, **LORA)
    urls = [e.url for e in engines]
    plan = {"max_adapters": 3}
    path = str(consumers(tmp_path))
    first = routers(urls, consumers_file=path, lora=plan)
    url = first.base_url()
    assert (await load(url, ADMIN["a"], "policy-a", write_adapter(tmp_path / "a1"), "v1"))[0] == 200
    assert (await load(url, ADMIN["a"], "policy-a", write_adapter(tmp_path / "a2", fill=b"b"), "v2"))[
        0
    ] == 200
    assert (await load(url, ADMIN["b"], "policy-b", write_adapter(tmp_path / "b1", fill=b"c"), "v1"))[
        0
    ] == 200
    assert (await load(url, ADMIN["b"], "scratch", write_adapter(tmp_path / "s1", fill=b"d"), "v1"))[0] == 200
    await until(lambda: _settled(engines), "policy-a@v1 drained")
    first.stop()

    again = routers([], consumers_file=path, lora=plan, version_max_wait_s=0.3)
    url = again.base_url()
    status, answer = await complete(url, KEYS["a"], "policy-a")
    assert status == 409 and "reading which adapters the engines hold" in answer, (status, answer)
    assert (await complete(url, KEYS["b"], "policy-a@v2"))[0] == 403  # the reservation answers at once
    again.set_serving_backends(urls)
    got = {
        "a policy-a": await complete(url, KEYS["a"], "policy-a"),
        "b policy-a@v2": await complete(url, KEYS["b"], "policy-a@v2"),
        "b policy-b": await complete(url, KEYS["b"], "policy-b"),
        "b scratch@v1": await complete(url, KEYS["b"], "scratch@v1"),
        "owner scratch": await complete(url, API, "scratch"),
    }
    print("\n[router restart] " + "; ".join(f"{k}: {s} {m[:60]!r}" for k, (s, m) in got.items()))
    assert got["a policy-a"] == (200, "policy-a@v2")
    assert got["b policy-a@v2"][0] == 403 and "belongs to consumer 'tenant-a'" in got["b policy-a@v2"][1]
    assert got["b policy-b"] == (200, "policy-b@v1")
    # an unreserved adapter's first loader is written nowhere the router reads: the fleet's owner's now
    assert got["b scratch@v1"][0] == 403 and got["owner scratch"] == (200, "scratch@v1")
    view = (await call(url, "/fleet/adapters", TOKEN))[1]
    assert view["rebuilt"] and {n: a["owner"] for n, a in view["adapters"].items()} == {
        "policy-a": "tenant-a",
        "policy-b": "tenant-b",
        "scratch": "owner",
    }
    assert view["adapters"]["policy-a"]["current"]["engines"] == sorted(urls)
    # the owner's next load moves on from the version the engines hold
    status, txn = await load(url, ADMIN["a"], "policy-a", write_adapter(tmp_path / "a3", fill=b"e"), "v3")
    assert status == 200 and txn["previous_version"] == "v2", txn
    assert (await complete(url, KEYS["a"], "policy-a")) == (200, "policy-a@v3")


async def _settled(engines: list[SimServer]) -> bool:
    return all(["policy-a@v1" not in await served_on(e) for e in engines])


async def test_after_a_router_restart_the_plan_counts_what_the_engines_hold(
    sims: Callable[..., Any], routers: Callable[..., GenerationRouter], tmp_path: Path
) -> None:
    """#5: a restarted router counted nothing the engines held; loads went past ``max_adapters`` (and
    vLLM's ``--max-cpu-loras``), and the old versions were never unloaded."""
    engines = await sims(2, **LORA)
    urls = [e.url for e in engines]
    path = str(consumers(tmp_path))
    first = routers(urls, consumers_file=path, lora={"max_adapters": 2})
    url = first.base_url()
    assert (await load(url, ADMIN["a"], "policy-a", write_adapter(tmp_path / "a1"), "v1"))[0] == 200
    assert (await load(url, ADMIN["b"], "policy-b", write_adapter(tmp_path / "b1", fill=b"c"), "v1"))[
        0
    ] == 200
    # a version loaded behind the router's back (or by a router that died before stamping it)
    async with aiohttp.ClientSession() as s:
        extra = {"lora_name": "policy-a@v0", "lora_path": str(write_adapter(tmp_path / "a0", fill=b"z"))}
        async with s.post(urls[0] + "/v1/load_lora_adapter", json=extra) as resp:
            assert resp.status == 200
    first.stop()

    again = routers(urls, consumers_file=path, lora={"max_adapters": 2})
    url = again.base_url()
    status, body = await load(url, TOKEN, "scratch", write_adapter(tmp_path / "s1", fill=b"d"), "v1")
    print(f"\n[restart count] the owner loads a third adapter after the restart: {status} {body['error']!r}")
    assert status == 409 and "generation.lora.max_adapters: 2" in body["error"], body
    assert "loaded: policy-a, policy-b" in body["error"], body
    # the stale version one engine held is unloaded; the current ones stay
    await until(lambda: _without(engines[0], "policy-a@v0"), "policy-a@v0 unloaded")
    for e in engines:
        assert await served_on(e) == {"tiny", "policy-a@v1", "policy-b@v1"}


async def _without(engine: SimServer, served: str) -> bool:
    return served not in await served_on(engine)


async def test_a_body_the_router_cannot_read_is_refused_never_forwarded(
    sims: Callable[..., Any], routers: Callable[..., GenerationRouter], tmp_path: Path
) -> None:
    """#1 (c): three bodies orjson refuses and vLLM reads went on as base-model requests, and the engine
    served the adapter they named to whoever sent them."""
    engines = await sims(2, **LORA)
    r = routers([e.url for e in engines], consumers_file=str(consumers(tmp_path)), lora={"max_adapters": 2})
    url = r.base_url()
    assert (await load(url, ADMIN["a"], "policy-a", write_adapter(tmp_path / "a1"), "v1"))[0] == 200
    before = sum(e.stats_snapshot()["prompt_tokens"] for e in engines)
    for what, body in UNREADABLE.items():
        for key, model in ((KEYS["b"], "policy-a@v1"), (KEYS["a"], "policy-a"), (KEYS["b"], "tiny")):
            status, answer = await call(url, "/v1/completions", key, raw=body % model.encode())
            print(f"\n[unreadable] {what} naming {model}: {status} {str(answer)[:100]!r}")
            assert status == 400 and "not JSON the router can read" in answer["error"]["message"], answer
    assert sum(e.stats_snapshot()["prompt_tokens"] for e in engines) == before  # no engine was asked
    assert (await complete(url, KEYS["a"], "policy-a")) == (200, "policy-a@v1")


async def test_v1_models_shows_each_caller_the_base_model_and_its_own_adapters_without_directories(
    sims: Callable[..., Any], routers: Callable[..., GenerationRouter], tmp_path: Path
) -> None:
    """#1 (L2): the proxied ``GET /v1/models`` listed every tenant's served names, with their directories."""
    engines = await sims(2, **LORA)
    r = routers([e.url for e in engines], consumers_file=str(consumers(tmp_path)), lora={"max_adapters": 3})
    url = r.base_url()
    assert (await load(url, ADMIN["a"], "policy-a", write_adapter(tmp_path / "a1"), "v1"))[0] == 200
    assert (await load(url, ADMIN["b"], "policy-b", write_adapter(tmp_path / "b1", fill=b"c"), "v1"))[
        0
    ] == 200
    seen = {}
    for who, key in (("a", KEYS["a"]), ("b", KEYS["b"]), ("owner", API)):
        status, listed = await call(url, "/v1/models", key)
        assert status == 200, listed
        seen[who] = {m["id"]: m for m in listed["data"]}
        assert all("root" not in m for m in listed["data"]), listed
    print(f"\n[/v1/models] {', '.join(f'{w}: {sorted(s)}' for w, s in seen.items())}")
    assert set(seen["a"]) == {"tiny", "policy-a@v1"} and set(seen["b"]) == {"tiny", "policy-b@v1"}
    assert set(seen["owner"]) == {"tiny", "policy-a@v1", "policy-b@v1"}
    assert seen["b"]["policy-b@v1"]["parent"] == "tiny"
    assert (await call(url, "/v1/models", "not-a-key"))[0] == 401


async def test_a_reservation_holds_capacity_that_unreserved_loads_cannot_take(
    sims: Callable[..., Any], routers: Callable[..., GenerationRouter], tmp_path: Path
) -> None:
    """#5: B loaded an unreserved adapter into the slot the fleet's spec reserved for A, and A's load was
    refused until B chose to unload it."""
    engines = await sims(2, **LORA)
    r = routers([e.url for e in engines], consumers_file=str(consumers(tmp_path)), lora={"max_adapters": 2})
    url = r.base_url()
    assert (await load(url, ADMIN["b"], "policy-b", write_adapter(tmp_path / "b1"), "v1"))[0] == 200
    status, body = await load(url, ADMIN["b"], "scratch", write_adapter(tmp_path / "s1", fill=b"s"), "v1")
    print(f"\n[capacity] b loads an unreserved adapter: {status} {str(body.get('error'))[:120]!r}")
    assert status == 409 and "reserved for consumers, not loaded yet: policy-a" in body["error"], body
    status, body = await load(url, ADMIN["a"], "policy-a", write_adapter(tmp_path / "a1", fill=b"a"), "v1")
    print(f"[capacity] a loads its reserved adapter: {status}")
    assert status == 200, body
    assert (await complete(url, KEYS["a"], "policy-a")) == (200, "policy-a@v1")
