"""The vLLM-compatible simulator: timing model, KV-bound admission, faults, wire shapes, processes, fleets.

Real servers on 127.0.0.1 with OS-chosen ports; engines run at high ``speed`` so the file stays well
under a minute on two busy cores. Timing assertions compare runs with wide margins (several-fold
modelled differences), never absolute wall-clock figures.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launcher.engines.base import EngineSpec, EngineStartError
from launcher.engines.sim import FaultSpec, SimConfig, SimEngine, SimFleet, SimServer
from launcher.engines.sim.tokens import decode, encode

CHAT = "/v1/chat/completions"
SYSTEM = "You are a careful coding agent. " * 500  # ~16 kB: ~4000 tokens of shared prefix

MakeServer = Callable[..., Awaitable[SimServer]]


def chat_body(messages: list[dict[str, Any]], max_tokens: int = 4, **kw: Any) -> dict[str, Any]:
    return {"model": "sim", "messages": messages, "max_tokens": max_tokens, **kw}


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], **kw: Any) -> tuple[int, Any]:
    async with http.post(url, json=body, **kw) as r:
        return r.status, orjson.loads(await r.read())


async def timed_chat(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    status, j = await post(http, url + CHAT, body)
    assert status == 200, j
    return time.perf_counter() - t0, j


async def scrape(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Metric samples by name, summed over labels (every sample must carry ``model_name``)."""
    async with http.get(url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            assert s.labels.get("model_name") == "sim", s
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def eventually(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``cond`` (bounded in time) until true."""
    for _ in range(int(timeout_s / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    assert cond()


async def sse_events(resp: aiohttp.ClientResponse) -> list[Any]:
    raw = (await resp.read()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [orjson.loads(e[6:]) for e in events[:-1]]


# -- timing model ------------------------------------------------------------------------------------
async def test_second_turn_reuses_prefix_and_is_faster(
    make_server: MakeServer, http: aiohttp.ClientSession
) -> None:
    s = await make_server(SimConfig(speed=2.0))
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the bug."}]
    t_cold, r1 = await timed_chat(http, s.url, chat_body(turn1, 40))
    before = await scrape(http, s.url)
    reply = r1["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "Now test it."}]
    t_warm, r2 = await timed_chat(http, s.url, chat_body(turn2, 2))
    after = await scrape(http, s.url)

    p1, n1 = r1["usage"]["prompt_tokens"], r1["usage"]["completion_tokens"]
    assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # Every full block of turn 1's computed sequence (prompt + all output but the last sampled token)
    # is reused, including blocks made of generated tokens.
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == (p1 + n1 - 1) // 16 * 16 > p1
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] > p1 - 16
    assert (
        after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
        == r2["usage"]["prompt_tokens"]
    )
    # Cold: ~4000 prefill tokens (~150 ms at speed 2); warm: a few dozen, ~8 ms in all.
    assert t_warm < t_cold / 2, (t_warm, t_cold)
    # A cold prompt of the same size is slow again.
    other = [{"role": "system", "content": SYSTEM.upper()}, {"role": "user", "content": "Fix the bug."}]
    t_other, r3 = await timed_chat(http, s.url, chat_body(other, 2))
    assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert t_warm < t_other / 2, (t_warm, t_other)


async def test_kv_bound_admission_queues(make_server: MakeServer, http: aiohttp.ClientSession) -> None:
    # 16 blocks = 256 tokens: each request needs ~10 blocks at admission, so only one runs at a time.
    s = await make_server(SimConfig(speed=5.0, num_gpu_blocks=16))
    bodies = [{"prompt": f"{i:03d}" + "x" * 600, "max_tokens": 40} for i in range(4)]
    tasks = [asyncio.create_task(post(http, s.url + "/v1/completions", b)) for b in bodies]
    max_waiting = max_running = 0.0
    deadline = time.monotonic() + 10
    while not all(t.done() for t in tasks) and time.monotonic() < deadline:
        m = await scrape(http, s.url)
        max_waiting = max(max_waiting, m["vllm:num_requests_waiting"])
        max_running = max(max_running, m["vllm:num_requests_running"])
        assert m["vllm:kv_cache_usage_perc"] <= 1.0
        await asyncio.sleep(0.005)
    results = await asyncio.gather(*tasks)
    assert all(st == 200 and j["usage"]["completion_tokens"] == 40 for st, j in results)
    assert max_waiting > 0
    assert max_running == 1
    # A request that could never fit, even alone, is refused rather than blocking the queue forever.
    status, j = await post(http, s.url + "/v1/completions", {"prompt": "y" * 1200, "max_tokens": 10})
    assert status == 400 and j["error"]["code"] == 400


async def test_decode_growth_preempts_instead_of_deadlocking(
    make_server: MakeServer, http: aiohttp.ClientSession
) -> None:
    # Two requests of 3 prompt blocks fit 8 blocks, but growing to 5 blocks each does not.
    s = await make_server(SimConfig(speed=20.0, num_gpu_blocks=8))
    bodies = [{"prompt": f"{i}" + "z" * 159, "max_tokens": 40} for i in range(2)]
    results = await asyncio.wait_for(
        asyncio.gather(*(post(http, s.url + "/v1/completions", b) for b in bodies)), 10
    )
    assert all(st == 200 and j["usage"]["completion_tokens"] == 40 for st, j in results)
    assert s.stats.preemptions >= 1
    assert s.scheduler.pool.num_used == 0


# -- faults -----------------------------------------------------------------------------------------
async def test_fault_kill_refuses_and_resets_then_revives(
    make_server: MakeServer, http: aiohttp.ClientSession
) -> None:
    s = await make_server(SimConfig(speed=5.0))
    long_body = chat_body([{"role": "user", "content": "hi"}], 400)
    inflight = asyncio.create_task(post(http, s.url + CHAT, long_body))
    await asyncio.sleep(0.1)
    assert not inflight.done()
    await s.set_fault("kill")
    with pytest.raises(aiohttp.ClientError):  # reset mid-request, not a clean HTTP error
        await inflight
    with pytest.raises(aiohttp.ClientConnectorError):
        await http.get(s.url + "/health")
    assert s.scheduler.pool.num_used == 0
    await s.set_fault("none")
    async with http.get(s.url + "/health") as r:
        assert r.status == 200
    # Over HTTP, with an automatic restart: the admin call still gets its answer.
    status, j = await post(http, s.url + "/sim/fault", {"mode": "kill", "revive_after_s": 0.3})
    assert status == 200 and j["fault"]["mode"] == "kill"
    with pytest.raises(aiohttp.ClientConnectorError):
        await http.get(s.url + "/health")
    deadline = time.monotonic() + 5
    while True:
        try:
            async with http.get(s.url + "/health") as r:
                assert r.status == 200
                break
        except aiohttp.ClientConnectorError:
            assert time.monotonic() < deadline, "engine did not revive"
            await asyncio.sleep(0.05)
    assert s.fault.mode == "none"


async def test_fault_wedge_hangs_until_lifted(make_server: MakeServer, http: aiohttp.ClientSession) -> None:
    s = await make_server()
    short = aiohttp.ClientTimeout(total=0.3)
    status, _ = await post(http, s.url + "/sim/fault", {"mode": "wedge"})
    assert status == 200
    with pytest.raises(asyncio.TimeoutError):
        await http.get(s.url + "/health", timeout=short)
    with pytest.raises(asyncio.TimeoutError):
        await http.post(s.url + CHAT, json=chat_body([{"role": "user", "content": "hi"}]), timeout=short)
    # The variant that lies: liveness answers while generation hangs.
    status, _ = await post(http, s.url + "/sim/fault", {"mode": "wedge", "wedge_health": False})
    assert status == 200
    async with http.get(s.url + "/health", timeout=short) as r:
        assert r.status == 200
    with pytest.raises(asyncio.TimeoutError):
        await http.post(s.url + CHAT, json=chat_body([{"role": "user", "content": "hi"}]), timeout=short)
    status, _ = await post(http, s.url + "/sim/fault", {"mode": "none"})
    assert status == 200
    status, j = await post(http, s.url + CHAT, chat_body([{"role": "user", "content": "hi"}]))
    assert status == 200 and j["usage"]["completion_tokens"] == 4
    assert s.scheduler.pool.num_used == 0  # the timed-out requests were aborted, their KV freed


async def test_fault_slow_multiplies_step_time(make_server: MakeServer, http: aiohttp.ClientSession) -> None:
    s = await make_server(SimConfig(speed=5.0))
    body = chat_body([{"role": "user", "content": "count"}], 20)
    t_base, _ = await timed_chat(http, s.url, body)
    busy_base = s.stats.busy_s
    await s.set_fault(FaultSpec(mode="slow", slow_factor=10))
    t_slow, _ = await timed_chat(http, s.url, body)
    # The modelled step times grow exactly tenfold (the same request: the prompt is cached the second
    # time, which only makes the slow run cheaper); wall time never beats the model, so the slow run
    # takes at least ~20 steps x 12 ms while the normal one takes ~25 ms plus whatever a busy CPU adds.
    assert s.stats.busy_s - busy_base > 9 * busy_base * 0.9
    assert t_slow > 0.2 and t_slow > 2 * t_base, (t_base, t_slow)
    await s.set_fault("none")
    assert s.scheduler.slow_factor == 1.0


async def test_fault_error_rate(make_server: MakeServer, http: aiohttp.ClientSession) -> None:
    s = await make_server(SimConfig(speed=50.0))
    status, _ = await post(http, s.url + "/sim/fault", {"mode": "error", "error_rate": 0.3})
    assert status == 200
    body = {"prompt": "p", "max_tokens": 1}
    results = await asyncio.gather(*(post(http, s.url + "/v1/completions", body) for _ in range(100)))
    errors = [j for st, j in results if st == 500]
    assert all(st in (200, 500) for st, _ in results)
    assert 15 <= len(errors) <= 45, len(errors)
    assert errors[0]["error"]["code"] == 500 and errors[0]["error"]["type"] == "InternalServerError"
    async with http.post(s.url + "/tokenize", json={"prompt": "p"}) as r:  # not a generation route
        assert r.status == 200
    status, _ = await post(http, s.url + "/sim/fault", {"mode": "bogus"})
    assert status == 400


# -- wire shapes ------------------------------------------------------------------------------------
async def test_response_shapes_stream_and_not(make_server: MakeServer, http: aiohttp.ClientSession) -> None:
    s = await make_server()
    msgs = [{"role": "user", "content": "Say something."}]
    status, full = await post(
        http, s.url + CHAT, chat_body(msgs, 6, logprobs=True, top_logprobs=0, return_tokens_as_token_ids=True)
    )
    assert status == 200
    assert full["object"] == "chat.completion" and full["model"] == "sim"
    choice = full["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert len(choice["message"]["content"]) == 24  # 6 tokens of 4 bytes
    assert [e["token"].startswith("token_id:") for e in choice["logprobs"]["content"]] == [True] * 6
    u = full["usage"]
    assert u["completion_tokens"] == 6 and u["total_tokens"] == u["prompt_tokens"] + 6

    async with http.post(
        s.url + CHAT, json=chat_body(msgs, 6, stream=True, stream_options={"include_usage": True})
    ) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        events = await sse_events(r)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == choice["message"]["content"]  # deterministic output
    assert [e for e in events if e["choices"]][-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6

    status, comp = await post(http, s.url + "/v1/completions", {"prompt": "Once upon", "max_tokens": 5})
    assert status == 200 and comp["object"] == "text_completion"
    assert comp["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 8,
        "completion_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    async with http.post(
        s.url + "/v1/completions", json={"prompt": "Once upon", "max_tokens": 5, "stream": True}
    ) as r:
        events = await sse_events(r)
    assert "".join(e["choices"][0]["text"] for e in events) == comp["choices"][0]["text"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"

    status, j = await post(http, s.url + CHAT, {**chat_body(msgs), "model": "other"})
    assert status == 404
    status, j = await post(http, s.url + CHAT, chat_body(msgs, 40000))
    assert status == 400 and "maximum context length" in j["error"]["message"]
    async with http.get(s.url + "/v1/models") as r:
        models = await r.json()
    assert models["data"][0]["id"] == "sim" and models["data"][0]["max_model_len"] == 32768
    async with http.get(s.url + "/health") as r:
        assert r.status == 200 and await r.read() == b""


async def test_stream_disconnect_aborts_request(make_server: MakeServer, http: aiohttp.ClientSession) -> None:
    s = await make_server(SimConfig(speed=5.0))
    r = await http.post(s.url + CHAT, json=chat_body([{"role": "user", "content": "go"}], 2000, stream=True))
    await r.content.readline()
    r.close()
    await eventually(lambda: s.stats.aborted > 0)
    assert s.stats.aborted == 1
    assert not s.scheduler.running and s.scheduler.pool.num_used == 0


async def test_tokenize_and_detokenize(make_server: MakeServer, http: aiohttp.ClientSession) -> None:
    s = await make_server()
    status, j = await post(http, s.url + "/tokenize", {"model": "sim", "prompt": "abcdefghij"})
    assert status == 200 and j["count"] == 3 and len(j["tokens"]) == 3 and j["max_model_len"] == 32768
    status, again = await post(http, s.url + "/tokenize", {"prompt": "abcdefghij"})
    assert again["tokens"] == j["tokens"]
    status, d = await post(http, s.url + "/detokenize", {"tokens": j["tokens"]})
    assert d["prompt"] == "abcdefghij"
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "héllo"}]
    status, t = await post(http, s.url + "/tokenize", {"messages": msgs})
    status, c = await post(http, s.url + CHAT, chat_body(msgs))
    assert t["count"] == c["usage"]["prompt_tokens"]
    assert decode(encode("naïve ☃ text")) == "naïve ☃ text"


async def test_metrics_parse_with_vllm_names(make_server: MakeServer, http: aiohttp.ClientSession) -> None:
    s = await make_server()
    _, j = await post(http, s.url + CHAT, chat_body([{"role": "user", "content": "metrics"}], 7))
    m = await scrape(http, s.url)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
    ):
        assert name in m, name
    assert m["vllm:prompt_tokens_total"] == j["usage"]["prompt_tokens"]
    assert m["vllm:generation_tokens_total"] == 7
    assert m["vllm:request_success_total"] == 1
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0


async def test_api_key(make_server: MakeServer, http: aiohttp.ClientSession) -> None:
    s = await make_server(api_key="k3y")
    good = {"Authorization": "Bearer k3y"}
    for headers in ({}, {"Authorization": "Bearer nope"}):
        async with http.get(s.url + "/v1/models", headers=headers) as r:
            assert r.status == 401
        async with http.post(s.url + "/sim/fault", json={"mode": "kill"}, headers=headers) as r:
            assert r.status == 401
    async with http.get(s.url + "/v1/models", headers=good) as r:
        assert r.status == 200
    status, _ = await post(http, s.url + CHAT, chat_body([{"role": "user", "content": "x"}]), headers=good)
    assert status == 200
    for path in ("/health", "/metrics"):
        async with http.get(s.url + path) as r:
            assert r.status == 200


# -- processes and fleets ---------------------------------------------------------------------------
def _gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _get(url: str, headers: dict[str, str] | None = None) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


def test_sim_engine_subprocess_lifecycle(tmp_path: Any) -> None:
    spec = EngineSpec(
        model="sim-proc",
        api_key="s3cret",
        extra_args=["--speed", "20"],
        log_path=str(tmp_path / "sim.log"),
        startup_timeout_s=60,
    )
    eng = SimEngine(spec, engines=2)
    eng.start_and_wait()
    pid = eng.pid
    assert pid is not None
    try:
        assert eng.is_alive() and len(eng.urls) == 2 and eng.port > 0 and eng.url == eng.urls[0]
        assert eng.api_url == eng.url + "/v1"
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            assert b"s3cret" not in fh.read()  # the key travels by environment only
        for u in eng.urls:
            assert _get(u + "/health") == 200
            assert _get(u + "/v1/models") == 401
            assert _get(u + "/v1/models", {"Authorization": "Bearer s3cret"}) == 200
        assert "SIM_URL" in eng.log_tail()
    finally:
        eng.stop(grace_s=5)
    assert not eng.is_alive() and _gone(pid)
    eng.stop()  # idempotent


def test_sim_engine_startup_death_reports_log_tail(tmp_path: Any) -> None:
    spec = EngineSpec(
        model="sim-bad",
        extra_args=["--num-gpu-blocks", "0"],
        log_path=str(tmp_path / "bad.log"),
        startup_timeout_s=60,
    )
    eng = SimEngine(spec)
    with pytest.raises(EngineStartError, match="num_gpu_blocks"):
        eng.start_and_wait()
    assert not eng.is_alive()


async def test_fleet_of_16_in_one_process(http: aiohttp.ClientSession) -> None:
    fleet = SimFleet(16, SimConfig(speed=20.0))
    urls = await asyncio.to_thread(fleet.start)
    try:
        assert len(urls) == 16 and len(set(urls)) == 16
        assert all(u.startswith("http://127.0.0.1:") for u in urls)
        body = chat_body([{"role": "user", "content": "same everywhere"}], 8)
        results = await asyncio.gather(*(post(http, u + CHAT, body) for u in urls))
        texts = {j["choices"][0]["message"]["content"] for st, j in results if st == 200}
        assert len(texts) == 1  # routing never changes what a request generates
        await asyncio.to_thread(fleet.set_fault, 3, "kill")
        with pytest.raises(aiohttp.ClientConnectorError):
            await http.get(urls[3] + "/health")
        async with http.get(urls[4] + "/health") as r:
            assert r.status == 200
        stats = await asyncio.to_thread(fleet.stats)
        assert sum(st["generation_tokens"] for st in stats) == 16 * 8
    finally:
        await asyncio.to_thread(fleet.stop)
    with pytest.raises(aiohttp.ClientConnectorError):
        await http.get(urls[0] + "/health")


async def test_fleet_in_running_loop(http: aiohttp.ClientSession) -> None:
    async with SimFleet(2, SimConfig(speed=20.0), fault=FaultSpec(mode="error", error_rate=1.0)) as fleet:
        status, _ = await post(http, fleet.urls[0] + "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 500
        await fleet.aset_fault(1, "none")
        status, _ = await post(http, fleet.urls[1] + "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 200
