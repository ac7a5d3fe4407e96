"""The simulator's weight-loading routes against what vLLM 0.32 CPU was measured to do.

Real servers on 127.0.0.1 with OS-chosen ports, checkpoint directories under ``tmp_path`` (a
``config.json`` and a ``model.safetensors`` written by hand). The expected messages and states are the
ones a real vLLM 0.32 CPU engine gave (the tiny test model): a failed call fails alone, a failed reload
or an open weight update leaves the weights detached (checksums fail, ``/health`` still 200), the next
generation step kills the engine core (vLLM's EngineCore 500, ``/health`` 503) and the server exits.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from launcher.engines.sim import SimConfig, SimServer
from launcher.engines.sim.core import ENGINE_DEAD
from tests.support.checkpoints import broken, checkpoint

MakeServer = Callable[..., Awaitable[SimServer]]
COMPLETIONS = "/v1/completions"
RPC = "/collective_rpc"
NOT_CONFIGURED = (
    "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer."
)
NCCL = {"backend": "nccl"}
INIT_INFO = {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 2}


def worker_failed(message: str, method: str = "collective_rpc") -> str:
    return (
        f"Call to {method} method failed: Worker failed with error '{message}', "
        "please check the stack trace above for the root cause"
    )


async def call(
    http: aiohttp.ClientSession, method: str, url: str, body: Any = None, *, data: bytes | None = None
) -> tuple[int, Any]:
    kw: dict[str, Any] = {"data": data} if data is not None else ({"json": body} if body is not None else {})
    async with http.request(method, url, **kw) as r:
        raw = await r.read()
        return r.status, (orjson.loads(raw) if raw else None)


async def reload(http: aiohttp.ClientSession, s: SimServer, path: Path | str) -> tuple[int, Any]:
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
    return await call(http, "POST", s.url + RPC, body)


async def checksums(http: aiohttp.ClientSession, s: SimServer) -> tuple[int, Any]:
    return await call(http, "POST", s.url + "/weight_checker", {"action": "checksum"})


async def generate(http: aiohttp.ClientSession, s: SimServer, prompt: str = "hello world") -> tuple[int, Any]:
    return await call(
        http, "POST", s.url + COMPLETIONS, {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    )


def message(body: Any) -> str:
    return str(body["error"]["message"])


async def test_a_reload_changes_checksums_and_output_but_not_the_version(
    make_server: MakeServer, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    e1, e2, untouched = await make_server(), await make_server(), await make_server()
    a, b = checkpoint(tmp_path, "a", b"a"), checkpoint(tmp_path, "b", b"b")
    _, before = checksums_ = await checksums(http, e1)
    assert checksums_[0] == 200
    _, out_before = await generate(http, e1)
    assert await reload(http, e1, a) == (200, {"results": [None]})
    assert await reload(http, e2, a) == (200, {"results": [None]})
    (_, c1), (_, c2) = await checksums(http, e1), await checksums(http, e2)
    assert c1 == c2 and c1["checksums"].keys() == before["checksums"].keys()
    assert all(c1["checksums"][k] != v for k, v in before["checksums"].items())
    assert await call(http, "GET", e1.url + "/weight_info") == (200, {"weight_version": "default"})
    (_, g1), (_, g2), (_, g0) = (
        await generate(http, e1),
        await generate(http, e2),
        await generate(http, untouched),
    )
    text = [g["choices"][0]["text"] for g in (g1, g2, g0)]
    assert text[0] == text[1] != text[2] == out_before["choices"][0]["text"]  # the weights decide the output
    assert await reload(http, e2, b) == (200, {"results": [None]})
    assert (await checksums(http, e2))[1] != c1
    assert (await generate(http, e2))[1]["choices"][0]["text"] != text[0]


async def test_an_engine_started_on_a_directory_agrees_with_one_that_reloaded_it(
    make_server: MakeServer, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    a, b = checkpoint(tmp_path, "a", b"a"), checkpoint(tmp_path, "b", b"b")
    on_a = await make_server(SimConfig(speed=20.0, model_path=str(a)))
    plain = await make_server()
    assert await reload(http, plain, a) == (200, {"results": [None]})
    assert (await checksums(http, on_a))[1] == (await checksums(http, plain))[1]
    # Without weights_path vLLM reloads from the last path it was given (at first, the served model's).
    assert await reload(http, on_a, b) == (200, {"results": [None]})
    assert await call(http, "POST", on_a.url + RPC, {"method": "reload_weights"}) == (
        200,
        {"results": [None]},
    )
    assert (await checksums(http, on_a))[1] != (await checksums(http, plain))[1]
    with pytest.raises(ValueError, match="header too large"):
        await SimServer(SimConfig(model_path=str(broken(tmp_path, "bad")))).start()


async def test_the_reload_delay_holds_the_engine_core(
    make_server: MakeServer, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    s = await make_server(SimConfig(speed=20.0, reload_delay_s=10.0))  # 0.5 s at speed 20
    a = checkpoint(tmp_path, "a")
    t0 = time.perf_counter()
    loading = asyncio.create_task(reload(http, s, a))
    await asyncio.sleep(0.1)
    status, _ = await generate(http, s)  # no step runs while the core loads
    took_gen = time.perf_counter() - t0
    assert await loading == (200, {"results": [None]})
    took = time.perf_counter() - t0
    assert status == 200 and 0.45 < took < 3.0 and took_gen > 0.4, (took, took_gen)
    # A broken directory fails at its header, before the load.
    t0 = time.perf_counter()
    status, _ = await reload(http, s, broken(tmp_path, "bad"))
    assert status == 500 and time.perf_counter() - t0 < 0.4


async def test_a_broken_directory_detaches_the_weights_and_the_next_step_kills_the_core(
    make_server: MakeServer, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    s = await make_server(SimConfig(speed=20.0, keep_alive_on_engine_death=True))
    status, body = await reload(http, s, broken(tmp_path, "bad"))
    assert status == 500 and body == {
        "error": {
            "message": worker_failed("Error while deserializing header: header too large"),
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    # Detached, not dead: /health 200, the version readable, the checksums not.
    assert (await call(http, "GET", s.url + "/health"))[0] == 200
    assert await call(http, "GET", s.url + "/weight_info") == (200, {"weight_version": "default"})
    status, body = await checksums(http, s)
    assert status == 500
    assert message(body) == worker_failed(
        "Cannot copy out of meta tensor; no data!", "compute_weight_checksums"
    )
    # The first generation step crashes the worker: vLLM's EngineCore 500 after engine_death_s.
    status, body = await generate(http, s)
    assert status == 500 and body["error"] == {
        "message": ENGINE_DEAD,
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
    assert (await call(http, "GET", s.url + "/health"))[0] == 503
    for method, path, payload in (
        ("POST", COMPLETIONS, {"prompt": "x", "max_tokens": 2}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
        (
            "POST",
            RPC,
            {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint(tmp_path, "a"))}},
        ),
        ("POST", "/weight_checker", {"action": "checksum"}),
        ("GET", "/weight_info", None),
        ("POST", "/update_weight_version", {"new_version": "v1"}),
        ("POST", "/start_weight_update", None),
        ("POST", "/finish_weight_update", {"weight_version": "v1"}),
        ("POST", "/reset_prefix_cache", None),
    ):
        status, body = await call(http, method, s.url + path, payload)
        assert status == 500 and message(body) == ENGINE_DEAD, (path, body)
    assert await call(http, "GET", s.url + "/is_paused") == (
        500,
        {"error": f"Failed to fetch pause status: {ENGINE_DEAD}"},
    )
    for path in ("/v1/models", "/get_world_size", "/server_info?config_format=json"):
        assert (await call(http, "GET", s.url + path))[0] == 200, path  # the HTTP server's own state
    assert (await call(http, "GET", s.url + "/health"))[0] == 503 and not s.exited.is_set()


async def test_after_the_core_died_the_server_exits_and_a_restart_brings_it_back(
    make_server: MakeServer, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    s = await make_server()
    _, initial = await checksums(http, s)
    assert (await call(http, "POST", s.url + "/update_weight_version", {"new_version": "v3"}))[0] == 200
    assert (await reload(http, s, tmp_path / "missing"))[0] == 500
    assert (await generate(http, s))[1]["error"]["message"] == ENGINE_DEAD
    await asyncio.wait_for(s.exited.wait(), 2.0)
    with pytest.raises(aiohttp.ClientConnectionError):
        await call(http, "GET", s.url + "/health")
    await s.set_fault("none")  # the engine host restarts it: the served model, version "default"
    assert (await call(http, "GET", s.url + "/health"))[0] == 200
    assert await checksums(http, s) == (200, initial)
    assert await call(http, "GET", s.url + "/weight_info") == (200, {"weight_version": "default"})
    assert (await generate(http, s))[0] == 200


async def test_a_failed_reload_with_requests_running_kills_the_core_under_them(
    make_server: MakeServer, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    s = await make_server(SimConfig(speed=1.0, keep_alive_on_engine_death=True, engine_death_s=0.2))
    body = {"prompt": "long", "max_tokens": 2000, "stream": True}
    async with http.post(s.url + COMPLETIONS, json=body) as r:
        assert r.status == 200
        await r.content.readline()  # the stream is under way
        assert (await reload(http, s, broken(tmp_path, "bad")))[0] == 500  # no pause first
        raw = (await r.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert orjson.loads(events[-2][6:])["error"]["message"] == ENGINE_DEAD  # vLLM's error event
    assert (await call(http, "GET", s.url + "/health"))[0] == 503


async def test_missing_and_empty_directories_fail_like_vllm_and_a_good_reload_repairs(
    make_server: MakeServer, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    s = await make_server()
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    status, body = await reload(http, s, tmp_path / "missing")
    # vLLM takes a path that is no directory for a Hugging Face repo id; its error hides the path.
    assert status == 500 and message(body) == worker_failed(
        "Repo id must be in the form 'repo_name' or 'namespace/repo_name': '<path>'. "
        "Use `repo_type` argument if needed."
    )
    status, body = await reload(http, s, empty)
    assert status == 500 and message(body) == worker_failed("Cannot find any model weights with `<path>`")
    assert (await checksums(http, s))[0] == 500  # still detached
    assert await reload(http, s, checkpoint(tmp_path, "a")) == (200, {"results": [None]})
    assert (await checksums(http, s))[0] == 200 and (await generate(http, s))[0] == 200


async def test_collective_rpc_validates_like_vllm_and_a_failed_method_fails_alone(
    make_server: MakeServer, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    s = await make_server(SimConfig(speed=20.0, world_size=2))
    url = s.url + RPC
    bad = {"type": "Bad Request", "param": None, "code": 400}
    assert await call(http, "POST", url, data=b"") == (
        400,
        {"error": {"message": "JSON decode error: Expecting value: line 1 column 1 (char 0)", **bad}},
    )
    assert (await call(http, "POST", url, data=b"{x"))[1]["error"]["message"].startswith(
        "JSON decode error: "
    )
    assert await call(http, "POST", url, []) == (
        400,
        {"error": {"message": "Request body must be a JSON object", **bad}},
    )
    assert await call(http, "POST", url, {}) == (
        400,
        {"error": {"message": "Missing 'method' in request body", **bad}},
    )
    status, body = await call(http, "POST", url, {"method": "no_such_method"})
    assert status == 500 and message(body) == worker_failed(
        "'CPUWorker' object has no attribute 'no_such_method'"
    )
    status, body = await call(http, "POST", url, {"method": "reload_weights", "kwargs": {"bogus": 1}})
    assert message(body) == worker_failed(
        "GPUModelRunner.reload_weights() got an unexpected keyword argument 'bogus'"
    )
    assert await call(http, "POST", url, {"method": "check_health"}) == (200, {"results": [None, None]})
    # None of these touched the weights: the engine serves on.
    assert (await checksums(http, s))[0] == 200 and (await generate(http, s))[0] == 200
    assert (await call(http, "GET", s.url + "/health"))[0] == 200


async def test_weight_transfer_routes_without_a_transfer_config(
    make_server: MakeServer, http: aiohttp.ClientSession
) -> None:
    s = await make_server()
    for path, payload in (
        ("/init_weight_transfer_engine", {"init_info": INIT_INFO}),
        ("/start_weight_update", None),
        ("/update_weights", {"update_info": {"names": [], "dtype_names": [], "shapes": []}}),
        ("/finish_weight_update", {"weight_version": "v9"}),
        ("/finish_weight_update", None),
    ):
        status, body = await call(http, "POST", s.url + path, payload)
        assert status == 500 and message(body) == worker_failed(NOT_CONFIGURED), (path, body)
    assert await call(http, "POST", s.url + "/shutdown_weight_transfer_engine") == (
        200,
        {"message": "Weight transfer shut down"},
    )
    status, body = await call(http, "POST", s.url + "/init_weight_transfer_engine", {})
    assert status == 400 and body["error"] == {
        "message": "1 validation error:\n  {'type': 'missing', 'loc': 'body.init_info', "
        "'msg': 'Field required', 'input': 'None'}",
        "type": "Bad Request",
        "param": "body.init_info",
        "code": 400,
    }
    status, body = await call(http, "POST", s.url + "/update_weights", {"update_info": 5})
    assert status == 400 and message(body).startswith("2 validation errors:\n  {'type': 'dict_type'")
    status, body = await call(http, "POST", s.url + "/finish_weight_update", {"weight_version": 5})
    assert (
        status == 400 and body["error"]["param"] == "body.weight_version" and "string_type" in message(body)
    )
    assert await call(http, "GET", s.url + "/weight_info") == (200, {"weight_version": "default"})
    assert (await generate(http, s))[0] == 200


async def test_weight_transfer_routes_with_nccl_on_a_cpu_engine(
    make_server: MakeServer, http: aiohttp.ClientSession
) -> None:
    s = await make_server(SimConfig(speed=20.0, weight_transfer_config=NCCL, keep_alive_on_engine_death=True))
    post = lambda path, payload=None: call(http, "POST", s.url + path, payload)  # noqa: E731
    _, initial = await checksums(http, s)
    status, body = await post("/init_weight_transfer_engine", {"init_info": INIT_INFO})
    assert status == 500 and message(body) == worker_failed(
        "Cannot access accelerator device when none is available."
    )
    status, body = await post("/init_weight_transfer_engine", {"init_info": {}})
    assert message(body) == worker_failed(
        "Invalid init_info for NCCLWeightTransferEngine: NCCLWeightTransferInitInfo.__init__() missing 2 "
        "required keyword-only arguments: 'rank_offset' and 'world_size'"
    )
    assert (await generate(http, s))[0] == 200  # a failed init fails alone
    updates = {"update_info": {"names": [], "dtype_names": [], "shapes": []}}
    assert message((await post("/update_weights", updates))[1]) == worker_failed(
        "start_weight_update must be called before update_weights."
    )
    assert message((await post("/finish_weight_update", {"weight_version": "v9"}))[1]) == worker_failed(
        "finish_weight_update called without a matching start_weight_update."
    )
    # start -> finish: the weights come back unchanged, the version is stamped.
    assert await post("/start_weight_update") == (200, {"message": "Weight update started"})
    assert message((await post("/start_weight_update"))[1]) == worker_failed(
        "start_weight_update called while a weight update is already active. Call finish_weight_update first."
    )
    assert message((await post("/shutdown_weight_transfer_engine"))[1]) == worker_failed(
        "Cannot release a trainer connection during a weight update"
    )
    assert (await checksums(http, s))[0] == 500  # detached during the update
    assert await post("/finish_weight_update", {"weight_version": "v9"}) == (
        200,
        {"message": "Weight update finished"},
    )
    assert await call(http, "GET", s.url + "/weight_info") == (200, {"weight_version": "v9"})
    assert await checksums(http, s) == (200, initial)
    assert (await generate(http, s))[0] == 200
    # No weights can arrive on a CPU engine: the update fails, ends, and leaves the weights detached.
    assert (await post("/start_weight_update"))[0] == 200
    assert message((await post("/update_weights", updates))[1]) == worker_failed(
        "NCCL weight transfer not initialized. Call init_transfer_engine() first."
    )
    assert (await post("/finish_weight_update"))[0] == 500
    assert (await call(http, "GET", s.url + "/health"))[0] == 200
    assert (await generate(http, s))[1]["error"]["message"] == ENGINE_DEAD
    assert (await call(http, "GET", s.url + "/health"))[0] == 503


async def test_world_size_server_info_and_models_root(
    make_server: MakeServer, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    a = checkpoint(tmp_path, "a")
    plain = await make_server()
    s = await make_server(SimConfig(speed=20.0, world_size=2, data_parallel_size=3, model_path=str(a)))
    nccl = await make_server(SimConfig(speed=20.0, weight_transfer_config={}))
    assert await call(http, "GET", plain.url + "/get_world_size") == (200, {"world_size": 1})
    assert await call(http, "GET", s.url + "/get_world_size") == (200, {"world_size": 6})
    assert await call(http, "GET", s.url + "/get_world_size?include_dp=false") == (200, {"world_size": 2})
    status, body = await call(http, "GET", s.url + "/get_world_size?include_dp=maybe")
    assert status == 400 and body["error"]["param"] == "query.include_dp" and "bool_parsing" in message(body)
    infos = []
    for e in (plain, s, nccl):
        status, info = await call(http, "GET", e.url + "/server_info?config_format=json")
        assert status == 200 and set(info) == {"vllm_config", "vllm_env", "system_env"}
        infos.append(info["vllm_config"])
    for c in infos:
        assert c["device_config"]["device"] == "cpu"
    assert infos[0]["weight_transfer_config"] is None and infos[2]["weight_transfer_config"] == NCCL
    par = infos[1]["parallel_config"]
    assert (par["tensor_parallel_size"], par["pipeline_parallel_size"], par["world_size"]) == (2, 1, 2)
    assert par["data_parallel_size"] == 3
    assert infos[1]["model_config"]["model"] == str(a) and infos[0]["model_config"]["model"] == "sim"
    assert infos[1]["model_config"]["served_model_name"] == "sim"
    status, text = await call(http, "GET", s.url + "/server_info")
    assert status == 200 and isinstance(text["vllm_config"], str) and str(a) in text["vllm_config"]
    status, body = await call(http, "GET", s.url + "/server_info?config_format=yaml")
    assert status == 400 and body["error"]["param"] == "query.config_format"
    for e, root in ((plain, "sim"), (s, str(a))):
        status, models = await call(http, "GET", e.url + "/v1/models")
        assert status == 200 and models["data"][0]["root"] == root and models["data"][0]["id"] == "sim"
    # A reload does not change what the HTTP server says it loaded (vLLM's copy of the config).
    assert (await reload(http, plain, a))[0] == 200
    assert (await call(http, "GET", plain.url + "/v1/models"))[1]["data"][0]["root"] == "sim"


NEW_ROUTES = (
    ("POST", RPC, {"method": "check_health"}),
    ("POST", "/init_weight_transfer_engine", {"init_info": INIT_INFO}),
    ("POST", "/start_weight_update", None),
    ("POST", "/update_weights", {"update_info": {}}),
    ("POST", "/finish_weight_update", None),
    ("POST", "/shutdown_weight_transfer_engine", None),
    ("GET", "/get_world_size", None),
    ("GET", "/server_info", None),
)


async def test_the_key_guard_covers_the_weight_routes(
    make_server: MakeServer, http: aiohttp.ClientSession
) -> None:
    guarded = await make_server(api_key="k3y", key_guard=True)
    plain = await make_server(api_key="k3y")  # vLLM's own check: /v1 only, the dev routes answer anyone
    key = {"Authorization": "Bearer k3y"}
    for method, path, payload in NEW_ROUTES:
        async with http.request(method, guarded.url + path, json=payload) as r:
            assert r.status == 401, path
        async with http.request(method, guarded.url + path, json=payload, headers=key) as r:
            assert r.status != 401, path
        async with http.request(method, plain.url + path, json=payload) as r:
            assert r.status != 401, path
    async with http.get(plain.url + "/v1/models") as r:
        assert r.status == 401


def test_the_command_line_takes_the_flags_and_exits_when_its_engine_core_died(tmp_path: Path) -> None:
    url_file = tmp_path / "urls"
    bad = broken(tmp_path, "bad")
    cmd = [
        sys.executable,
        "-m",
        "launcher.engines.sim",
        "--url-file",
        str(url_file),
        "--speed",
        "20",
        "--weight-transfer-config",
        '{"backend": "nccl"}',
        "--world-size",
        "4",
        "--reload-delay-s",
        "1",
    ]
    log = (tmp_path / "sim.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(300):
            if url_file.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        url = url_file.read_text().split()[0]

        async def drive() -> None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as h:
                _, info = await call(h, "GET", url + "/server_info?config_format=json")
                assert info["vllm_config"]["weight_transfer_config"] == NCCL
                assert await call(h, "GET", url + "/get_world_size") == (200, {"world_size": 4})
                body = {"method": "reload_weights", "kwargs": {"weights_path": str(bad)}}
                assert (await call(h, "POST", url + RPC, body))[0] == 500
                status, answer = await call(h, "POST", url + COMPLETIONS, {"prompt": "x", "max_tokens": 2})
                assert status == 500 and message(answer) == ENGINE_DEAD

        asyncio.run(drive())
        assert proc.wait(timeout=10) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert "EngineCore died" in (tmp_path / "sim.log").read_text()
