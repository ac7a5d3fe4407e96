"""The Dynamo tier's skip: every test here needs the Dynamo venv, etcd and NATS, and the tiny model that
the mocker serves (built with the vLLM python), so one reason names every part missing.

``dynamo_runtime`` is a session fixture for that reason: pytest sets up session fixtures before the
others and, within a scope, in the order a test names them, so a test that names it before
``tiny_model_dir`` skips with this whole list instead of the vLLM fixture's half of it (a newcomer who
then installed vLLM met a second skip, for Dynamo).
"""

from __future__ import annotations

import os

import pytest

from tests.support.dynamo import missing_runtime

VLLM_PYTHON_ENV = "RL_LAUNCH_VLLM_PYTHON"


@pytest.fixture(scope="session")
def dynamo_runtime() -> None:
    missing = missing_runtime()
    if not os.environ.get(VLLM_PYTHON_ENV):
        missing.append(
            f"{VLLM_PYTHON_ENV} is not set, for the tiny model "
            f'(export {VLLM_PYTHON_ENV}="$(scripts/install-vllm.sh --cpu)")'
        )
    if missing:
        pytest.skip("; ".join(missing))
