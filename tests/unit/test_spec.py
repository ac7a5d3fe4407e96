"""Job spec, Slurm request, sbatch rendering and the validate/render/submit --dry-run commands.

Nothing here talks to Slurm: the CLI tests put a fake ``sbatch`` first on PATH that records any call,
and assert it was never called.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from importlib import resources
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from launcher.cli.main import main
from launcher.slurm import build_request, expand_hostlist, format_time, parse_time, split_nodes
from launcher.spec import ResolvedSpec, SpecError, load_resolved, load_spec, parse_spec
from launcher.submit.render import render_sbatch

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))

BASE = """\
name: t
job_root: {root}
slurm:
  partition: batch
  time: "02:00:00"
  gpus_per_node: 8
training:
  nodes: 1
  command: python train.py
generation:
  nodes: 2
  model: Qwen/Qwen3-8B
"""


LOCAL_SIM = """\
name: t
cluster: local
training:
  command: "true"
generation:
  engine: sim
"""


def write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).replace("{root}", str(tmp_path / "jobs")))
    return path


def spec_error(path: Path) -> SpecError:
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return info.value


def with_changes(tmp_path: Path, changes: dict) -> Path:
    """BASE with nested keys replaced (None deletes), written to a file."""
    data = yaml.safe_load(BASE.replace("{root}", str(tmp_path / "jobs")))
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = data
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ---------------------------------------------------------------------------------------------------
# Examples and good specs
# ---------------------------------------------------------------------------------------------------


def test_examples_exist_and_validate() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"local.yaml", "slurm-sim.yaml", "slurm-vllm.yaml"} <= names
    for path in EXAMPLES:
        resolved = load_resolved(path)
        assert resolved.spec_path == str(path.resolve())


def test_vllm_example_is_tp2_on_8_gpu_nodes() -> None:
    r = load_resolved(REPO / "examples" / "slurm-vllm-fleet-client.yaml")
    assert r.generation.engine == "vllm" and r.generation.tensor_parallel_size == 2
    assert r.generation.resources is not None and r.generation.resources.gpus_per_node == 8
    assert r.generation.engines_per_node == 4
    assert r.generation.num_engines == 4 * r.generation.nodes


def test_nemo_rl_example_leaves_the_engines_to_the_trainer() -> None:
    """NeMo-RL starts its own engines: rl-launch starts none, and the registration URL reaches NeMo-RL
    through OmegaConf's environment resolver, never expanded onto a command line."""
    r = load_resolved(REPO / "examples" / "slurm-vllm.yaml")
    assert r.generation.trainer_owned and r.generation.num_engines == 0
    assert r.router.kind == "builtin"
    assert "'++env.nemo_gym.router_url=${oc.env:RL_ROUTER_REGISTRATION_URL}'" in r.training.command
    assert "$RL_ROUTER_REGISTRATION_URL" not in r.training.command.replace("${oc.env:RL_ROUTER", "")


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        ({"router": {"kind": "vllm-router"}}, "router.kind", "use router.kind: builtin"),
        ({"generation": {"elastic": {}}}, "generation.elastic", "cannot grow or shrink"),
    ],
)
def test_trainer_owned_rules(tmp_path: Path, extra: dict[str, object], field: str, words: str) -> None:
    spec = yaml.safe_load(LOCAL_SIM)
    spec["generation"] = {**spec["generation"], "owner": "trainer", **extra.get("generation", {})}  # type: ignore[dict-item]
    spec["router"] = {**spec.get("router", {}), **extra.get("router", {})}  # type: ignore[dict-item]
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SpecError) as exc:
        load_resolved(path)
    assert field in str(exc.value) and words in str(exc.value), str(exc.value)


