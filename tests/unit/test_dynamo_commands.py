"""Exact Dynamo command lines and spec rules, without Dynamo installed (the GPU path, ``dynamo.vllm``,
cannot run on CPU machines: these tests are what CI checks of it; bench/dynamo_gpu_smoke.sh runs it)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from launcher.engines.base import EngineSpec, EngineStartError
from launcher.engines.dynamo.worker import DynamoPlanes, DynamoWorker, worker_command
from launcher.engines.host import build_engine
from launcher.engines.host_config import EngineHostConfig
from launcher.spec import SpecError, parse_spec

ETCD = DynamoPlanes(
    "etcd", "tcp", {"ETCD_ENDPOINTS": "http://10.0.0.1:2379", "NATS_SERVER": "nats://10.0.0.1:4222"}
)


def test_dynamo_vllm_command_line_is_exact() -> None:
    argv = worker_command(
        "dynamo-vllm", "/venv/bin/python", "Qwen/Qwen3-8B", "policy", ETCD,
        tensor_parallel_size=4, pipeline_parallel_size=2, vllm_args=["--max-model-len", "8192"],
        worker_args=["--migration-limit", "2"],
    )  # fmt: skip
    assert argv == [
        "/venv/bin/python", "-m", "dynamo.vllm", "--model", "Qwen/Qwen3-8B", "--served-model-name", "policy",
        "--tensor-parallel-size", "4", "--pipeline-parallel-size", "2",
        "--discovery-backend", "etcd", "--request-plane", "tcp", "--event-plane", "nats",
        "--enable-rl", "--enable-prefix-caching", "--max-model-len", "8192", "--migration-limit", "2",
    ]  # fmt: skip


def test_mocker_command_line_with_file_discovery_uses_zmq_events() -> None:
    planes = DynamoPlanes("file", "tcp", {"DYN_FILE_KV": "/jobs/x/dynamo/kv"})
    argv = worker_command(
        "dynamo-mocker", "py", "/models/tiny", "tiny", planes, worker_args=["--speedup-ratio", "10"]
    )
    assert argv == [
        "py", "-m", "dynamo.mocker", "--model-path", "/models/tiny", "--model-name", "tiny",
        "--num-workers", "1", "--discovery-backend", "file", "--request-plane", "tcp",
        "--event-plane", "zmq", "--speedup-ratio", "10",
    ]  # fmt: skip


def test_worker_environment_points_at_the_runtime_and_keeps_traffic_on_its_address() -> None:
    spec = EngineSpec(
        model="m", host="10.0.0.7", port=28001, api_key="secret", env={"CUDA_VISIBLE_DEVICES": "2,3"}
    )
    worker = DynamoWorker(spec, "dynamo-vllm", ETCD, python="py", tensor_parallel_size=2)
    env = worker.environment({})
    assert env["ETCD_ENDPOINTS"] == "http://10.0.0.1:2379" and env["NATS_SERVER"] == "nats://10.0.0.1:4222"
    assert env["DYN_SYSTEM_PORT"] == "28001" and env["DYN_SYSTEM_HOST"] == "10.0.0.7"
    assert env["DYN_TCP_RPC_HOST"] == env["DYN_EVENT_PLANE_HOST"] == "10.0.0.7"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "secret" not in " ".join(worker.command()) and "VLLM_API_KEY" not in env
    assert worker.url == "http://10.0.0.7:28001"


def test_worker_reads_the_runtime_credentials_from_their_files_and_drops_inherited_ones(
    tmp_path: Path,
) -> None:
    """The host config carries the secret files' paths only; the worker's environment gets the values,
    and a NATS user/password inherited from the user's shell (which Dynamo would try before the token)
    is dropped."""
    password, token = tmp_path / "etcd", tmp_path / "nats"
    password.write_text("pw-1\n")
    token.write_text("tok-2\n")
    planes = DynamoPlanes(
        "etcd", "tcp", {**ETCD.env, "ETCD_AUTH_USERNAME": "rl-launch"},
        {"ETCD_AUTH_PASSWORD": str(password), "NATS_AUTH_TOKEN": str(token)},
    )  # fmt: skip
    worker = DynamoWorker(
        EngineSpec(model="m", host="10.0.0.7", port=28001), "dynamo-mocker", planes, python="py"
    )
    env = worker.environment({"NATS_AUTH_USERNAME": "me", "NATS_AUTH_PASSWORD": "mine", "PATH": "/bin"})
    assert (env["ETCD_AUTH_USERNAME"], env["ETCD_AUTH_PASSWORD"], env["NATS_AUTH_TOKEN"]) == (
        "rl-launch",
        "pw-1",
        "tok-2",
    )
    assert "NATS_AUTH_USERNAME" not in env and "NATS_AUTH_PASSWORD" not in env and env["PATH"] == "/bin"
    assert "pw-1" not in " ".join(worker.command()) and "pw-1" not in json.dumps(asdict(planes))
    password.unlink()
    with pytest.raises(EngineStartError, match=f"cannot read the Dynamo credential {password}"):
        worker.environment({})


def test_engine_host_splits_gpus_into_tp_pp_groups_for_dynamo_vllm(tmp_path: Path) -> None:
    cfg = EngineHostConfig(
        kind="dynamo-vllm", count=2, host="127.0.0.1", model="m", tensor_parallel_size=2,
        pipeline_parallel_size=2, gpus=[str(i) for i in range(8)], log_dir=str(tmp_path),
        job_dir=str(tmp_path),
        dynamo={"discovery": "etcd", "request_plane": "tcp", "env": {}}, dynamo_python="py",
    )  # fmt: skip
    from launcher.engines.host import gpu_groups

    groups = gpu_groups(cfg)
    assert groups == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    worker = build_engine(cfg, 1, groups[1])
    assert isinstance(worker, DynamoWorker)
    worker._port = 28002  # resolved by start(), which would run Dynamo
    assert worker.environment({})["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert worker.command()[worker.command().index("--pipeline-parallel-size") + 1] == "2"


def _spec(**over: object) -> dict[str, object]:
    spec: dict[str, object] = {
        "name": "d",
        "cluster": "local",
        "training": {"command": "true"},
        "generation": {"engine": "dynamo-mocker", "model": "/m"},
        "router": {"kind": "dynamo"},
    }
    spec.update(over)
    return spec


def test_spec_resolves_dynamo_options_with_defaults() -> None:
    resolved = parse_spec(_spec()).resolved()
    assert resolved.router.kind == "dynamo" and resolved.generation.engine == "dynamo-mocker"
    d = resolved.router.dynamo
    assert (d.router_mode, d.discovery, d.request_plane, d.migration_limit) == ("kv", "etcd", "tcp", 3)


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"router": {"kind": "builtin"}}, "router.kind"),
        ({"generation": {"engine": "sim"}}, "generation.engine"),
        ({"generation": {"engine": "dynamo-mocker"}}, "generation.model"),
        ({"router": {"kind": "dynamo", "dynamo": {"router_mode": "fastest"}}}, "router.dynamo.router_mode"),
        (
            {
                "cluster": "slurm",
                "slurm": {"time": "01:00:00"},
                "generation": {"engine": "dynamo-mocker", "model": "/m", "nodes": 2},
            },
            "router.dynamo.allow_insecure_network",
        ),
    ],
)
def test_spec_refuses_mismatched_dynamo_fields_naming_the_field(over: dict[str, object], field: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(_spec(**over)).resolved()
    assert field in str(err.value)
