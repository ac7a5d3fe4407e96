"""The probe of ``rl-launch check`` (``launcher.check.probe``) and the verdicts on what it saw
(``launcher.check.probe_job``), on this machine: the probe is a plain process, here as on a node."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.check.probe import (
    CONFIG_ENV,
    engine_python,
    launcher_identity,
    model_probe,
    ports_probe,
    share_probe,
    vllm_probe,
)
from launcher.check.probe_job import ProbeRun, judge_nodes, judge_result, judge_step, parse_result
from launcher.check.site import prepare_share


def test_the_probe_runs_as_a_module_and_its_answer_is_read_back(tmp_path: Path) -> None:
    share, token, _ = prepare_share(str(tmp_path / "jobs"))
    config = {"group": "generation", "share_dir": str(share), "login_token": token, "gpus": 0}
    env = {**os.environ, CONFIG_ENV: json.dumps(config), "SLURM_JOB_ID": "77"}
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.check.probe"], capture_output=True, text=True, timeout=60, env=env
    )
    result = parse_result(proc.stdout)
    assert proc.returncode == 0 and result is not None, proc.stderr
    assert result["job_id"] == "77" and result["host"] == socket.gethostname()
    assert judge_nodes([result], str(tmp_path / "jobs"), launcher_identity())[1].status == "ok"
    # without its config it says who starts it, and exits 2
    env.pop(CONFIG_ENV)
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.check.probe"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 2 and "started by `rl-launch check`" in proc.stderr


def test_a_job_root_the_node_does_not_see_fails_once_for_every_node(tmp_path: Path) -> None:
    share, token, _ = prepare_share(str(tmp_path / "jobs"))
    assert share is not None
    seen = share_probe(str(share), token, "training-n1")
    missing = share_probe(str(tmp_path / "elsewhere" / share.name), token, "generation-n2")
    results = [
        {"host": "n1", **launcher_identity(), "share": seen},
        {"host": "n2", **launcher_identity(), "share": missing},
    ]
    launcher, shared = judge_nodes(results, "/j", launcher_identity())
    assert launcher.status == "ok" and launcher.detail.startswith("n1, n2 run the same rl-launch")
    assert shared.failed and shared.detail.startswith("/j is not shared with n2: ")
    assert "does not exist on the node" in shared.detail and "every node mounts" in shared.fix
    # a node that wrote its token where this node reads another one: not the same directory
    Path(seen["node_file"]).write_text("0" * 16)
    assert judge_nodes(results[:1], "/j", launcher_identity())[1].failed
    # another launcher on a node
    other = {**results[0], "version": "0.0.1"}
    assert judge_nodes([other], "/j", launcher_identity())[0].failed


def test_model_paths_and_the_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "m"
    seen = model_probe(str(model), {})
    assert seen["kind"] == "path" and not seen["found"]
    checks = judge_result("generation", {"model": str(model)}, {"host": "n2", "gpus": {}, "model": seen})
    assert (
        checks[0].line().startswith(f"FAIL  generation model: generation.model {model} does not exist on n2")
    )
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert model_probe(str(model), {})["found"]
    # a hub id: the node's cache, offline unless the environment says otherwise
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    hub = model_probe("Qwen/Qwen3-8B", {})
    assert hub == {
        "kind": "hub",
        "where": str(tmp_path / "hf" / "hub"),
        "found": False,
        "config": None,
        "offline": True,
    }
    verdict = judge_result(
        "generation", {"model": "Qwen/Qwen3-8B"}, {"host": "n2", "gpus": {}, "model": hub}
    )[0]
    assert verdict.failed and "hf download Qwen/Qwen3-8B --local-dir DIR" in verdict.fix
    online = model_probe("Qwen/Qwen3-8B", {"HF_HUB_OFFLINE": "0"})  # generation.env wins
    assert not online["offline"]
    assert not judge_result("generation", {"model": "x"}, {"host": "n", "gpus": {}, "model": online})[
        0
    ].failed
    snapshot = tmp_path / "hf" / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    assert model_probe("Qwen/Qwen3-8B", {})["found"]


def test_the_engine_python_is_the_variable_else_the_vllm_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RL_LAUNCH_VLLM_PYTHON", "/opt/v/bin/python")
    assert engine_python() == ("/opt/v/bin/python", "$RL_LAUNCH_VLLM_PYTHON")
    monkeypatch.delenv("RL_LAUNCH_VLLM_PYTHON")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert engine_python()[0] is None and "no `vllm` is on PATH" in engine_python()[1]
    script = tmp_path / "vllm"
    script.write_text("#!/opt/venv/bin/python3 -E\nimport sys\n")
    script.chmod(0o755)
    assert engine_python() == ("/opt/venv/bin/python3", f"`vllm` on PATH ({script})")


def test_vllm_import_failure_and_success(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RL_LAUNCH_VLLM_PYTHON", sys.executable)  # the launcher's venv has no vLLM
    seen = vllm_probe({}, 60)
    assert seen["version"] is None and "No module named 'vllm'" in seen["error"]
    verdict = judge_result("generation", {}, {"host": "n2", "gpus": {}, "engine": seen})[0]
    assert verdict.line().startswith(
        f"FAIL  generation engine python: {sys.executable} ($RL_LAUNCH_VLLM_PYTHON)"
    )
    assert "export RL_LAUNCH_VLLM_PYTHON=" in verdict.fix
    fake = tmp_path / "python"  # answers like a python with vLLM; sees generation.env
    fake.write_text('#!/bin/sh\necho "VLLM-VERSION 0.32.0-$ENGINE_VAR"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("RL_LAUNCH_VLLM_PYTHON", str(fake))
    seen = vllm_probe({"ENGINE_VAR": "x"}, 60)
    assert seen["version"] == "0.32.0-x" and seen["error"] is None
    monkeypatch.setenv("RL_LAUNCH_VLLM_PYTHON", str(tmp_path / "absent"))
    assert vllm_probe({}, 60)["error"] == f"{tmp_path / 'absent'} does not exist on the node"


def test_a_router_range_with_no_free_port_fails() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        seen = ports_probe((port, port), "127.0.0.1")
        assert seen["port"] is None
        verdict = judge_result(
            "training", {"port_range": [port, port]}, {"host": "n1", "gpus": {}, "ports": seen}
        )
        assert verdict[0].failed and "set router.port_range" in verdict[0].fix
    assert ports_probe((port, port), "127.0.0.1")["port"] == port


def test_fewer_gpus_than_asked_fail() -> None:
    few = {"cuda_visible": "0", "count": 1, "nvidia_smi": None}
    verdict = judge_result("generation", {"gpus": 2}, {"host": "n2", "gpus": few})[0]
    assert verdict.failed and "CUDA_VISIBLE_DEVICES=0, fewer than the 2 asked" in verdict.detail
    listed = {"cuda_visible": "0,1", "count": 2, "nvidia_smi": ["GPU 0: H100"]}
    assert judge_result("generation", {"gpus": 2}, {"host": "n2", "gpus": listed})[0].failed
    enough = {"cuda_visible": "0,1", "count": 2, "nvidia_smi": ["GPU 0: H100", "GPU 1: H100"]}
    assert judge_result("generation", {"gpus": 2}, {"host": "n2", "gpus": enough})[0].status == "ok"


def test_how_a_probe_step_ended() -> None:
    argv = ["srun", "--nodes=1", sys.executable, "-m", "launcher.check.probe"]
    pending = ProbeRun("generation", "n", argv, timed_out=True, queue_state="PENDING|Resources|")
    assert judge_step(pending, 30, False).detail == "still PENDING (Resources) after 30 s; cancelled"
    running = ProbeRun("generation", "n", argv, timed_out=True, queue_state="RUNNING|None|node2")
    assert (
        judge_step(running, 30, False).detail == "started on node2 but did not answer within 30 s; cancelled"
    )
    missing = ProbeRun(
        "training",
        "n",
        argv,
        returncode=2,
        stderr=f"slurmstepd: error: execve(): {sys.executable}: No such file or directory\n"
        "srun: error: node1: task 0: Exited with exit code 2\n",
    )
    verdict = judge_step(missing, 30, False)
    assert verdict.failed and f"the launcher's python {sys.executable} cannot run" in verdict.detail
    assert "install rl-launch on storage every node mounts" in verdict.fix
    refused = ProbeRun(
        "training",
        "n",
        argv,
        returncode=1,
        stderr="srun: error: Unable to allocate resources: Invalid account\n",
    )
    assert "Invalid account" in judge_step(refused, 30, False).detail
    ran = ProbeRun(
        "training", "n", argv, returncode=0, elapsed_s=1.25, result={"host": "node1", "job_id": "9"}
    )
    assert judge_step(ran, 30, True).line() == (
        "ok    training probe: ran on node1 (Slurm job 9, 1.2 s); on the host, without the container "
        "(see container runtime)"
    )
