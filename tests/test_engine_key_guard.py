"""Who may call an engine's routes: vLLM's own key check, the launcher's key guard, and the simulator.

vLLM checks ``--api-key`` only under ``/v1`` (and ``/v2``, ``/inference``, ``/cohere``): with
``VLLM_SERVER_DEV_MODE=1``, which the refit window needs, ``/pause``, ``/abort_requests``,
``/update_weight_version``, ``/reset_prefix_cache`` and ``/collective_rpc`` answer anyone who reaches the
node. The launcher starts every engine with a key behind its guard (``launcher.engines.key_guard``): every
route but ``/health`` then takes the key.

One table of probes runs against the simulator in both modes here, and against real vLLM CPU engines as
vLLM ships it (the finding) and behind the guard (the fix) in ``tests/test_refit_vllm.py``, whose two
engines are one of each (two engine starts fewer); the simulator must answer exactly as the real engine
does (it used to guard the dev routes that vLLM leaves open, so no test could see the hole).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from launcher.engines.base import EngineSpec
from launcher.engines.key_guard import OPEN_PATHS, authorized, needs_key
from launcher.engines.sim import SimEngine

KEY = "engine-key-guard-test-key"

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
