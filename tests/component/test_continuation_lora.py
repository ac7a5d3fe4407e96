"""A LoRA tenant's request moved off its engines, as a loaded fleet moves it (issue 41, the LoRA finding).

The trial CI with continuation on for every job saw LoRA tenants' greedy requests end 500 after two
moves ('removed', then 'restarted'; tests/vllm/test_lora_tenants.py on a loaded 2-core machine). Replayed
here on simulated engines that serve adapters as vLLM 0.32 does, with the fleet controller's steps: the
request's engine A fails its probes and is pushed out ("removed": alive, its stream moved to B); A is
restarted and comes back on a new port without adapters (the router restores them, which takes a while
on a real engine: here the restore is held for ``RESTORE_S``); then B is pushed out in turn, while the
restarted engine is the only one serving and does not hold the adapter yet.

Before: the move's exclusion was the set of engines not holding the adapter when the request arrived,
so the restarted engine (not serving then) was not in it: the move went there and got vLLM's 404, and
with no engine left untried the client got 500; and every engine tried was excluded from every move, so
A back on its own URL (its probes passing again) could not take the request either. What must hold:
the move waits (bounded) for an engine that holds the adapter's version, and the client's answer is the
uninterrupted one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from launcher.engines.sim import SimConfig, SimServer
from router import GenerationRouter
from router.fleet import adapter_restore
from router.state.backends import canonical_backend_url
from tests.support.adapter_tenants import API, call, lora_engine
from tests.support.adapters import write_adapter
from tests.support.http_backends import engine_in_flight, router_factory
from tests.support.refit_calls import TOKEN

MAX_TOKENS = 400
MOVE_AFTER = 40
RESTORE_S = 1.0


@pytest.fixture
def routers() -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(policy="round_robin", probe_interval_s=0, admin_token=TOKEN, api_key=API) as make:
        yield make


async def _load(url: str, path: Path) -> None:
    body = {"adapter": "policy-a", "from": str(path), "version": "v1"}
    for _ in range(100):  # a router that just started reads what its engines hold first (409 meanwhile)
        status, answer = await call(url, "/fleet/adapters/load", TOKEN, body)
        if status != 409 or "retry in a moment" not in str(answer):
            break
        await asyncio.sleep(0.05)
    assert status == 200 and answer["ok"], answer


async def _stream(url: str, at_tokens: Callable[[], Awaitable[None]] | None = None) -> tuple[int, list[int]]:
    """The status and the token ids a streamed greedy request for policy-a got (an SSE error event: -1)."""
    body = {
        "model": "policy-a",
        "prompt": "a long story begins",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
        "stream": True,
    }
    ids: list[int] = []
    fired = at_tokens is None
    headers = {"Authorization": f"Bearer {API}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(
            url + "/v1/completions", json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=60)
        ) as r:
            if r.status != 200:
                return r.status, ids
            buf = b""
            async for data in r.content.iter_any():
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if event.startswith(b"event: error"):
                        print(event.decode())
                        return -1, ids
                    if event != b"data: [DONE]":
                        chunk = orjson.loads(event.removeprefix(b"data: "))
                        ids += [t for ch in chunk["choices"] for t in ch.get("token_ids") or ()]
                if not fired and len(ids) >= MOVE_AFTER:
                    fired = True
                    await at_tokens()  # type: ignore[misc]
    return r.status, ids


@pytest.mark.parametrize("back", ["restarted on a new port", "on its own URL"])
async def test_a_tenants_request_moved_twice_waits_for_the_restarted_engines_adapter(
    back: str, routers: Callable[..., GenerationRouter], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``back``: how A returns to the serving set. On its own URL (its probes pass again), it must take
    the request back although the request was on it before: the fleet moved it off, A did not fail it
    (before, every engine tried was excluded from every move: 500 with A serving)."""
    config = {**lora_engine(max_cpu_loras=4), "step_base_s": 0.01}
    engines = [SimServer(SimConfig(**config), index=i) for i in range(2)]
    for e in engines:
        await e.start()
    restarted: list[SimServer] = []
    real_load = adapter_restore.load_and_verify

    async def slow_load(*args: Any) -> str | None:  # a real engine's load takes seconds
        await asyncio.sleep(RESTORE_S)
        return await real_load(*args)

    try:
        router = routers([e.url for e in engines], lora={"max_adapters": 2, "max_lora_rank": 8})
        url = router.base_url()
        await _load(url, write_adapter(tmp_path / "a"))
        status, whole = await _stream(url)
        assert status == 200 and len(whole) == MAX_TOKENS
        monkeypatch.setattr(adapter_restore, "load_and_verify", slow_load)
        loop = asyncio.get_running_loop()
        by_url = {canonical_backend_url(e.url): e for e in engines}

        async def fleet_acts() -> None:
            first = await engine_in_flight(router)
            other = next(u for u in by_url if u != first)
            # A fails its probes: the push without it ('removed'); its stream moves to B
            await loop.run_in_executor(None, router.set_serving_backends, [other])
            if back == "on its own URL":
                returned = first
                restarted.append(by_url[first])
            else:  # A is restarted: a fresh engine on a new port, without adapters
                await by_url[first].stop()
                fresh = SimServer(SimConfig(**config), index=2)
                await fresh.start()
                restarted.append(fresh)
                returned = fresh.url
            # back in the serving set (its adapters restored meanwhile); B is pushed out next
            await loop.run_in_executor(None, router.set_serving_backends, [other, returned])
            await loop.run_in_executor(None, router.set_serving_backends, [returned])

        status, cut = await _stream(url, fleet_acts)
        assert restarted, "the fleet never acted"
        assert status == 200, f"the client got {status} after {len(cut)} tokens"
        assert cut == whole
    finally:
        for e in {id(e): e for e in [*engines, *restarted]}.values():
            await e.stop()
