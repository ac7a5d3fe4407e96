"""A router restart in front of real vLLM CPU engines serving two tenants' LoRA adapters (security findings
2026-12-05, #1 b, c and #5), on a fleet that also serves the base model (the default).

The engines keep every adapter version loaded when the router dies; the router that replaces it (a Ray
actor restarts on the same port with its first arguments) must learn who owns which before it serves any
adapter: each tenant gets its own adapter at once, the other tenant's is refused, the plan counts what
the engines hold. The bodies vLLM reads and orjson does not (``NaN``, a UTF-8 BOM, a lone surrogate) are
sent to an engine directly first, to show what the router must not let through.

Two real engines (the vLLM venv, the tiny model made by the tests; shared with the fleet-reset test:
``tests/vllm/conftest.py``), the router in this process.
"""

from __future__ import annotations

import json
import struct
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from launcher.engines.vllm.engine import VllmEngine
from router import GenerationRouter, RouterConfig
from router.consumers import add_admin_key, add_consumer
from tests.support.shared_vllm import ENGINE_KEY as KEY
from tests.support.shared_vllm import PLAN

TOKEN = "owner-admin-token-of-the-lora-restart-test"
API = "owner-client-key-of-the-lora-restart-test"
KEYS = {"a": "tenant-a-client-key-0123456789", "b": "tenant-b-client-key-0123456789"}
ADMIN = {"a": "tenant-a-admin-key-0123456789", "b": "tenant-b-admin-key-0123456789"}
WIDTH = 128
"""The tiny model's hidden size and its q/v projections' outputs (``tests/support/tiny_model``)."""
UNREADABLE = {
    "NaN": b'{"model": "%s", "prompt": "hello", "max_tokens": 4, "x": NaN}',
    "BOM": b'\xef\xbb\xbf{"model": "%s", "prompt": "hello", "max_tokens": 4}',
    "lone surrogate": b'{"model": "%s", "prompt": "hello", "max_tokens": 4, "user": "\\ud800"}',
}


def adapter(directory: Path, seed: int) -> Path:
    """A rank-8 LoRA of the tiny model's layer-0 q/v projections (PEFT's layout, no torch needed)."""
    directory.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    tensors: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    data = b""
    for module in ("q_proj", "v_proj"):
        prefix = f"base_model.model.model.layers.0.self_attn.{module}"
        for part, shape in (("lora_A", [8, WIDTH]), ("lora_B", [WIDTH, 8])):
            n = shape[0] * shape[1]
            tensors[f"{prefix}.{part}.weight"] = {
                "dtype": "F32",
                "shape": shape,
                "data_offsets": [len(data), len(data) + 4 * n],
            }
            data += struct.pack(f"<{n}f", *(((i * 7 + seed) % 13 - 6) / 100 for i in range(n)))
    header = json.dumps(tensors).encode()
    (directory / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)
    return directory


def call(url: str, key: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, data=data, headers=headers), timeout=300
        ) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        text = exc.read()
        try:
            return exc.code, json.loads(text)
        except ValueError:
            return exc.code, text.decode(errors="replace")


def complete(base: str, key: str, model: str) -> tuple[int, str]:
    status, body = call(base + "/v1/completions", key, {"model": model, "prompt": "hello", "max_tokens": 4})
    if status == 200:
        return status, body["model"]
    message = body.get("error", {}).get("message") if isinstance(body, dict) else None
    return status, str(message or body)[:120]


@pytest.fixture
def engines(shared_lora_engines: list[VllmEngine]) -> list[VllmEngine]:
    """2 real engines, keyed, LoRA per ``PLAN`` (``tests/vllm/conftest.py``: started once and shared with
    the fleet-reset test, which leaves no adapter on them)."""
    return shared_lora_engines