def test_trainer_owned_needs_no_model_and_starts_no_engine(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    spec = yaml.safe_load(LOCAL_SIM)
    spec["generation"] = {"engine": "vllm", "owner": "trainer", "engines_per_node": 2}
    path.write_text(yaml.safe_dump(spec))
    r = load_resolved(path)
    assert (r.generation.num_engines, r.generation.owner) == (0, "trainer")
    assert r.kind_labels()["engines"] == "vllm engines the trainer registers"


def test_local_example_has_four_sim_engines() -> None:
    r = load_resolved(REPO / "examples" / "local.yaml")
    assert (r.cluster, r.generation.engine, r.generation.num_engines, r.slurm) == ("local", "sim", 4, None)


def test_resolved_defaults(tmp_path: Path) -> None:
    r = load_resolved(write(tmp_path, BASE))
    assert r.router.policy == "cache_aware"
    assert r.router.port_range == (20000, 20999)
    assert r.router.no_healthy_backend_status == 409
    assert r.router.max_attempts == 2
    assert r.generation.pipeline_parallel_size == 1
    assert r.generation.served_model_name == "Qwen/Qwen3-8B"
    assert r.gym.model_name == "Qwen/Qwen3-8B"
    assert r.total_nodes == 3
    assert r.slurm is not None and r.slurm.layout == "single"
    assert (r.slurm.time, r.slurm.time_min) == ("02:00:00", 120)
    assert r.job_root == str(tmp_path / "jobs")
    assert r.job_dir(123) == tmp_path / "jobs" / "t-123"
    assert r.gym_overlay_path(r.job_dir(123)) == tmp_path / "jobs" / "t-123" / "gym_overlay.yaml"
    # the dry-run YAML round-trips
    assert yaml.safe_load(r.to_yaml())["generation"]["engines_per_node"] == 8


def test_default_job_root_expands_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    r = parse_spec(
        {"name": "x", "cluster": "local", "training": {"command": "c"}, "generation": {"engine": "sim"}}
    )
    assert r.resolved().job_root == str(tmp_path / "rl-launch" / "jobs")


@pytest.mark.parametrize(
    ("changes", "per_node"),
    [
        ({}, 8),
        ({"generation.tensor_parallel_size": 2}, 4),
        ({"generation.tensor_parallel_size": 3}, 2),
        ({"generation.tensor_parallel_size": 2, "generation.pipeline_parallel_size": 2}, 2),
        ({"generation.tensor_parallel_size": 8}, 1),
        ({"generation.tensor_parallel_size": 2, "generation.engines_per_node": 3}, 3),
        ({"slurm.gpus_per_node": 0, "generation.engine": "sim", "generation.model": None}, 1),
        ({"slurm.gpus_per_node": 0, "generation.allow_cpu": True}, 1),
    ],
)
def test_engines_per_node_derivation(tmp_path: Path, changes: dict, per_node: int) -> None:
    r = load_resolved(with_changes(tmp_path, changes))
    assert r.generation.engines_per_node == per_node
    assert r.generation.num_engines == per_node * 2


def test_unquoted_time_is_not_base_60(tmp_path: Path) -> None:
    """PyYAML would read 4:00:00 as 14400 (base 60), i.e. 10 days as minutes."""
    path = write(tmp_path, BASE.replace('time: "02:00:00"', "time: 4:00:00"))
    r = load_resolved(path)
    assert r.slurm is not None and (r.slurm.time, r.slurm.time_min) == ("04:00:00", 240)


def test_local_ignores_slurm_settings(tmp_path: Path) -> None:
    path = with_changes(
        tmp_path,
        {"cluster": "local", "slurm.gpus_per_node": 0, "slurm.time": None, "generation.nodes": 1},
    )
    r = load_resolved(path)
    assert r.slurm is None and r.generation.resources is None
    assert r.generation.engines_per_node == 1 and r.total_nodes == 1
    assert split_nodes(r).training == ("localhost",)


def test_env_values_become_strings_and_non_secrets_pass(tmp_path: Path) -> None:
    path = with_changes(tmp_path, {"training.env": {"OMP_NUM_THREADS": 8, "TOKENIZERS_PARALLELISM": "false"}})
    assert load_resolved(path).training.env == {"OMP_NUM_THREADS": "8", "TOKENIZERS_PARALLELISM": "false"}


# ---------------------------------------------------------------------------------------------------
# Bad specs: every error names the file and the field, and says what to do
# ---------------------------------------------------------------------------------------------------


BAD_CASES = [
    # (changes, field path, words in the message)
    ({"slurm.tiem": "1:00:00"}, "slurm.tiem", ["unknown field", "did you mean 'time'"]),
    ({"generation.tensor_parallel_size": "two"}, "generation.tensor_parallel_size", ["must be an integer"]),
    ({"slurm.gpus_per_node": "8"}, "slurm.gpus_per_node", ["remove the quotes"]),
    ({"generation.tensor_parallel_size": 0}, "generation.tensor_parallel_size", ["must be >= 1 (got 0)"]),
    ({"generation.model": None}, "generation.model", ["required when generation.engine is 'vllm'"]),
    (
        {"generation.tensor_parallel_size": 4, "generation.pipeline_parallel_size": 4},
        "generation.tensor_parallel_size",
        ["16 GPUs per engine", "8 GPUs of one node", "not supported yet"],
    ),
    ({"generation.engines_per_node": 9}, "generation.engines_per_node", ["at most 8"]),
    ({"slurm.time": "4 hours"}, "slurm.time", ["not a Slurm time", "D-H:M:S"]),
    ({"slurm.time": "1:75:00"}, "slurm.time", ["minutes must be < 60"]),
    ({"slurm.time": "UNLIMITED"}, "slurm.time", ["finite"]),
    ({"slurm.time": None}, "slurm.time", ["required with cluster: slurm"]),
    ({"router.no_healthy_backend_status": 503}, "router.no_healthy_backend_status", ["retried by clients"]),
    ({"router.no_healthy_backend_status": 429}, "router.no_healthy_backend_status", ["retried by clients"]),
    ({"router.no_healthy_backend_status": 200}, "router.no_healthy_backend_status", ["4xx"]),
    ({"router.policy": "fastest"}, "router.policy", ["unknown routing policy", "cache_aware"]),
    ({"router.port_range": "10500-10600"}, "router.port_range", ["Ray worker ports", "20000-20999"]),
    ({"router.port_range": [21000, 20000]}, "router.port_range", ["LOW <= HIGH"]),
    ({"cluster": "aws"}, "cluster", ["must be one of", "'slurm'"]),
    ({"slurm.gpus_per_node": 0}, "slurm.gpus_per_node", ["generation.allow_cpu: true"]),
    ({"training.command": None}, "training.command", ["required field is missing"]),
    ({"training.nodes": 0}, "training.nodes", [">= 1"]),
    ({"training.env": {"HF_TOKEN": "x"}}, "training.env", ["secret", "export it"]),
    ({"generation.env": {"WANDB_API_KEY": "x"}}, "generation.env", ["secret"]),
    ({"generation.vllm_args": ["--api-key", "x"]}, "generation.vllm_args", ["generates the API key"]),
    (
        {"generation.vllm_args": ["--tensor-parallel-size=2"]},
        "generation.vllm_args",
        ["tensor_parallel_size"],
    ),
    ({"generation.sim": {"speed": 2}}, "generation.sim", ["engine: sim"]),
    ({"slurm.extra_sbatch": ["--nodes=4"]}, "slurm.extra_sbatch", ["set training.nodes"]),
    ({"slurm.extra_sbatch": ["-C h100"]}, "slurm.extra_sbatch", ["long"]),
    ({"slurm.extra_sbatch": ["--gres=gpu:8"]}, "slurm.extra_sbatch", ["gpu_request: gres"]),
    ({"slurm.mem": "lots"}, "slurm.mem", ["memory size"]),
    ({"name": "my job"}, "name", ["letters, digits"]),
    ({"cluster": "local", "generation.nodes": 2}, "generation.nodes", ["must be 1 with cluster: local"]),
    (
        {"generation.engine": "sim", "generation.model": None, "generation.sim": {"speeed": 2}},
        "generation.sim.speeed",
        ["did you mean 'speed'"],
    ),
    (
        {"generation.engine": "sim", "generation.model": None, "generation.sim": {"max_num_seqs": 1.5}},
        "generation.sim.max_num_seqs",
        ["must be of type int"],
    ),
    (
        {"generation.engine": "sim", "generation.model": None, "generation.sim": {"speed": 0}},
        "generation.sim",
        ["speed must be > 0"],
    ),
    (
        {"generation.engine": "sim", "generation.model": None, "generation.sim": {"fault": "boom"}},
        "generation.sim.fault",
        ["fault mode"],
    ),
]


@pytest.mark.parametrize(("changes", "field", "words"), BAD_CASES, ids=[c[1] for c in BAD_CASES])
def test_bad_spec_names_file_and_field(tmp_path: Path, changes: dict, field: str, words: list[str]) -> None:
    path = with_changes(tmp_path, changes)
    err = spec_error(path)
    text = str(err)
    assert str(path) in text
    assert f": {field}: " in text, text
    for word in words:
        assert word in text, text
    assert any(issue.path == field for issue in err.issues)


def test_error_lines_carry_line_numbers(tmp_path: Path) -> None:
    path = write(tmp_path, BASE.replace("  nodes: 2\n", "  nodes: 2\n  tensor_parallel_size: 0\n"))
    text = str(spec_error(path))
    line = BASE.splitlines().index("  nodes: 2") + 2  # the inserted line, 1-based
    assert text.startswith(f"{path}:{line}: generation.tensor_parallel_size: must be >= 1 (got 0)")


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = with_changes(tmp_path, {"slurm.tiem": 1, "training.nodes": 0, "router.policy": "x"})
    err = spec_error(path)
    assert {i.path for i in err.issues} == {"slurm.tiem", "training.nodes", "router.policy"}
    assert str(err).splitlines()[0] == f"{path}: 3 problems in the job spec:"


def test_duplicate_keys_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path, BASE + "name: again\n")
    text = str(spec_error(path))
    assert f"{path}:" in text and "name: given twice" in text


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("name: [unclosed\n", ["YAML syntax error"]),
        ("- a\n- b\n", ["must be a YAML mapping"]),
        ("", ["must be a YAML mapping", "empty"]),
    ],
)
def test_unparseable_files(tmp_path: Path, text: str, words: list[str]) -> None:
    path = write(tmp_path, text)
    msg = str(spec_error(path))
    assert msg.startswith(str(path))
    for word in words:
        assert word in msg


