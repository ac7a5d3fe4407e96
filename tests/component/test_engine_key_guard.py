"""Who may call an engine's routes: vLLM's own key check, the launcher's key guard, and the simulator.

vLLM checks ``--api-key`` only under ``/v1`` (and ``/v2``, ``/inference``, ``/cohere``): with
``VLLM_SERVER_DEV_MODE=1``, which the refit window needs, ``/pause``, ``/abort_requests``,
``/update_weight_version``, ``/reset_prefix_cache`` and ``/collective_rpc`` answer anyone who reaches the
node. The launcher starts every engine with a key behind its guard (``launcher.engines.key_guard``): every
route but ``/health`` then takes the key.

One table of probes runs against the simulator in both modes here, and against real vLLM CPU engines as
vLLM ships it (the finding) and behind the guard (the fix) in ``tests/vllm/test_refit_vllm.py``, whose two
engines are one of each (two engine starts fewer); the simulator must answer exactly as the real engine
does (it used to guard the dev routes that vLLM leaves open, so no test could see the hole).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from launcher.engines.base import EngineSpec
from launcher.engines.key_guard import OPEN_PATHS, authorized, needs_key
from launcher.engines.sim import SimEngine
from tests.support.engine_key_probes import KEY, PROBES, _call, expected, refused_without_key


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
