"""The examples for a real site are true as written, and ``examples/local.yaml`` runs from any directory.

Before: ``validate`` and ``render`` passed ``examples/slurm-vllm-fleet-client.yaml``, which would fail on a
real cluster: no ``VLLM_SERVER_DEV_MODE`` (its refit needs it), a hub id for engines that run offline, the
job root in a home directory the container does not mount. And ``examples/local.yaml`` ran
``python examples/grpo/train.py``, a path only the repository root has: from another directory the job
failed 20 s in with "training command exited with 2".

A site is simulated by the example with its ``/lustre`` moved under a temporary directory: the install,
the spec, the job root and the downloaded model there, as the example's comments say; then nothing may be
left to warn about, and the rendered batch script's container must see each path it uses.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from launcher.cli.main import main
from launcher.engines.kinds import engine_kind
from launcher.engines.vllm.kind import VllmSettings
from launcher.gateways.kinds import front_kind
from launcher.spec import SpecError, load_checked, load_spec
from launcher.spec.machine import Machine
from launcher.submit.render import render_sbatch

REPO = Path(__file__).resolve().parents[2]
SITE_EXAMPLES = sorted((REPO / "examples").glob("slurm-*.yaml"))
SITE_ROOT = "/lustre"


def on_a_site(example: Path, tmp_path: Path) -> tuple[Path, Machine]:
    """The example as a site would hold it: ``/lustre`` is ``tmp_path/lustre``, rl-launch installed there,
    the spec copied there, every model directory it names downloaded."""
    site = tmp_path / "lustre"
    text = example.read_text().replace(SITE_ROOT, str(site))
    spec = site / "my-project" / example.name
    spec.parent.mkdir(parents=True)
    spec.write_text(text)
    model = (yaml.safe_load(text).get("generation") or {}).get("model")
    if model and model.startswith(str(site)):
        Path(model).mkdir(parents=True)
        (Path(model) / "config.json").write_text("{}")
    environ = {"HOME": str(tmp_path / "home"), "HF_HUB_CACHE": str(tmp_path / "no-cache")}
    return spec, Machine(spec.parent, environ, site / "rl-launch" / ".venv", Path("/usr"))


def test_the_site_examples_are_the_slurm_ones() -> None:
    assert [p.name for p in SITE_EXAMPLES] == [
        "slurm-sim.yaml",
        "slurm-vllm-fleet-client.yaml",
        "slurm-vllm.yaml",
    ]


@pytest.mark.parametrize("example", SITE_EXAMPLES, ids=lambda p: p.name)
def test_a_site_example_has_nothing_to_warn_about_on_a_site_like_its_comments_say(
    example: Path, tmp_path: Path
) -> None:
    spec, machine = on_a_site(example, tmp_path)
    resolved, warnings = load_checked(spec, machine=machine)
    assert [w.text(str(spec)) for w in warnings] == []
    gen = resolved.generation
    engine = engine_kind(gen.engine)
    if gen.owner == "launcher" and VllmSettings in engine.settings:
        assert gen.model is not None and os.path.isabs(gen.model), gen.model  # downloaded first
        assert "hf download" in example.read_text()  # and the example says how
        if front_kind(resolved.router.kind).has_fleet_routes:
            assert gen.env.get("VLLM_SERVER_DEV_MODE") == "1"


@pytest.mark.parametrize("example", SITE_EXAMPLES, ids=lambda p: p.name)
def test_a_rendered_site_example_shows_its_container_every_path_it_uses(
    example: Path, tmp_path: Path
) -> None:
    spec, machine = on_a_site(example, tmp_path)
    resolved = load_checked(spec, machine=machine)[0]
    rl_launch = str(machine.prefix / "bin" / "rl-launch")
    script = render_sbatch(resolved, rl_launch=[rl_launch])
    mounts = re.findall(r"--container-mounts=(\S+)", script)
    if resolved.slurm is None or resolved.slurm.container is None:
        assert mounts == []
        return
    assert mounts, script
    same_path = [
        m.split(":")[0] for m in shlex.split(mounts[0])[0].split(",") if m.split(":")[0] == m.split(":")[1]
    ]
    driver = script.strip().splitlines()[-1]
    for used in (rl_launch, resolved.job_root, str(spec)):
        assert used in script, used
        assert any(used == src or used.startswith(src.rstrip("/") + "/") for src in same_path), (used, mounts)
    assert f"{rl_launch} submit {spec}" in driver


def test_the_fleet_client_example_on_this_machine_says_what_a_site_must_have() -> None:
    """As a user on a machine that is not the site sees it: OK (the site may have it all), with a warning
    for each path the login node cannot see, naming it."""
    path = REPO / "examples" / "slurm-vllm-fleet-client.yaml"
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 0 and result.stdout.startswith("OK "), result.output
    assert (
        "generation.model: /lustre/my-project/models/Qwen3-8B does not exist on this machine" in result.stderr
    )
    assert "VLLM_SERVER_DEV_MODE" not in result.stderr


def test_local_example_runs_its_trainer_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``examples/local.yaml`` from another directory: the trainer's path is the spec file's
    (``${spec_dir}``), so the command the driver runs names a file that exists."""
    monkeypatch.chdir(tmp_path)
    example = REPO / "examples" / "local.yaml"
    resolved, warnings = load_checked(example, machine=Machine.here())
    assert warnings == ()
    script = shlex.split(resolved.training.command)[1]
    assert script == str(REPO / "examples" / "grpo" / "train.py") and Path(script).is_file()
    result = CliRunner().invoke(main, ["validate", str(example)])
    assert result.exit_code == 0, result.output


def test_a_relative_trainer_from_another_directory_is_refused_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What local.yaml said before, from another directory: one line naming the directory it is relative
    to and ``${spec_dir}``, before anything starts (it failed 20 s into the job)."""
    repo = tmp_path / "clone"
    (repo / "examples" / "grpo").mkdir(parents=True)
    (repo / "examples" / "grpo" / "train.py").write_text("")
    text = (REPO / "examples" / "local.yaml").read_text()
    old = repo / "examples" / "local.yaml"
    old.write_text(text.replace('"${spec_dir}/grpo/train.py"', "examples/grpo/train.py"))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(SpecError) as info:
        load_spec(old, machine=Machine.here())
    assert [i.text("SPEC") for i in info.value.issues] == [
        f"SPEC:{text.splitlines().index(next(x for x in text.splitlines() if 'command:' in x)) + 1}: "
        f"training.command: runs examples/grpo/train.py, which does not exist from {tmp_path / 'elsewhere'} "
        f"(the command runs in the directory you submit from): submit from {repo}, or write it as "
        '"${spec_dir}/grpo/train.py" (the spec file\'s directory)'
    ]
    monkeypatch.chdir(repo)  # from the clone's root it is right
    assert load_spec(old, machine=Machine.here()).warnings == ()
