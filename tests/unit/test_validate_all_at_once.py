"""``rl-launch validate`` names every problem in one run, and what would only fail at run time.

Before: a spec with five mistakes of different passes showed four lines, two of them for one typo
(``comand``: "required field is missing" and "unknown field"), and neither the simulator's option nor the
cross-field rule: those ran only on a spec the schema accepted, so each showed after the others were
fixed. A missing model directory, a hub id the offline engines cannot fetch and vLLM engines without the
refit switch were all "OK".
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli.main import main
from launcher.spec import SpecError, load_spec
from launcher.spec.machine import Machine

FIVE_MISTAKES = """\
name: five-mistakes
cluster: local
training:
  nodes: 2
  comand: python train.py
generation:
  engine: sim
  engines_per_node: four
  sim:
    speed: fast
router:
  polcy: cache_aware
"""

VLLM_LOCAL = """\
name: v
cluster: local
training:
  command: "true"
generation:
  engine: vllm
  model: {model}
"""


def write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def validate(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["validate", *args])
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(autouse=True)
def engine_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine has an engine python: the vLLM specs here are judged on their own problems, whether
    or not the machine running the tests has vLLM (the no-vLLM check: tests/unit/test_no_vllm.py)."""
    monkeypatch.setenv("RL_LAUNCH_VLLM_PYTHON", sys.executable)


def test_five_mistakes_of_different_passes_are_named_at_once_one_line_each(tmp_path: Path) -> None:
    path = write(tmp_path, FIVE_MISTAKES)
    code, _, err = validate(str(path))
    lines = err.strip().splitlines()
    assert code == 2
    assert lines[0] == f"{path}: 5 problems in the job spec:", err
    found = [line.strip().split(": ", 2)[1] for line in lines[1:]]
    assert found == [
        "training.nodes",  # a rule across fields (cluster: local)
        "training.comand",  # an unknown field (the typo)
        "generation.engines_per_node",  # a type
        "generation.sim.speed",  # the simulator's own option (its kind's rules)
        "router.polcy",  # an unknown field of a kind's section
    ], err
    assert "did you mean 'command'" in lines[2] and "required field is missing" not in err
    assert "must be of type float (got 'fast')" in lines[4]


def test_a_misspelt_required_field_is_one_mistake(tmp_path: Path) -> None:
    path = write(
        tmp_path, "name: t\ncluster: local\ntraining:\n  comand: 'true'\ngeneration: {engine: sim}\n"
    )
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert [(i.path, i.message) for i in info.value.issues] == [
        ("training.comand", "unknown field; did you mean 'command'? rename it (command is required)")
    ]


def test_duplicate_keys_join_the_other_problems(tmp_path: Path) -> None:
    path = write(
        tmp_path, "name: t\ncluster: local\ntraining: {command: 'true'}\ngeneration:\n  engine: sim\n"
        "  engine: sim\n  nodes: 0\n"
    )  # fmt: skip
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert [i.path for i in info.value.issues] == ["generation.engine", "generation.nodes"]


def test_known_fields_lists_are_short(tmp_path: Path) -> None:
    path = write(tmp_path, FIVE_MISTAKES)
    _, _, err = validate(str(path))
    polcy = next(line for line in err.splitlines() if "router.polcy" in line)
    assert "did you mean 'policy'?" in polcy and "more (docs/spec.md)" in polcy
    assert len(polcy) - len(str(path)) < 200, polcy
    sim = write(tmp_path, FIVE_MISTAKES.replace("speed: fast", "speeed: 2"), "sim.yaml")
    speeed = next(line for line in validate(str(sim))[2].splitlines() if "generation.sim.speeed" in line)
    assert speeed.endswith("unknown simulator option; did you mean 'speed'?"), speeed


def test_a_missing_model_directory_is_an_error_with_cluster_local_and_a_warning_on_slurm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, VLLM_LOCAL.format(model=tmp_path / "no-such-model"))
    code, _, err = validate(str(path))
    assert code == 2
    assert f"generation.model: {tmp_path / 'no-such-model'} does not exist on this machine" in err
    (tmp_path / "no-such-model").mkdir()
    code, out, err = validate(str(path))
    assert code == 0 and out.startswith("OK"), err
    slurm = write(
        tmp_path,
        VLLM_LOCAL.format(model="./elsewhere").replace(
            "cluster: local", 'cluster: slurm\nslurm: {time: "01:00:00", gpus_per_node: 8}'
        ),
        "slurm.yaml",
    )
    code, out, err = validate(str(slurm))
    assert code == 0 and "warning: generation.model: ./elsewhere does not exist on this machine" in err
    assert "rl-launch check" in err
    assert validate(str(slurm), "--strict")[0] == 2


def test_a_hub_id_the_offline_engines_cannot_fetch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    path = write(tmp_path, VLLM_LOCAL.format(model="Qwen/Qwen3-0.6B"))
    code, _, err = validate(str(path))
    assert code == 2
    assert "hf download Qwen/Qwen3-0.6B --local-dir DIR" in err and "set model: DIR" in err
    (cache / "models--Qwen--Qwen3-0.6B" / "snapshots" / "abc").mkdir(parents=True)
    assert validate(str(path))[0] == 0  # in the cache: the offline engines find it
    online = write(tmp_path, VLLM_LOCAL.format(model="Qwen/Qwen3-4B") + "  env: {HF_HUB_OFFLINE: '0'}\n")
    assert "hf download" not in validate(str(online))[2]


