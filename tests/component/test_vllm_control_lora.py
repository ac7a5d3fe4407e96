"""vLLM's LoRA routes on the router's control URL (``/control/v1/load_lora_adapter`` and its unload,
``router.fleet.control_lora``): each load is the fleet's adapter transaction under the tenant rules, over
HTTP, against simulated engines that serve vLLM 0.32's adapter routes behind a real router with two
LoRA tenants (``tests.support.adapter_tenants``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from launcher.engines.sim import SimConfig
from router import GenerationRouter
from tests.support.adapter_tenants import (
    ADMIN,
    KEYS,
    consumers,
    lora_engine,
    routers_fixture,  # noqa: F401 (the fixture routers)
    served_on,
)
from tests.support.adapters import write_adapter
from tests.support.refit_calls import TOKEN

LORA = lora_engine(max_cpu_loras=6)
LOAD, UNLOAD = "/control/v1/load_lora_adapter", "/control/v1/unload_lora_adapter"


async def post(url: str, path: str, key: str, body: Any) -> tuple[int, Any, dict[str, str]]:
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body, headers=headers) as r:
        raw = await r.read()
        answer = orjson.loads(raw) if raw[:1] == b"{" else raw.decode()
        return r.status, answer, dict(r.headers)


async def models(url: str, key: str, path: str = "/control/v1/models") -> list[dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(url + path, headers={"Authorization": f"Bearer {key}"}) as r,
    ):
        assert r.status == 200, await r.text()
        return list((await r.json())["data"])


async def test_the_router_hands_its_adapters_to_the_control_url(
    make_server: Callable[..., Any], routers: Callable[..., GenerationRouter], tmp_path: Path
) -> None:
    engines = [await make_server(SimConfig(speed=20.0, **LORA), index=i) for i in range(2)]
    r = routers([e.url for e in engines], consumers_file=str(consumers(tmp_path)), lora={"max_adapters": 2})
    assert r.adapters is not None and r.fleet.adapter_refits is r.adapters.refits


async def test_lora_loads_are_the_adapter_transaction_under_the_tenant_rules(
    make_server: Callable[..., Any], routers: Callable[..., GenerationRouter], tmp_path: Path
) -> None:
    engines = [await make_server(SimConfig(speed=20.0, **LORA), index=i) for i in range(2)]
    r = routers([e.url for e in engines], consumers_file=str(consumers(tmp_path)), lora={"max_adapters": 2})
    url = r.base_url()
    a1 = write_adapter(tmp_path / "a1")
    body = {"lora_name": "policy-a", "lora_path": str(a1)}
    status, text, headers = await post(url, LOAD, ADMIN["a"], body)  # tenant a's admin key, its adapter
    assert (status, text) == (200, "Success: LoRA adapter 'policy-a' added successfully."), text
    assert headers["x-rl-adapter-served-name"] == "policy-a@v1"
    for e in engines:
        assert await served_on(e) == {"tiny", "policy-a@v1"}
    # The control URL's /v1/models: each tenant sees its own adapters, the owner every one, no roots. The
    # generation URL's own list takes the same admin keys (NeMo-RL's preflight sends its one key there)
    # and each tenant's client key, and answers the same per caller.
    for key, expected in (
        (ADMIN["a"], {"tiny", "policy-a@v1"}),
        (ADMIN["b"], {"tiny"}),
        (TOKEN, {"tiny", "policy-a@v1"}),
        (KEYS["a"], {"tiny", "policy-a@v1"}),
    ):
        paths = ("/v1/models",) if key in KEYS.values() else ("/control/v1/models", "/v1/models")
        for path in paths:
            listed = await models(url, key, path)
            assert {m["id"] for m in listed} == expected and all("root" not in m for m in listed), (
                path,
                listed,
            )
    # Tenant b may not load over a's adapter, nor unload it: 403, nothing reaches the engines.
    b_over_a = {
        "lora_name": "policy-a",
        "lora_path": str(write_adapter(tmp_path / "b1")),
        "load_inplace": True,
    }
    status, answer, _ = await post(url, LOAD, ADMIN["b"], b_over_a)
    assert status == 403 and answer["error"]["code"] == 403, answer
    status, answer, _ = await post(url, UNLOAD, ADMIN["b"], {"lora_name": "policy-a"})
    assert status == 403, answer
    # The base weights are the owner's on a fleet of tenants: a tenant's admin key may not pause them.
    assert (await post(url, "/control/pause?mode=keep", ADMIN["a"], None))[0] == 403 and not r.gate.paused
    # A client key is not an admin key; no key at all is 401.
    assert (await post(url, LOAD, KEYS["a"], body))[0] == 403
    assert (await post(url, LOAD, "not-a-key", body))[0] == 401
    # The same name again without load_inplace: vLLM's own refusal.
    status, answer, _ = await post(url, LOAD, ADMIN["a"], body)
    assert status == 400 and "set 'load_inplace' to True" in answer["error"]["message"], answer
    # In place: a new version, the old one drained and unloaded.
    a2 = write_adapter(tmp_path / "a2", fill=b"2")
    status, text, headers = await post(
        url, LOAD, ADMIN["a"], {**body, "lora_path": str(a2), "load_inplace": True}
    )
    assert status == 200 and headers["x-rl-adapter-served-name"] == "policy-a@v2", text
    # A directory the check refuses (400, no engine asked) and one only an engine's load fails on (its
    # canary: 500 in vLLM's shape): either way the adapter stays on v2 everywhere.
    for bad, expected in (
        (write_adapter(tmp_path / "bad", broken=True), 400),
        (write_adapter(tmp_path / "other", hidden=48), 500),
    ):
        status, answer, _ = await post(
            url, LOAD, ADMIN["a"], {**body, "lora_path": str(bad), "load_inplace": True}
        )
        assert status == expected and answer["error"]["code"] == status, answer
        for e in engines:
            assert await served_on(e) == {"tiny", "policy-a@v2"}
    assert r.adapters is not None and r.adapters.refits.table.adapters["policy-a"].current.version == "v2"
    # Unload by its owner; again: vLLM's 404.
    status, text, _ = await post(url, UNLOAD, ADMIN["a"], {"lora_name": "policy-a"})
    assert (status, text) == (200, "Success: LoRA adapter 'policy-a' removed successfully."), text
    for e in engines:
        assert await served_on(e) == {"tiny"}
    status, answer, _ = await post(url, UNLOAD, ADMIN["a"], {"lora_name": "policy-a"})
    assert status == 404 and answer["error"]["type"] == "NotFoundError", answer


async def test_a_fleet_without_lora_answers_the_lora_routes_as_a_vllm_without_them(
    sims, routers: Callable[..., GenerationRouter]
) -> None:
    engines = await sims(2)
    r = routers([e.url for e in engines])
    status, answer, _ = await post(r.base_url(), LOAD, TOKEN, {"lora_name": "x", "lora_path": "/tmp/x"})
    assert status == 404 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in answer["error"]["message"], answer
