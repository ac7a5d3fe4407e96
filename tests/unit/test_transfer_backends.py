"""Which weight-transfer backends the router lets a CPU engine join a group with
(``router.fleet.transfer_backends``), read from the engine's ``/server_info`` config as vLLM 0.32 dumps it."""

from __future__ import annotations

from typing import Any

import pytest

from router.fleet.transfer_backends import CPU_BACKENDS, backend_of, runs_on_cpu


def _config(transfer: Any) -> dict[str, Any]:
    return {"device_config": {"device": "cpu"}, "weight_transfer_config": transfer}


@pytest.mark.parametrize(
    ("transfer", "backend", "on_cpu"),
    [
        ({"backend": "rl_launch_gloo"}, "rl_launch_gloo", True),
        ({"backend": "nccl"}, "nccl", False),
        ({"backend": "ipc"}, "ipc", False),
        ({"backend": "sharded_rdt"}, "sharded_rdt", False),
        ({"backend": "nccl_m2n"}, "nccl_m2n", False),
        (None, None, False),  # started without --weight-transfer-config
        ({"backend": ""}, None, False),
        ("rl_launch_gloo", None, False),  # not vLLM's shape: never taken for a backend
    ],
)
def test_only_the_gloo_backend_runs_on_a_cpu_engine(transfer: Any, backend: str | None, on_cpu: bool) -> None:
    assert backend_of(_config(transfer)) == backend
    assert runs_on_cpu(_config(transfer)) is on_cpu


def test_the_launcher_registers_the_backend_the_router_accepts() -> None:
    from launcher.engines.vllm.worker_ext.rl_launch_gloo import BACKEND

    assert CPU_BACKENDS == (BACKEND,)