def test_missing_file(tmp_path: Path) -> None:
    assert "no such file" in str(spec_error(tmp_path / "nope.yaml"))


def test_cpu_vllm_allowed_when_explicit(tmp_path: Path) -> None:
    r = load_resolved(with_changes(tmp_path, {"slurm.gpus_per_node": 0, "generation.allow_cpu": True}))
    assert r.generation.gpus_per_engine == 0 and r.generation.engine == "vllm"


# ---------------------------------------------------------------------------------------------------
# Time strings
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (90, 5400),
        ("90", 5400),
        ("90:30", 5430),
        ("04:00:00", 14400),
        ("1-00:00:00", 86400),
        ("2-12", 2 * 86400 + 12 * 3600),
        ("1-02:30", 86400 + 2 * 3600 + 30 * 60),
        ("0:0:30", 30),
    ],
)
def test_parse_time(value: str | int, seconds: int) -> None:
    assert parse_time(value) == seconds


@pytest.mark.parametrize(
    "value", ["", "4h", "1:2:3:4", "1-25:00:00", "1:00:60", "0", 0, -5, "infinite", True]
)
def test_parse_time_refuses(value: str | int) -> None:
    with pytest.raises(ValueError):
        parse_time(value)


def test_format_time() -> None:
    assert format_time(30) == "00:00:30"
    assert format_time(86400 + 3661) == "1-01:01:01"


