"""Who may call an engine's routes: vLLM's own key check, the launcher's key guard, and the simulator.

vLLM checks ``--api-key`` only under ``/v1`` (and ``/v2``, ``/inference``, ``/cohere``): with
``VLLM_SERVER_DEV_MODE=1``, which the refit window needs, ``/pause``, ``/abort_requests``,
``/update_weight_version``, ``/reset_prefix_cache`` and ``/collective_rpc`` answer anyone who reaches the
node. The launcher starts every engine with a key behind its guard (``launcher.engines.key_guard``): every
route but ``/health`` then takes the key.

One table of probes runs against a real vLLM CPU engine as vLLM ships it (the finding), one behind the
guard (the fix), and the simulator in both modes, which must answer exactly as the real engine does (it
used to guard the dev routes that vLLM leaves open, so no test could see the hole).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.engines.base import EngineSpec, EngineStartError
from launcher.engines.key_guard import OPEN_PATHS, authorized, needs_key
from launcher.engines.sim import SimEngine
from launcher.engines.vllm.engine import VllmEngine

KEY = "engine-key-guard-test-key"
STARTUP_TIMEOUT_S = 600.0

# (method, path, JSON body or None): the dev and RL routes an attacker would call, the routes vLLM does
# guard, and the open ones. /pause is followed by /resume so a raw engine that obeyed is left serving.
PROBES: list[tuple[str, str, object]] = [
    ("GET", "/health", None),
    ("GET", "/metrics", None),
    ("POST", "/tokenize", {"model": "tiny", "prompt": "hello"}),
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}),
    ("POST", "/pause?mode=keep", None),
    ("POST", "/resume", None),
    ("GET", "/is_paused", None),
    ("POST", "/abort_requests", {"request_ids": ["chatcmpl-nothing"]}),
    ("POST", "/update_weight_version", {"new_version": "stranger"}),
    ("GET", "/weight_info", None),
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/collective_rpc", {"method": "rl_launch_probe_no_such_method"}),
]


def _call(base: str, method: str, path: str, body: object, key: str | None) -> int:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(base + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def refused_without_key(base: str) -> dict[str, bool]:
    """For each probe: True when the engine answered 401 to a caller without the key."""
    return {f"{m} {p}": _call(base, m, p, b, None) == 401 for m, p, b in PROBES}


def expected(guarded: bool) -> dict[str, bool]:
    """vLLM's rule (``/v1`` only) or the guard's (everything but ``/health``)."""
    out = {}
    for method, path, _ in PROBES:
        bare = path.split("?", 1)[0]
        out[f"{method} {path}"] = needs_key(bare) if guarded else bare.startswith("/v1")
    return out


def test_the_rule() -> None:
    assert OPEN_PATHS == {"/health"}
    for path in ("/metrics", "/pause", "/collective_rpc", "/health/", "//health", "/v1/models", "/x"):
        assert needs_key(path), path
    assert not needs_key("/health")
    assert authorized(f"Bearer {KEY}", KEY) and authorized(f"bearer {KEY}", KEY)
    for header in (None, "", KEY, f"Basic {KEY}", f"Bearer {KEY}x", "Bearer ", "Bearer \udcff"):
        assert not authorized(header, KEY), header


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, SimEngine]]:
    """The simulator as the launcher starts it (``SimEngine``), with a key, guarded and not."""
    logdir = tmp_path_factory.mktemp("guard-sims")
    engines = {
        guarded: SimEngine(
            EngineSpec(
                model="tiny", api_key=KEY, key_guard=guarded, log_path=str(logdir / f"sim-{guarded}.log")
            )
        )
        for guarded in (False, True)
    }
    try:
        for e in engines.values():
            e.start_and_wait()
        yield engines
    finally:
        for e in engines.values():
            e.stop()


@pytest.mark.parametrize("guarded", [False, True], ids=["as-vllm-ships", "launcher-guard"])
def test_simulator_answers_as_vllm_does(sims: dict[bool, SimEngine], guarded: bool) -> None:
    engine = sims[guarded]
    assert refused_without_key(engine.url) == expected(guarded)
    for method, path, body in PROBES:  # the key opens every route the engine serves
        assert _call(engine.url, method, path, body, KEY) != 401, path
    assert ("--key-guard" in engine.command()) is guarded


@pytest.fixture(scope="module")
def vllm_pair(
    vllm_python: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[bool, VllmEngine]]:
    """Two real vLLM CPU engines in dev mode with the job's key: as vLLM ships it, and behind the guard."""
    logdir = tmp_path_factory.mktemp("guard-vllm")
    cpus = sorted(os.sched_getaffinity(0))
    engines: dict[bool, VllmEngine] = {}
    for i, guarded in enumerate((False, True)):
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}
        if len(cpus) >= 2:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpus[i])
        spec = EngineSpec(
            model=str(tiny_model_dir),
            served_name="tiny",
            api_key=KEY,
            key_guard=guarded,
            extra_args=["--max-model-len", "4096"],
            env=env,
            log_path=str(logdir / f"engine-{'guarded' if guarded else 'raw'}.log"),
            startup_timeout_s=STARTUP_TIMEOUT_S,
        )
        engines[guarded] = VllmEngine(spec, python=vllm_python)
    t0 = time.monotonic()
    try:
        for e in engines.values():
            e.start()
        for e in engines.values():
            try:
                e.wait_ready(t0 + STARTUP_TIMEOUT_S)
            except EngineStartError as exc:
                pytest.fail(f"vLLM engine failed to start:\n{exc}", pytrace=False)
        yield engines
    finally:
        for e in engines.values():
            e.stop()


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_real_vllm_dev_routes_open_as_shipped_and_closed_behind_the_guard(
    vllm_pair: dict[bool, VllmEngine],
) -> None:
    raw, guarded = vllm_pair[False], vllm_pair[True]
    assert "--middleware" not in raw.command() and "--middleware" in guarded.command()
    assert "VLLM_API_KEY" not in " ".join(guarded.command())  # the key stays out of argv
    got_raw = refused_without_key(raw.url)
    # The finding, on the real engine: everything but /v1 answers a caller without the key.
    assert got_raw == expected(False), got_raw
    assert not got_raw["POST /pause?mode=keep"] and not got_raw["POST /collective_rpc"]
    got_guarded = refused_without_key(guarded.url)
    assert got_guarded == expected(True), got_guarded
    # The stranger's stamp reached the raw engine and not the guarded one.
    assert _weight_version(raw.url) == "stranger"
    assert _weight_version(guarded.url) != "stranger"
    for method, path, body in PROBES:  # the key opens every route
        assert _call(guarded.url, method, path, body, KEY) != 401, path


def _weight_version(base: str) -> object:
    req = urllib.request.Request(base + "/weight_info", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read()).get("weight_version")
