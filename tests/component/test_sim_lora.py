"""The simulator's runtime LoRA routes against what vLLM 0.32 CPU was measured to answer
(``--enable-lora --max-loras 2 --max-lora-rank 8 --max-cpu-loras 4``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``).

Real servers on 127.0.0.1 with OS-chosen ports, adapter directories under ``tmp_path``
(``tests.support.adapters``). The router's adapter table is built on these answers, including what vLLM
does not protect (names beyond ``--max-cpu-loras`` are registered).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from launcher.engines.sim import SimConfig, SimServer
from tests.support.adapters import write_adapter

MakeServer = Callable[..., Awaitable[SimServer]]
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


def lora_config(**more: Any) -> SimConfig:
    """The measured engine's flags and environment, served as ``tiny``."""
    options: dict[str, Any] = {
        "speed": 20.0,
        "model_name": "tiny",
        "enable_lora": True,
        "max_loras": 2,
        "max_lora_rank": 8,
        "max_cpu_loras": 4,
        "allow_runtime_lora_updating": True,
    }
    return SimConfig(**{**options, **more})


async def call(http: aiohttp.ClientSession, method: str, url: str, body: Any = None) -> tuple[int, Any]:
    async with http.request(method, url, json=body) as r:
        raw = await r.read()
        if r.content_type == "application/json":
            return r.status, orjson.loads(raw)
        return r.status, raw.decode()


async def load(http: aiohttp.ClientSession, s: SimServer, name: str, path: Path | str) -> tuple[int, Any]:
    return await call(http, "POST", s.url + LOAD, {"lora_name": name, "lora_path": str(path)})


async def complete(http: aiohttp.ClientSession, s: SimServer, model: str) -> tuple[int, Any]:
    body = {"model": model, "prompt": "hello world", "max_tokens": 8, "temperature": 0}
    return await call(http, "POST", s.url + "/v1/completions", body)