# ---------------------------------------------------------------------------------------------------
# Slurm request
# ---------------------------------------------------------------------------------------------------


def test_single_allocation_request(tmp_path: Path) -> None:
    path = with_changes(
        tmp_path,
        {
            "slurm.account": "acct",
            "slurm.exclusive": True,
            "slurm.mem": "0",
            "slurm.cpus_per_task": 32,
            "slurm.extra_sbatch": ["--mail-type=END", "--requeue"],
            "slurm.container": {"image": "nvcr.io/x/y:1", "mounts": ["/lustre:/lustre", "/a:/b:ro"]},
            "generation.tensor_parallel_size": 2,
        },
    )
    r = load_resolved(path)
    req = build_request(r)
    assert req.layout == "single" and len(req.components) == 1 and req.total_nodes == 3
    lines = req.directive_lines
    for expected in (
        "#SBATCH --job-name=t",
        "#SBATCH --nodes=3",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=32",
        "#SBATCH --partition=batch",
        "#SBATCH --account=acct",
        "#SBATCH --time=02:00:00",
        "#SBATCH --exclusive",
        "#SBATCH --mem=0",
        "#SBATCH --mail-type=END",
        "#SBATCH --requeue",
        f"#SBATCH --output={tmp_path / 'jobs'}/t-%j.out",
    ):
        assert expected in lines
    assert "#SBATCH hetjob" not in lines
    assert req.srun_args == ("--container-image=nvcr.io/x/y:1", "--container-mounts=/lustre:/lustre,/a:/b:ro")
    assert req.submitit_parameters == {
        "name": "t",
        "nodes": 3,
        "tasks_per_node": 1,
        "timeout_min": 120,
        "cpus_per_task": 32,
        "gpus_per_node": 8,
        "slurm_partition": "batch",
        "slurm_account": "acct",
        "slurm_mem": "0",
        "slurm_exclusive": True,
        "slurm_use_srun": False,
        "slurm_additional_parameters": {"mail-type": "END", "requeue": True, "signal": "B:USR2@90"},
    }
    assert "#SBATCH --signal=B:USR2@90" in lines


def test_submitit_accepts_the_parameters(tmp_path: Path, no_sbatch: Path) -> None:
    # no_sbatch: submitit's Slurm executor wants an `srun` on PATH (a recording one that must stay unused),
    # so this runs, and means the same, on a machine without Slurm
    submitit = pytest.importorskip("submitit")
    path = with_changes(
        tmp_path, {"slurm.qos": "high", "slurm.constraint": "h100", "slurm.extra_sbatch": ["--requeue"]}
    )
    params = build_request(load_resolved(path)).submitit_parameters
    assert params is not None
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(**params)  # raises on any name or value submitit does not accept
    # the batch script submitit would write: our warning signal replaces its --signal=USR2@90 (which
    # every step received), and the setup line execs the driver so the batch shell is the driver
    inner = executor._executor  # type: ignore[attr-defined]
    request = build_request(load_resolved(path))
    executor.update_parameters(slurm_setup=request.submitit_setup_for(executor))
    text = inner._make_submission_file_text(inner._submitit_command_str, "uid")
    signals = [line for line in text.splitlines() if "--signal" in line]
    assert signals == ["#SBATCH --signal=B:USR2@90"]
    assert f"exec {inner._submitit_command_str}" in text.splitlines()
    assert not no_sbatch.exists()


def test_gres_gpu_request(tmp_path: Path) -> None:
    req = build_request(load_resolved(with_changes(tmp_path, {"slurm.gpu_request": "gres"})))
    assert "#SBATCH --gres=gpu:8" in req.directive_lines
    assert not any("gpus-per-node" in line for line in req.directive_lines)
    assert req.submitit_parameters is not None and req.submitit_parameters["slurm_gres"] == "gpu:8"
    assert "gpus_per_node" not in req.submitit_parameters


def test_role_overrides_equal_to_base_stay_single(tmp_path: Path) -> None:
    path = with_changes(tmp_path, {"generation.slurm": {"partition": "batch", "gpus_per_node": 8}})
    assert build_request(load_resolved(path)).layout == "single"