def test_vllm_engines_without_the_refit_switch_are_warned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    (tmp_path / "m").mkdir()
    path = write(tmp_path, VLLM_LOCAL.format(model=tmp_path / "m"))
    code, out, err = validate(str(path))
    assert code == 0 and out.startswith("OK") and "(1 warning)" in out
    assert 'warning: generation.env: has no VLLM_SERVER_DEV_MODE: "1"' in err
    said_no = write(
        tmp_path, VLLM_LOCAL.format(model=tmp_path / "m") + "  env: {VLLM_SERVER_DEV_MODE: '0'}\n"
    )
    assert validate(str(said_no))[2] == ""  # "0": this job never refits
    trainer_owned = path.read_text().replace("engine: vllm", "engine: vllm\n  owner: trainer")
    assert validate(str(write(tmp_path, trainer_owned, "owned.yaml")))[2] == ""  # its engines, its switch


def test_machine_problems_join_the_schemas_in_one_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    text = VLLM_LOCAL.format(model="./missing").replace('"true"', "python scripts/train.py") + "  nodes: 0\n"
    code, _, err = validate(str(write(tmp_path, text)))
    assert code == 2
    assert "4 problems in the job spec (1 of them warnings)" in err, err
    assert "training.command: runs scripts/train.py, which does not exist from" in err
    assert "generation.model: ./missing does not exist" in err
    assert "generation.nodes: must be >= 1" in err and "warning: generation.env" in err


def test_container_mounts_must_show_the_install_the_spec_and_the_job_root(tmp_path: Path) -> None:
    site = tmp_path / "lustre"
    (site / "models" / "m").mkdir(parents=True)
    spec = f"""\
        name: c
        cluster: slurm
        job_root: {site}/jobs
        slurm:
          time: "01:00:00"
          gpus_per_node: 8
          container: {{image: img, mounts: ["{site}:{site}"]}}
        training: {{command: python /opt/train.py}}
        generation:
          model: {site}/models/m
          env: {{VLLM_SERVER_DEV_MODE: "1"}}
        """
    path = write(site, spec)
    inside = Machine(site, {}, site / "venv", Path("/usr"))
    assert load_spec(path, machine=inside).warnings == ()
    outside = Machine(site, {}, tmp_path / "home" / "venv", tmp_path / "pyenv" / "3.11")
    warned = load_spec(path, machine=outside).warnings
    assert [w.path for w in warned] == ["slurm.container.mounts"] * 2
    assert f"does not see {tmp_path / 'home' / 'venv'} (the launcher's install" in warned[0].message
    assert f"does not see {tmp_path / 'pyenv' / '3.11'} (the Python" in warned[1].message
    moved = write(tmp_path, spec.replace(f"job_root: {site}/jobs", "job_root: /elsewhere/jobs"))
    messages = [w.message for w in load_spec(moved, machine=inside).warnings]
    assert any("/elsewhere/jobs (job_root" in m for m in messages) and any(
        "the spec file" in m for m in messages
    )


def test_json_keeps_errors_and_warnings_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    path = write(tmp_path, VLLM_LOCAL.format(model="./missing"))
    data = json.loads(validate(str(path), "--json")[1])
    assert data["ok"] is False and [i["path"] for i in data["issues"]] == ["generation.model"]
    assert [w["path"] for w in data["warnings"]] == ["generation.env"]
    assert validate(str(path), "--spec-only")[0] == 0  # the spec alone is fine


def test_spec_dir_is_the_spec_files_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    here = tmp_path / "project"
    here.mkdir()
    (here / "train.py").write_text("")
    text = 'name: t\ncluster: local\ntraining:\n  command: python "${spec_dir}/train.py"\n'
    text += "generation: {engine: sim}\n"
    path = write(here, text)
    assert load_spec(path, machine=Machine.here()).training.command == f'python "{here}/train.py"'
    odd = tmp_path / "a$b"
    odd.mkdir()
    with pytest.raises(SpecError, match=r"training.command: \$\{spec_dir\} is .*a\$b"):
        load_spec(write(odd, path.read_text()))


def test_submit_stops_before_anything_starts_and_dry_run_says_it_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer path that is not there from here: ``submit`` refused it 20 s in, after Ray and the
    engines had started ("training command exited with 2"); now it stops at once with the fix, and
    ``--dry-run`` prints the plan and what would stop it."""
    monkeypatch.chdir(tmp_path)
    spec = "name: t\ncluster: local\njob_root: {root}\ntraining:\n  command: python examples/grpo/train.py\n"
    path = write(tmp_path, spec.format(root=tmp_path / "jobs") + "generation: {engine: sim}\n")
    submitted = CliRunner().invoke(main, ["submit", str(path)])
    assert submitted.exit_code == 2
    assert "training.command: runs examples/grpo/train.py, which does not exist" in submitted.stderr
    assert not (tmp_path / "jobs").exists()  # nothing was started or written
    dry = CliRunner().invoke(main, ["submit", str(path), "--dry-run"])
    assert dry.exit_code == 0 and "nothing was submitted" in dry.stdout
    assert dry.stderr.startswith(
        f"submit would stop: {path}:5: training.command: runs examples/grpo/train.py"
    )


def test_a_refused_engine_kind_is_not_judged_as_the_default_one(tmp_path: Path) -> None:
    """``engine: simm`` taken out would leave vLLM, the default: "model required", "simulator options need
    engine: sim" would be about a kind the user never chose. Only the typo is reported."""
    path = write(tmp_path, "name: t\ncluster: local\ntraining: {command: 'true'}\n"
                 "generation: {engine: simm, sim: {speed: 2}}\n")  # fmt: skip
    with pytest.raises(SpecError) as info:
        load_spec(path, machine=Machine.here())
    assert [i.path for i in info.value.issues] == ["generation.engine"]
