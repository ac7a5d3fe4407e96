"""Two LoRA tenants of one fleet, for the router's adapter tests over simulated engines.

``API`` is the fleet owner's client key; tenants ``a`` and ``b`` each have a client key (``KEYS``) and an
admin key (``ADMIN``), and ``consumers`` writes the consumers file that gives each its own adapter
(``policy-a``, ``policy-b``). ``lora_engine`` is the simulated engines' LoRA options as vLLM 0.32 takes
them (``max_cpu_loras``, the room for versions, differs between the tests). The fixture ``routers``
(``routers_fixture``) makes cache-aware routers with the owner's key and the admin token, no prober.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from launcher.engines.sim import SimServer
from router import GenerationRouter
from router.consumers import add_admin_key, add_consumer
from tests.support.http_backends import router_factory
from tests.support.refit_calls import TOKEN

API = "client-key-of-the-owner-0123456789"
KEYS = {"a": "tenant-a-client-key-0123456789", "b": "tenant-b-client-key-0123456789"}
ADMIN = {"a": "tenant-a-admin-key-0123456789", "b": "tenant-b-admin-key-0123456789"}


def lora_engine(max_cpu_loras: int) -> dict[str, Any]:
    """A simulated engine's LoRA options (``SimConfig`` keywords): 2 adapters on the GPU of rank 8 at
    most, ``max_cpu_loras`` in the CPU cache, runtime loading on, the base model served as ``tiny``."""
    lora: dict[str, Any] = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    lora["max_cpu_loras"] = max_cpu_loras
    lora.update(allow_runtime_lora_updating=True, model_name="tiny")
    return lora


@pytest.fixture(name="routers")
def routers_fixture() -> Iterator[Callable[..., GenerationRouter]]:
    """The fixture ``routers``; a module that uses it imports ``routers_fixture``."""
    with router_factory(policy="cache_aware", probe_interval_s=0, admin_token=TOKEN, api_key=API) as make:
        yield make


def consumers(tmp_path: Path) -> Path:
    """The consumers file: ``tenant-a`` and ``tenant-b``, each with its keys and its adapter."""
    path = tmp_path / "consumers.json"
    for t in ("a", "b"):
        add_consumer(path, f"tenant-{t}", KEYS[t], adapters=(f"policy-{t}",))
        add_admin_key(path, f"tenant-{t}", ADMIN[t])
    return path


async def served_on(engine: SimServer) -> set[str]:
    """The model names ``engine`` serves now (its own ``/v1/models``)."""
    async with aiohttp.ClientSession() as s, s.get(engine.url + "/v1/models") as r:
        return {m["id"] for m in (await r.json())["data"]}


async def call(url: str, path: str, key: str, body: Any = None) -> tuple[int, Any]:
    """``GET`` (no ``body``) or ``POST`` ``url + path`` with ``key`` as the bearer: the status and the
    answer, JSON when it is JSON, else its text."""
    method = "GET" if body is None else "POST"
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, url + path, json=body, headers={"Authorization": f"Bearer {key}"}) as r,
    ):
        raw = await r.read()
        return r.status, orjson.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode()