def test_different_role_resources_make_a_hetjob(tmp_path: Path) -> None:
    path = with_changes(
        tmp_path,
        {
            "slurm.account": "acct",
            "training.slurm": {"partition": "train", "constraint": "h100&ib"},
            "generation.slurm": {"gpus_per_node": 4, "extra_sbatch": ["--comment=gen"]},
            "generation.tensor_parallel_size": 4,
        },
    )
    r = load_resolved(path)
    assert r.slurm is not None and r.slurm.layout == "hetjob"
    assert r.generation.engines_per_node == 1
    req = build_request(r)
    assert req.layout == "hetjob" and req.submitit_parameters is None
    train, gen = req.components
    assert (train.role, train.nodes, gen.role, gen.nodes) == ("training", 1, "generation", 2)
    assert (
        "#SBATCH --partition=train" in train.directives and "#SBATCH --constraint=h100&ib" in train.directives
    )
    assert "#SBATCH --gpus-per-node=8" in train.directives
    assert "#SBATCH --partition=batch" in gen.directives and "#SBATCH --gpus-per-node=4" in gen.directives
    assert "#SBATCH --comment=gen" in gen.directives and "#SBATCH --comment=gen" not in train.directives
    for component in (train, gen):  # explicit in both, never left to Slurm's propagation rules
        assert "#SBATCH --time=02:00:00" in component.directives
        assert "#SBATCH --account=acct" in component.directives
    assert "#SBATCH --job-name=t" in train.directives and not any("job-name" in d for d in gen.directives)
    lines = req.directive_lines
    assert lines.index("#SBATCH hetjob") == len(train.directives)


def test_tp_check_uses_the_generation_override(tmp_path: Path) -> None:
    path = with_changes(
        tmp_path, {"generation.slurm": {"gpus_per_node": 4}, "generation.tensor_parallel_size": 8}
    )
    text = str(spec_error(path))
    assert "generation.tensor_parallel_size" in text and "generation.slurm.gpus_per_node" in text


def test_build_request_refuses_local(tmp_path: Path) -> None:
    r = load_resolved(REPO / "examples" / "local.yaml")
    with pytest.raises(ValueError, match="local"):
        build_request(r)


# ---------------------------------------------------------------------------------------------------
# Node split
# ---------------------------------------------------------------------------------------------------


def test_expand_hostlist() -> None:
    assert expand_hostlist("n[08-10],gpu5") == ["n08", "n09", "n10", "gpu5"]
    assert expand_hostlist("a[1-2]-b[3,5]") == ["a1-b3", "a1-b5", "a2-b3", "a2-b5"]
    assert expand_hostlist("solo") == ["solo"]
    with pytest.raises(ValueError):
        expand_hostlist("n[1-")


def test_split_single_allocation_by_sorted_index(tmp_path: Path) -> None:
    r = load_resolved(write(tmp_path, BASE))
    split = split_nodes(r, env={"SLURM_JOB_NODELIST": "gpu[10,2-3]"})
    assert split.training == ("gpu2",) and split.generation == ("gpu3", "gpu10")
    with pytest.raises(ValueError, match="2 nodes but the spec asks"):
        split_nodes(r, env={"SLURM_JOB_NODELIST": "gpu[1-2]"})
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        split_nodes(r, env={})


def test_split_hetjob_by_component(tmp_path: Path) -> None:
    r = load_resolved(with_changes(tmp_path, {"training.slurm": {"partition": "train"}}))
    env = {"SLURM_JOB_NODELIST_HET_GROUP_0": "t1", "SLURM_JOB_NODELIST_HET_GROUP_1": "g[2,1]"}
    split = split_nodes(r, env=env)
    assert split.training == ("t1",) and split.generation == ("g1", "g2")
    assert split.all == ("t1", "g1", "g2")


# ---------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------


def test_template_is_package_data() -> None:
    assert resources.files("launcher.templates").joinpath("sbatch.j2").is_file()


def _shellcheck(tmp_path: Path, script: str) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck, brew install shellcheck)")
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    result = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def _rendered(tmp_path: Path, hetjob: bool) -> tuple[ResolvedSpec, str]:
    """A resolved spec (one hetjob component per role when asked) and its rendered sbatch script."""
    changes: dict = {"slurm.extra_sbatch": ["--mail-type=END"]}
    if hetjob:
        changes["generation.slurm"] = {"partition": "gen"}
    r = load_resolved(with_changes(tmp_path, changes))
    return r, render_sbatch(r, rl_launch=["/opt/venv with space/bin/rl-launch"])


@pytest.mark.parametrize("hetjob", [False, True])
def test_rendered_script(tmp_path: Path, hetjob: bool) -> None:
    r, script = _rendered(tmp_path, hetjob)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for directive in build_request(r).directive_lines:
        assert directive in lines
    assert ("#SBATCH hetjob" in lines) is hetjob
    # every directive precedes the first command, or sbatch would ignore it
    first_command = lines.index("set -euo pipefail")
    assert max(i for i, line in enumerate(lines) if line.startswith("#SBATCH")) < first_command
    assert f'job_dir={tmp_path / "jobs"}/t-"${{SLURM_JOB_ID}}"' in script
    assert (
        f"exec '/opt/venv with space/bin/rl-launch' submit {tmp_path / 'spec.yaml'} "
        '--in-allocation --job-dir "$job_dir"' in script
    )


