"""Real vLLM engines shared by several modules of this tier (``tests/support/shared_vllm.py`` says which
and why): started once per lane, on first use, and stopped as soon as the last test that uses them is
done, so that they neither start again per module nor sit idle (memory, two cores) under the tests that
start engines of their own.

The tests that use them run one after the other: ``pytest_collection_modifyitems`` moves them next to the
first of them (their modules hold no module-scoped fixtures that a move would set up twice), and
xdist's lane for the vLLM tier takes its tests in collection order.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.engines.vllm.engine import VllmEngine
from tests.support.shared_vllm import EngineStartError, lora_engines, start_all

SHARED = "shared_lora_engines"
_running: list[VllmEngine] = []
_left = {SHARED: 0}
"""Tests of this lane that still need the shared engines; at 0 they are stopped."""


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    users = [item for item in items if SHARED in getattr(item, "fixturenames", ())]
    if len(users) < 2:
        return
    first = items.index(users[0])
    moved = set(map(id, users))
    rest = [item for item in items if id(item) not in moved]
    items[:] = rest[:first] + users + rest[first:]


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if SHARED not in getattr(item, "fixturenames", ()) or not _running:
        return
    _left[SHARED] -= 1
    if _left[SHARED] <= 0:  # the last user in this lane: stop now, not at the session's end
        for e in _running:
            e.stop()


@pytest.fixture(scope="session")
def shared_lora_engines(
    request: pytest.FixtureRequest,
    vllm_python: str,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[VllmEngine]]:
    """Two started engines (``tests/support/shared_vllm.lora_engines``); stopped after the last test of
    this session that uses them (under xdist: of this worker's; the vLLM tier runs in one lane)."""
    # Every collected user, also the ones another lane runs (--dist load): then this lane never reaches
    # 0 and the engines stop at the session's end, as a plain session fixture's would.
    _left[SHARED] = sum(1 for item in request.session.items if SHARED in getattr(item, "fixturenames", ()))
    engines = lora_engines(vllm_python, tiny_model_dir, tmp_path_factory.mktemp("shared-lora-engines"))
    _running[:] = engines
    try:
        try:
            took = start_all(engines)
        except EngineStartError as exc:
            pytest.fail(f"vLLM engine failed to start:\n{exc}", pytrace=False)
        print(f"\n[shared vllm] {len(engines)} LoRA engines ready after {took:.0f} s")
        yield engines
    finally:
        for e in engines:
            e.stop()
        _running.clear()
