"""``rl-launch check``'s command and its plan: the probe's ``srun`` line (``launcher.slurm.request``), what
each group's probe looks at, and the command on ``cluster: local`` and without Slurm (no cluster needed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from launcher.check.run import needs_of, probe_config
from launcher.cli.main import main
from launcher.slurm.request import probe_command
from launcher.spec import load_resolved


def spec_file(tmp_path: Path, **changes: object) -> Path:
    spec: dict[str, object] = {
        "name": "chk",
        "cluster": "slurm",
        "job_root": str(tmp_path / "jobs"),
        "slurm": {
            "partition": "debug",
            "account": "proj",
            "time": "00:02:00",
            "gpus_per_node": 4,
            "cpus_per_task": 8,
            "extra_sbatch": ["--reservation=rl", "--mail-type=END", "--exclude=bad1"],
        },
        "training": {"nodes": 1, "command": "true"},
        "generation": {"nodes": 2, "engine": "vllm", "model": "/models/m", "tensor_parallel_size": 4},
    }
    spec.update(changes)
    spec = {k: v for k, v in spec.items() if v is not None}
    path = tmp_path / "chk.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_the_probe_asks_for_what_the_job_asks_on_one_node(tmp_path: Path) -> None:
    resolved = load_resolved(spec_file(tmp_path))
    argv = probe_command(
        resolved, "generation", job_name="rl-launch-check-x", time_s=300, argv=["py", "-m", "p"]
    )
    assert argv == [
        "srun",
        "--nodes=1",
        "--ntasks-per-node=1",
        "--cpus-per-task=8",
        "--gpus-per-node=4",
        "--partition=debug",
        "--ntasks=1",
        "--time=00:02:00",  # the job's own limit when it is shorter than the probe's
        "--account=proj",
        "--job-name=rl-launch-check-x",
        "--export=ALL",
        "--reservation=rl",  # where the job may run: carried; mail options are the batch job's: not
        "--exclude=bad1",
        "py",
        "-m",
        "p",
    ]


def test_a_hetjob_probes_each_component_with_its_own_resources_and_container(tmp_path: Path) -> None:
    container = {"image": "nvcr.io/nvidia/nemo-rl:v0.4.0", "mounts": ["/lustre:/lustre"]}
    path = spec_file(
        tmp_path,
        slurm={"partition": "debug", "time": "01:00:00", "gpus_per_node": 4, "container": container},
        training={
            "nodes": 1,
            "command": "python train.py",
            "slurm": {"partition": "train", "gpus_per_node": 8},
        },
    )
    resolved = load_resolved(path)
    assert resolved.slurm is not None and resolved.slurm.layout == "hetjob"
    training = probe_command(resolved, "training", job_name="t", time_s=300, argv=["p"])
    assert (
        "--partition=train" in training and "--gpus-per-node=8" in training and "--time=00:05:00" in training
    )
    assert training[-3:] == [
        "--container-image=nvcr.io/nvidia/nemo-rl:v0.4.0",
        "--container-mounts=/lustre:/lustre",
        "p",
    ]
    generation = probe_command(resolved, "generation", job_name="g", time_s=300, argv=["p"], container=False)
    assert "--partition=debug" in generation and not any(a.startswith("--container") for a in generation)
    needs = needs_of(resolved)
    assert [(n.who, n.partition, n.nodes, n.gpus, n.fields) for n in needs.values()] == [
        ("training", "train", 1, 8, "training.slurm"),
        ("generation", "debug", 2, 4, "generation.slurm"),
    ]


def test_what_each_group_looks_at(tmp_path: Path) -> None:
    resolved = load_resolved(spec_file(tmp_path))
    share = tmp_path / "share"
    training = probe_config(resolved, "training", share, "tok")
    generation = probe_config(resolved, "generation", share, "tok")
    assert training == {
        "group": "training",
        "job_root": str(tmp_path / "jobs"),
        "gpus": 4,
        "share_dir": str(share),
        "login_token": "tok",
        "port_range": [20000, 20999],  # the router runs in the driver's step, on the first training node
    }
    assert (
        generation["vllm"] is True and generation["model"] == "/models/m" and "port_range" not in generation
    )
    assert [(n.who, n.nodes, n.gpus) for n in needs_of(resolved).values()] == [("job", 3, 4)]


def test_without_slurm_one_line_and_exit_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    result = CliRunner().invoke(main, ["check", str(spec_file(tmp_path))])
    assert result.exit_code == 1, result.output
    assert result.stdout.splitlines()[1:] == [
        "  FAIL  slurm: `sinfo` is not on PATH; fix: run check on a Slurm login node (or add Slurm's bin "
        "directory to PATH)",
        "FAILED: 1 of 1 checks failed",
    ]


def test_a_spec_that_does_not_validate_exits_2(tmp_path: Path) -> None:
    path = spec_file(tmp_path, generation={"nodes": 2, "engine": "vllm"})  # no model
    result = CliRunner().invoke(main, ["check", str(path)])
    assert result.exit_code == 2 and "generation.model" in result.output


def test_local_checks_the_engine_python_and_model_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    path = spec_file(
        tmp_path,
        cluster="local",
        slurm=None,
        generation={"nodes": 1, "engine": "vllm", "model": str(model), "env": {"VLLM_SERVER_DEV_MODE": "1"}},
    )
    monkeypatch.setenv("RL_LAUNCH_VLLM_PYTHON", sys.executable)  # no vLLM in the launcher's venv
    result = CliRunner().invoke(main, ["check", str(path), "--json"])
    assert result.exit_code == 1, result.output
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert set(checks) == {"job root", "local engine python", "local model", "local router port"}
    assert checks["local engine python"]["status"] == "FAIL" and checks["local model"]["status"] == "ok"
    assert "No module named 'vllm'" in checks["local engine python"]["detail"]


def test_a_job_on_a_standing_fleet_looks_for_no_engines_and_no_router_port() -> None:
    """Its engines and router are the fleet's (``generation.fleet``): nothing of theirs to look for."""
    path = Path(__file__).resolve().parents[2] / "examples" / "lora-tenant-a.yaml"
    assert load_resolved(path).role == "attached"
    result = CliRunner().invoke(main, ["check", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert [c["name"] for c in json.loads(result.stdout)["checks"]] == ["job root"]


def test_a_hetjob_on_one_partition_needs_its_components_nodes_at_once(tmp_path: Path) -> None:
    from launcher.check.run import allocation_checks
    from launcher.check.site import parse_sinfo

    rows = parse_sinfo("".join(f"debug*|node{i}|gpu:2|idle|infinite\n" for i in (1, 2, 3)))
    path = spec_file(
        tmp_path,
        slurm={"partition": "debug", "time": "01:00:00", "gpus_per_node": 2},
        training={"nodes": 1, "command": "true", "slurm": {"gpus_per_node": 0}},
        generation={"nodes": 3, "engine": "sim", "engines_per_node": 1},
    )
    checks, blocked = allocation_checks(load_resolved(path), rows)
    assert [(c.name, c.status) for c in checks] == [
        ("training partition", "ok"),
        ("training nodes", "ok"),
        ("generation partition", "ok"),
        ("generation nodes", "ok"),
        ("job nodes", "FAIL"),  # 1 + 3 nodes from a partition of 3
    ]
    assert checks[-1].detail.startswith("4 node(s) asked, but partition debug has 3 such usable node(s)")
    assert blocked == {"job"}
    fits = spec_file(
        tmp_path,
        slurm={"partition": "debug", "time": "01:00:00", "gpus_per_node": 2},
        training={"nodes": 1, "command": "true", "slurm": {"gpus_per_node": 0}},
        generation={"nodes": 2, "engine": "sim", "engines_per_node": 1},
    )
    fits_checks, fits_blocked = allocation_checks(load_resolved(fits), rows)  # 1 + 2 of 3: no extra line
    assert [c.status for c in fits_checks] == ["ok"] * 4 and not fits_blocked