@pytest.mark.shellcheck
@pytest.mark.parametrize("hetjob", [False, True])
def test_rendered_script_is_shellcheck_clean(tmp_path: Path, hetjob: bool) -> None:
    _shellcheck(tmp_path, _rendered(tmp_path, hetjob)[1])


def test_render_finds_an_rl_launch(tmp_path: Path) -> None:
    r = load_resolved(write(tmp_path, BASE))
    assert " submit " in render_sbatch(r)


# ---------------------------------------------------------------------------------------------------
# CLI (nothing is ever submitted)
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def no_sbatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """PATH whose only sbatch/srun/salloc record their calls; returns the record file."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    record = tmp_path / "slurm-calls"
    for tool in ("sbatch", "srun", "salloc"):
        exe = bin_dir / tool
        exe.write_text(f'#!/bin/sh\necho "{tool} $*" >> {record}\nexit 1\n')
        exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("submit_job must not be called")

    monkeypatch.setattr("launcher.submit.job.submit_job", forbidden)
    return record


def test_cli_validate_ok(no_sbatch: Path) -> None:
    result = CliRunner().invoke(main, ["validate", str(REPO / "examples" / "slurm-vllm-fleet-client.yaml")])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("OK ")
    assert "2 node(s) x 4 engine(s) = 8 vllm /lustre/my-project/models/Qwen3-8B" in result.stdout
    assert not no_sbatch.exists()


def test_cli_validate_error_exits_2(tmp_path: Path, no_sbatch: Path) -> None:
    path = with_changes(tmp_path, {"generation.tensor_parallel_size": 0})
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2
    assert (
        f"{path}:" in result.stderr
        and "generation.tensor_parallel_size: must be >= 1 (got 0)" in result.stderr
    )
    assert "Traceback" not in result.output


def test_cli_render_writes_script(tmp_path: Path, no_sbatch: Path) -> None:
    path = write(tmp_path, BASE)
    out = tmp_path / "out" / "job.sbatch"
    result = CliRunner().invoke(main, ["render", str(path), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert str(out) in result.stdout and out.is_file()
    assert "#SBATCH --nodes=3" in out.read_text()
    assert (tmp_path / "jobs").is_dir()  # the batch log's directory exists before sbatch runs
    default = CliRunner().invoke(main, ["render", str(path)])
    assert default.exit_code == 0 and (tmp_path / "jobs" / "t.sbatch").is_file()
    stdout = CliRunner().invoke(main, ["render", str(path), "-o", "-"])
    assert stdout.stdout.startswith("#!/bin/bash")
    assert not no_sbatch.exists()


def test_cli_render_refuses_local(no_sbatch: Path) -> None:
    result = CliRunner().invoke(main, ["render", str(REPO / "examples" / "local.yaml"), "-o", "-"])
    assert result.exit_code != 0 and "local" in result.output


@pytest.mark.parametrize("example", [p.name for p in EXAMPLES])
def test_cli_submit_dry_run_submits_nothing(example: str, no_sbatch: Path) -> None:
    result = CliRunner().invoke(main, ["submit", str(REPO / "examples" / example), "--dry-run"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "nothing was submitted" in out
    resolved_yaml = out.split("\n\n", 1)[0]
    generation = yaml.safe_load(resolved_yaml)["generation"]
    # rl-launch starts the engines, or none: (owner: trainer) the trainer's own register, or (fleet) the
    # standing fleet's serve it
    assert generation["num_engines"] >= 1 or generation["owner"] == "trainer" or generation["fleet"]
    if yaml.safe_load(resolved_yaml)["cluster"] != "local":
        assert "#SBATCH --nodes=" in out and "timeout_min:" in out
    assert not no_sbatch.exists()


def test_cli_submit_dry_run_hetjob(tmp_path: Path, no_sbatch: Path) -> None:
    path = with_changes(tmp_path, {"training.slurm": {"partition": "train"}})
    result = CliRunner().invoke(main, ["submit", str(path), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "#SBATCH hetjob" in result.stdout and "submitit parameters: none" in result.stdout
    assert not no_sbatch.exists()


def test_cli_submit_calls_submit_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []
    monkeypatch.setattr("launcher.submit.job.submit_job", lambda spec, **kw: calls.append((spec, kw)))
    bin_dir = tmp_path / "bin"  # --in-allocation checks that srun exists (a Slurm-less machine has none)
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    path = write(tmp_path, BASE)
    result = CliRunner().invoke(
        main, ["submit", str(path), "--in-allocation", "--job-dir", str(tmp_path / "jd"), "--follow"]
    )
    assert result.exit_code == 0, result.output
    ((spec, kw),) = calls
    assert spec.name == "t"
    assert kw == {"follow": True, "in_allocation": True, "job_dir": tmp_path / "jd", "as_json": False}


def test_cli_submit_bad_spec_exits_2_before_submitting(tmp_path: Path, no_sbatch: Path) -> None:
    path = with_changes(tmp_path, {"router.policy": "fastest"})
    for args in (["submit", str(path)], ["submit", str(path), "--dry-run"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and "router.policy" in result.stderr


def test_cli_dry_run_and_in_allocation_exclude(tmp_path: Path, no_sbatch: Path) -> None:
    result = CliRunner().invoke(main, ["submit", str(write(tmp_path, BASE)), "--dry-run", "--in-allocation"])
    assert result.exit_code == 2 and "exclude" in result.output


def test_submit_surfaces_sbatchs_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm's own message reaches the user and nothing is left queued (here a fake sbatch refuses)."""
    from launcher.submit.job import SubmitError, submit_job

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "sbatch"
    fake.write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: batch' >&2\nexit 1\n")
    fake.chmod(0o755)
    srun = bin_dir / "srun"  # submitit's Slurm executor wants one on PATH; it is never run here
    srun.write_text("#!/bin/sh\nexit 1\n")
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(SubmitError, match="invalid partition specified: batch"):
        submit_job(load_resolved(write(tmp_path, BASE)))