def error(status: int, message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def worker_failed(message: str) -> str:
    return (
        f"Call to add_lora method failed: Worker failed with error '{message}', "
        "please check the stack trace above for the root cause"
    )


async def test_load_serve_and_unload_answer_as_vllm(
    make_server: MakeServer, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    s = await make_server(lora_config())
    a, b = write_adapter(tmp_path / "ad1", fill=b"a"), write_adapter(tmp_path / "ad2", fill=b"b")
    assert await load(http, s, "a@v1", a) == (200, "Success: LoRA adapter 'a@v1' added successfully.")
    assert await load(http, s, "b@v1", b) == (200, "Success: LoRA adapter 'b@v1' added successfully.")
    assert await load(http, s, "a@v1", a) == (
        400,
        error(
            400,
            "The lora adapter 'a@v1' has already been loaded. If you want to load the adapter in place, "
            "set 'load_inplace' to True.",
            "InvalidUserInput",
        ),
    )
    status, models = await call(http, "GET", s.url + "/v1/models")
    cards = {m["id"]: m for m in models["data"]}
    assert status == 200 and list(cards) == ["tiny", "a@v1", "b@v1"]
    assert cards["a@v1"]["root"] == str(a) and cards["a@v1"]["parent"] == "tiny"
    assert cards["a@v1"]["object"] == "model" and cards["tiny"]["parent"] is None

    answers = {m: await complete(http, s, m) for m in ("tiny", "a@v1", "b@v1")}
    assert all(status == 200 for status, _ in answers.values())
    assert {m: body["model"] for m, (_, body) in answers.items()} == {m: m for m in answers}
    texts = {body["choices"][0]["text"] for _, body in answers.values()}
    assert len(texts) == 3  # the base model and each adapter answer differently
    assert (await complete(http, s, "a@v1"))[1]["choices"][0]["text"] == answers["a@v1"][1]["choices"][0][
        "text"
    ]
    chat = {"model": "b@v1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    status, body = await call(http, "POST", s.url + "/v1/chat/completions", chat)
    assert status == 200 and body["model"] == "b@v1"

    assert await complete(http, s, "zz") == (
        404,
        {
            "error": {
                "message": "The model `zz` does not exist. Valid aliases: tiny.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
        },
    )
    unload = {"lora_name": "a@v1"}
    assert await call(http, "POST", s.url + UNLOAD, unload) == (
        200,
        "Success: LoRA adapter 'a@v1' removed successfully.",
    )
    assert await call(http, "POST", s.url + UNLOAD, unload) == (
        404,
        error(404, "The lora adapter 'a@v1' cannot be found.", "NotFoundError"),
    )
    assert (await complete(http, s, "a@v1"))[0] == 404
    assert [m["id"] for m in (await call(http, "GET", s.url + "/v1/models"))[1]["data"]] == ["tiny", "b@v1"]


async def test_failed_loads_fail_alone_and_the_engine_serves_on(
    make_server: MakeServer, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    s = await make_server(lora_config())
    assert (await load(http, s, "ok@v1", write_adapter(tmp_path / "ok")))[0] == 200
    assert await load(http, s, "big@v1", write_adapter(tmp_path / "big", rank=16)) == (
        500,
        error(500, worker_failed("LoRA rank 16 is greater than max_lora_rank 8."), "InternalServerError"),
    )
    pattern = write_adapter(tmp_path / "pattern", rank=8, rank_pattern={"q_proj": 32})
    assert (await load(http, s, "pattern@v1", pattern))[1]["error"]["message"] == worker_failed(
        "LoRA rank 32 is greater than max_lora_rank 8."
    )
    assert await load(http, s, "d@v1", tmp_path / "missing") == (
        404,
        error(404, "Loading lora d@v1 failed: No adapter found for <path>", "NotFoundError"),
    )
    assert await load(http, s, "bad@v1", write_adapter(tmp_path / "bad", broken=True)) == (
        500,
        error(
            500, worker_failed("Error while deserializing header: header too large"), "InternalServerError"
        ),
    )
    assert (await call(http, "GET", s.url + "/health"))[0] == 200
    assert (await complete(http, s, "ok@v1"))[1]["model"] == "ok@v1"
    ids = [m["id"] for m in (await call(http, "GET", s.url + "/v1/models"))[1]["data"]]
    assert ids == ["tiny", "ok@v1"]  # none of the failed names was registered
    # a failed name may be loaded once its directory is right
    assert (await load(http, s, "d@v1", write_adapter(tmp_path / "missing")))[0] == 200


async def test_names_beyond_max_cpu_loras_are_registered_and_an_evicted_one_reloads_from_its_directory(
    make_server: MakeServer, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    s = await make_server(lora_config())
    dirs = [write_adapter(tmp_path / f"ad{i}", fill=bytes([97 + i])) for i in range(6)]
    for i, d in enumerate(dirs):
        assert (await load(http, s, f"a{i}@v1", d))[0] == 200  # 6 names with --max-cpu-loras 4
    ids = [m["id"] for m in (await call(http, "GET", s.url + "/v1/models"))[1]["data"]]
    assert ids == ["tiny", *(f"a{i}@v1" for i in range(6))]
    first = await complete(http, s, "a0@v1")  # evicted (least recently used): reloaded from ad0
    assert first[0] == 200 and first[1]["model"] == "a0@v1"
    # a1 is evicted too; its directory deleted under it, its next request fails (the name stays)
    for f in dirs[1].iterdir():
        f.unlink()
    dirs[1].rmdir()
    status, body = await complete(http, s, "a1@v1")
    assert status == 500 and "No adapter found" in body["error"]["message"]
    assert (await complete(http, s, "a5@v1"))[0] == 200  # still loaded: its files are not read again


async def test_the_routes_are_mounted_only_with_the_flags_and_the_variable(
    make_server: MakeServer, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    ad = write_adapter(tmp_path / "ad")
    for config in (
        lora_config(enable_lora=False),
        lora_config(allow_runtime_lora_updating=False),
        SimConfig(speed=20.0, model_name="tiny"),
    ):
        s = await make_server(config)
        assert (await load(http, s, "a@v1", ad))[0] == 404
        assert (await call(http, "POST", s.url + UNLOAD, {"lora_name": "a@v1"}))[0] == 404
        assert (await complete(http, s, "a@v1"))[0] == 404


async def test_the_metrics_name_the_adapters_with_requests(
    make_server: MakeServer, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    s = await make_server(lora_config())
    assert (await load(http, s, "a@v1", write_adapter(tmp_path / "ad")))[0] == 200
    metrics = (await call(http, "GET", s.url + "/metrics"))[1]
    assert (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics
    )


def test_the_command_line_takes_vllms_flags_and_its_variable(tmp_path: Path) -> None:
    """``python -m launcher.engines.sim`` with the flags ``LoraPlan.engine_flags`` gives vLLM, and the
    variable from its environment (no flag): the routes answer only with both."""
    from router.adapters.plan import RUNTIME_LORA_ENV, LoraPlan

    flags = LoraPlan(max_adapters=2, max_lora_rank=8).engine_flags()
    ad = write_adapter(tmp_path / "ad")
    script = (
        "import asyncio, json, sys, aiohttp\n"
        "from launcher.engines.sim.cli import build_parser, config_from_args\n"
        "from launcher.engines.sim.server import SimServer\n"
        "async def main():\n"
        "    s = SimServer(config_from_args(build_parser().parse_args(sys.argv[1:])))\n"
        "    await s.start()\n"
        "    async with aiohttp.ClientSession() as h:\n"
        f"        body = {{'lora_name': 'a@v1', 'lora_path': {str(ad)!r}}}\n"
        "        async with h.post(s.url + '/v1/load_lora_adapter', json=body) as r:\n"
        "            print(r.status)\n"
        "    await s.stop()\n"
        "asyncio.run(main())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in RUNTIME_LORA_ENV}
    run = [sys.executable, "-c", script, *flags]
    without = subprocess.run(run, env=env, capture_output=True, text=True, timeout=60, check=True)
    with_env = subprocess.run(
        run, env={**env, **RUNTIME_LORA_ENV}, capture_output=True, text=True, timeout=60, check=True
    )
    assert (without.stdout.strip(), with_env.stdout.strip()) == ("404", "200")
    bad_rank = subprocess.run(
        [sys.executable, "-c", script, "--enable-lora", "--max-lora-rank", "12"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad_rank.returncode != 0 and "max_lora_rank must be one of" in bad_rank.stderr


async def test_load_inplace_replaces_the_adapter_under_its_name(
    make_server: MakeServer, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    s = await make_server(lora_config())
    a, b = write_adapter(tmp_path / "a", fill=b"a"), write_adapter(tmp_path / "b", fill=b"b")
    assert (await load(http, s, "x", a))[0] == 200
    before = (await complete(http, s, "x"))[1]["choices"][0]["text"]
    body = {"lora_name": "x", "lora_path": str(b), "load_inplace": True}
    assert (await call(http, "POST", s.url + LOAD, body))[0] == 200
    assert (await complete(http, s, "x"))[1]["choices"][0]["text"] != before


UNREADABLE_TO_ORJSON = {
    # what vLLM 0.32 (FastAPI, json.loads) takes and orjson refuses: measured with vLLM's own
    # CompletionRequest behind FastAPI (security findings 2026-12-05, #1 c)
    "NaN": b'{"model": "%s", "prompt": "hello", "max_tokens": 4, "x": NaN}',
    "BOM": b'\xef\xbb\xbf{"model": "%s", "prompt": "hello", "max_tokens": 4}',
    "lone surrogate": b'{"model": "%s", "prompt": "hello", "max_tokens": 4, "user": "\\ud800"}',
}


async def test_bodies_are_read_as_vllm_reads_them(make_server: MakeServer, tmp_path: Path) -> None:
    """The simulator takes every body vLLM takes: a test of the router over it sees what a user would."""
    s = await make_server(lora_config())
    async with aiohttp.ClientSession() as http:
        assert (await load(http, s, "policy-a@v1", write_adapter(tmp_path / "a")))[0] == 200
        for what, body in UNREADABLE_TO_ORJSON.items():
            for model in ("tiny", "policy-a@v1"):
                async with http.post(
                    s.url + "/v1/completions", data=body % model.encode(), headers={"Content-Type": _JSON}
                ) as r:
                    answer = orjson.loads(await r.read())
                assert r.status == 200 and answer["model"] == model, (what, model, answer)
        async with http.post(s.url + "/v1/completions", data=b'{"model": "tiny",', headers={}) as r:
            assert r.status == 400 and "invalid JSON body" in (await r.text())


_JSON = "application/json"