def router(consumers: Path, port: int = 0, urls: list[str] | None = None) -> GenerationRouter:
    config = RouterConfig(
        host="127.0.0.1",
        port=port,
        bind_retry_s=10.0,
        policy="round_robin",
        admin_token=TOKEN,
        api_key=API,
        backend_api_key=KEY,
        consumers_file=str(consumers),
        lora=PLAN.model_dump(),
        backend_timeout_s=300,
        version_max_wait_s=30.0,
    )
    r = GenerationRouter(config, urls or [])
    r.serve_in_background()
    return r


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_a_restarted_router_keeps_each_tenant_to_its_own_adapter_on_real_engines(
    engines: list[VllmEngine], tmp_path: Path
) -> None:
    consumers = tmp_path / "consumers.json"
    for t in ("a", "b"):
        add_consumer(consumers, f"tenant-{t}", KEYS[t], adapters=(f"policy-{t}",))
        add_admin_key(consumers, f"tenant-{t}", ADMIN[t])
    urls = [e.api_url for e in engines]
    first = router(consumers, urls=urls)
    base = first.base_url()
    port = first.port
    try:
        for who, name, version, seed in (
            ("a", "policy-a", "v1", 1),
            ("a", "policy-a", "v2", 2),
            ("b", "policy-b", "v1", 3),
        ):
            body = {
                "adapter": name,
                "from": str(adapter(tmp_path / f"{name}-{version}", seed)),
                "version": version,
            }
            status, txn = call(base + "/fleet/adapters/load", ADMIN[who], body)
            assert status == 200 and txn["ok"], txn
        assert complete(base, KEYS["a"], "policy-a") == (200, "policy-a@v2")
        assert complete(base, KEYS["b"], "policy-a@v2")[0] == 403
    finally:
        first.stop()
    held = {}
    for u in (e.url for e in engines):
        _, listed = call(u + "/v1/models", KEY)
        held[u] = sorted(m["id"] for m in listed["data"])
    print(f"[lora restart] the router stopped; the engines still serve {held}")
    # what vLLM itself reads: each body orjson refuses, sent to an engine, is served the adapter it names
    direct = {
        w: call(engines[0].url + "/v1/completions", KEY, raw=b % b"policy-a@v2")
        for w, b in UNREADABLE.items()
    }
    print(
        "[lora restart] straight to vLLM: "
        + ", ".join(
            f"{w}: {s} {(b.get('model') if isinstance(b, dict) else b)!r}" for w, (s, b) in direct.items()
        )
    )

    again = router(consumers, port=port)  # a Ray restart: the same port, its first (empty) backend list
    try:
        again.set_serving_backends(urls)  # the fleet controller's push
        got = {
            "a policy-a": complete(base, KEYS["a"], "policy-a"),
            "b policy-a@v2": complete(base, KEYS["b"], "policy-a@v2"),
            "b policy-a@v1": complete(base, KEYS["b"], "policy-a@v1"),
            "b policy-b": complete(base, KEYS["b"], "policy-b"),
        }
        for what, body in UNREADABLE.items():
            status, answer = call(base + "/v1/completions", KEYS["b"], raw=body % b"policy-a@v2")
            got[f"b {what} body"] = (
                status,
                str(answer.get("model") or answer.get("error", {}).get("message"))[:70],
            )
        _, mine = call(base + "/v1/models", KEYS["b"])
        got["b /v1/models"] = (200, str(sorted((m["id"], m.get("root")) for m in mine["data"])))
        status, body = call(
            base + "/fleet/adapters/load",
            TOKEN,
            {"adapter": "scratch", "from": str(adapter(tmp_path / "scratch", 4))},
        )
        got["owner loads a third adapter"] = (status, str(body.get("error") or body.get("served_name"))[:200])
        print(
            "[lora restart] after the router restarted:\n" + "\n".join(f"   {k}: {v}" for k, v in got.items())
        )
        assert got["a policy-a"] == (200, "policy-a@v2"), got
        assert (
            got["b policy-a@v2"][0] == 403 and "belongs to consumer 'tenant-a'" in got["b policy-a@v2"][1]
        ), got
        assert got["b policy-a@v1"][0] == 403, got  # drained and unloaded before the restart: refused
        assert got["b policy-b"] == (200, "policy-b@v1"), got
        for what in UNREADABLE:
            assert got[f"b {what} body"][0] == 400, got
        assert got["b /v1/models"][1] == "[('policy-b@v1', None), ('tiny', None)]", got
        assert (
            got["owner loads a third adapter"][0] == 409
            and "max_adapters: 2" in got["owner loads a third adapter"][1]
        )
    finally:
        again.stop()
    for what, (status, _) in direct.items():
        assert status == 200, (what, direct)  # vLLM serves them: only the router can refuse them