def test_submit_without_slurm_commands_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))  # no sbatch, no srun
    spec = write(tmp_path, BASE)
    result = CliRunner().invoke(main, ["submit", str(spec)])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"Error: `sbatch` and `srun` not found on PATH, and submitting {spec} (cluster: slurm) needs the "
        "Slurm client: run it on a Slurm login node (or add Slurm's bin directory to PATH), or set "
        "`cluster: local` to run on this machine"
    ]
    assert not (tmp_path / "jobs").exists()  # nothing was started or written


# --------------------------------------------------------------------------------------------------
# Layering: what `rl-launch --help` / `validate` import, and no import cycle between spec and slurm
# --------------------------------------------------------------------------------------------------

HEAVY_MODULES = ("aiohttp", "ray", "numpy", "submitit", "router.server", "router.cli", "launcher.cli.bench")


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys\nprint('\\n'.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout
    return set(out.split())


@pytest.mark.parametrize("argv", [["--help"], ["validate", "examples/slurm-sim.yaml"]])
def test_help_and_validate_import_nothing_heavy(argv: list[str]) -> None:
    code = f"from launcher.cli.main import main\nmain({argv!r}, standalone_mode=False)"
    loaded = _modules_after(code)
    assert "launcher.spec" in loaded or argv == ["--help"]
    assert sorted(m for m in HEAVY_MODULES if m in loaded) == []


def test_lazy_command_list_matches_the_commands_own_help() -> None:
    from launcher.cli.main import COMMANDS, load_command

    for name, (_, _, short) in COMMANDS.items():
        command = load_command(name)
        assert command.name == name
        assert command.get_short_help_str(limit=10**6) == short


def test_spec_and_slurm_packages_do_not_import_each_other_in_a_cycle() -> None:
    # the spec uses the pure Slurm syntax modules; the request builder reads the spec, not the reverse
    assert "launcher.spec" not in _modules_after("import launcher.slurm.time, launcher.slurm.options")
    loaded = _modules_after("import launcher.spec")
    assert "launcher.slurm.request" not in loaded and "launcher.slurm.nodes" not in loaded


# --------------------------------------------------------------------------------------------------
# --set overrides, --json, the resolved snapshot
# --------------------------------------------------------------------------------------------------


def test_set_overrides_are_parsed_as_yaml_and_validated_like_the_file(tmp_path: Path) -> None:
    path = with_changes(tmp_path, {})
    r = load_resolved(
        path,
        [
            "generation.nodes=4",
            "slurm.time=1:30:00",  # stays a string (no base-60 int), normalized like the file's
            "generation.vllm_args=[--max-model-len, 8192]",
            "training.env.NCCL_DEBUG=WARN",  # creates the mapping entry
            "slurm.exclusive=true",
        ],
    )
    assert r.generation.nodes == 4 and r.total_nodes == 5
    assert r.slurm is not None and r.slurm.time == "01:30:00" and r.generation.resources.exclusive is True
    assert r.generation.vllm_args == ("--max-model-len", "8192")
    assert r.training.env == {"NCCL_DEBUG": "WARN"}
    assert load_resolved(path).generation.nodes == 2  # the file itself is unchanged


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("generation.nodes=x", "--set generation.nodes=x: must be an integer (got 'x')"),
        ("generation.nodez=3", "--set generation.nodez=3: unknown field; did you mean 'nodes'?"),
        ("generation.nodes", "--set generation.nodes: expected KEY.PATH=VALUE"),
        ("training.command.x=1", "--set training.command.x=1: training.command is not a section"),
        (
            "generation.tensor_parallel_size=16",
            "--set generation.tensor_parallel_size=16: tensor_parallel_size",
        ),
    ],
)
def test_set_errors_name_the_override(tmp_path: Path, override: str, message: str) -> None:
    with pytest.raises(SpecError) as err:
        load_resolved(with_changes(tmp_path, {}), [override])
    assert message in str(err.value)


def test_cli_set_on_validate_render_and_submit_dry_run(tmp_path: Path, no_sbatch: Path) -> None:
    path = with_changes(tmp_path, {})
    runner = CliRunner()
    ok = runner.invoke(main, ["validate", str(path), "--set", "generation.nodes=3"])
    assert ok.exit_code == 0 and "generation: 3 node(s)" in ok.output
    bad = runner.invoke(main, ["validate", str(path), "--set", "generation.nodes=x"])
    assert bad.exit_code == 2 and "--set generation.nodes=x: must be an integer" in bad.output
    script = runner.invoke(main, ["render", str(path), "-o", "-", "--set", "generation.nodes=3"]).output
    assert "#SBATCH --nodes=4" in script
    assert script.splitlines()[-1].endswith(
        f'submit {path} --set generation.nodes=3 --in-allocation --job-dir "$job_dir"'
    )
    dry = runner.invoke(main, ["submit", str(path), "--dry-run", "--set", "generation.nodes=3"])
    assert dry.exit_code == 0 and "#SBATCH --nodes=4" in dry.output
    assert not no_sbatch.exists() or no_sbatch.read_text() == ""


def test_cli_validate_json(tmp_path: Path) -> None:
    path = with_changes(tmp_path, {})
    ok = CliRunner().invoke(main, ["validate", str(path), "--json"])
    data = json.loads(ok.output)
    assert ok.exit_code == 0 and data["ok"] is True and data["resolved"]["generation"]["num_engines"] == 16
    bad = CliRunner().invoke(main, ["validate", str(path), "--json", "--set", "generation.nodes=0"])
    data = json.loads(bad.output)
    assert bad.exit_code == 2 and data["ok"] is False
    assert data["issues"] == [
        {"path": "--set generation.nodes=0", "line": None, "message": "must be >= 1 (got 0)"}
    ]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_resolved_snapshot_round_trips(example: Path, tmp_path: Path) -> None:
    from launcher.spec import load_snapshot

    resolved = load_resolved(example)
    snapshot = tmp_path / "spec.resolved.yaml"
    snapshot.write_text(resolved.to_yaml())
    assert load_snapshot(snapshot) == resolved


def test_snapshot_errors_name_the_file(tmp_path: Path) -> None:
    from launcher.spec import load_snapshot

    data = yaml.safe_load(load_resolved(EXAMPLES[0]).to_yaml())
    data["generation"]["surprise"] = 1
    bad = tmp_path / "snap.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError, match=r"snap\.yaml: generation\.surprise: "):
        load_snapshot(bad)
    with pytest.raises(SpecError, match="no such file"):
        load_snapshot(tmp_path / "missing.yaml")


# --------------------------------------------------------------------------------------------------
# Hostile YAML: alias bombs and deep nesting are refused at once, with one line
# --------------------------------------------------------------------------------------------------

ALIAS_BOMB = "\n".join(
    ["a: &a [x, x, x, x, x, x, x, x, x]"]
    + [
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]"
        for i in range(8)
    ]
    + ["name: *i", "training: {command: x}"]
)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (ALIAS_BOMB, "expands to more than 100,000 values once aliases (*name) are followed"),
        ("name: " + "[" * 5000 + "]" * 5000, "nested more than 64 levels deep"),
        ("name: &a [*a]\ntraining: {command: x}", "refers to a node that contains it"),
    ],
    ids=["alias-bomb", "deep-nesting", "recursive-alias"],
)
def test_hostile_yaml_is_refused_in_one_line_at_once(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    start = time.monotonic()
    result = CliRunner().invoke(main, ["validate", str(path)])
    elapsed = time.monotonic() - start
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and re.match(rf"{re.escape(str(path))}:\d+: YAML refused: ", lines[0])
    assert message in lines[0]
    assert elapsed < 5  # bounded work (the bomb took > 50 s before); the target (< 1 s) is printed by bench


def test_job_outputs_default_into_the_job_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a job (the driver exports the job directory), the replay's default results and the
    simulator's scratch files go into it, not into the submit directory or a shared /tmp."""
    from launcher.bench.replay import default_results_dir
    from launcher.engines.sim.process import scratch_root

    monkeypatch.delenv("RL_JOB_DIR", raising=False)
    monkeypatch.delenv("RL_LAUNCH_JOB_DIR", raising=False)
    assert default_results_dir() == Path("bench/results") and scratch_root() is None
    monkeypatch.setenv("RL_JOB_DIR", str(tmp_path / "job"))
    monkeypatch.setenv("RL_LAUNCH_JOB_DIR", str(tmp_path / "job"))
    assert default_results_dir() == tmp_path / "job" / "bench"
    assert scratch_root() == str(tmp_path / "job" / "scratch") and (tmp_path / "job" / "scratch").is_dir()
