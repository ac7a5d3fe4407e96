"""vLLM engines on a machine without vLLM: refused before anything starts, with the fix.

Before: ``validate`` said OK, and a local ``submit`` started Ray (10-15 s) before the first engine failed
with "vLLM engine tiny: cannot run 'vllm': [Errno 2] No such file or directory: 'vllm'", naming neither
``RL_LAUNCH_VLLM_PYTHON`` nor an installer. Now ``validate`` and ``submit`` of a ``cluster: local`` spec
name it (``generation.engine``), and an engine that cannot start its vLLM (on a Slurm node) names the same
fix.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli.main import main
from launcher.engines.base import EngineSpec, EngineStartError
from launcher.engines.vllm.engine import VllmEngine
from tests.support.cli import RL_LAUNCH

SPEC = """\
name: tiny
cluster: {cluster}
job_root: {root}
training:
  command: "true"
generation:
  engine: vllm
  model: {model}
  env: {{VLLM_SERVER_DEV_MODE: "1"}}
{extra}"""
FIX = 'export RL_LAUNCH_VLLM_PYTHON="$(scripts/install-vllm.sh --cpu)"'


@pytest.fixture
def no_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A machine where neither RL_LAUNCH_VLLM_PYTHON nor a `vllm` on PATH exists."""
    monkeypatch.delenv("RL_LAUNCH_VLLM_PYTHON", raising=False)
    bare = tmp_path / "bin"
    bare.mkdir()
    monkeypatch.setenv("PATH", str(bare))
    return {"PATH": str(bare)}


def spec(tmp_path: Path, cluster: str = "local", extra: str = "") -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC.format(cluster=cluster, root=tmp_path / "jobs", model=model, extra=extra))
    return path


def validate(path: Path) -> tuple[int, str]:
    out = CliRunner().invoke(main, ["validate", str(path)])
    return out.exit_code, out.output


def test_validate_names_the_missing_vllm_and_the_fix(tmp_path: Path, no_vllm: dict[str, str]) -> None:
    code, out = validate(spec(tmp_path))
    assert code == 2, out
    (line,) = [x for x in out.splitlines() if "generation.engine" in x]
    assert "RL_LAUNCH_VLLM_PYTHON is not set and no `vllm` is on PATH" in line and FIX in line, out


def test_an_engine_python_that_is_not_there_is_named(
    tmp_path: Path, no_vllm: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RL_LAUNCH_VLLM_PYTHON", str(tmp_path / "venv" / "bin" / "python"))
    code, out = validate(spec(tmp_path))
    assert code == 2 and f"RL_LAUNCH_VLLM_PYTHON={tmp_path}/venv/bin/python is not an executable file" in out


def test_a_vllm_on_path_or_an_engine_python_is_enough(
    tmp_path: Path, no_vllm: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    console = Path(no_vllm["PATH"]) / "vllm"
    console.write_text("#!/bin/sh\n")
    console.chmod(0o755)
    code, out = validate(spec(tmp_path))
    assert code == 0 and "vLLM" not in out, out
    console.unlink()
    monkeypatch.setenv("RL_LAUNCH_VLLM_PYTHON", sys.executable)
    code, out = validate(spec(tmp_path))
    assert code == 0, out


def test_on_slurm_the_nodes_decide(tmp_path: Path, no_vllm: dict[str, str]) -> None:
    slurm = "slurm:\n  partition: gpu\n  time: '01:00:00'\n  gpus_per_node: 4\n"
    code, out = validate(spec(tmp_path, "slurm", slurm))
    assert code == 0 and out.startswith("OK "), out  # the model directory: on the nodes, for check to see


def test_submit_stops_before_anything_starts(tmp_path: Path, no_vllm: dict[str, str]) -> None:
    started = time.monotonic()
    proc = subprocess.run(
        [RL_LAUNCH, "submit", str(spec(tmp_path))], capture_output=True, text=True, timeout=120, env=no_vllm
    )
    took = time.monotonic() - started
    assert proc.returncode == 2 and FIX in proc.stderr, proc.stderr
    assert "starting Ray" not in proc.stderr and not (tmp_path / "jobs").exists(), proc.stderr
    print(f"submit refused in {took:.1f} s")


def test_an_engine_that_cannot_run_vllm_names_the_fix(tmp_path: Path) -> None:
    engine = VllmEngine(
        EngineSpec(model="m", log_path=str(tmp_path / "e.log")), vllm_bin=str(tmp_path / "no-vllm")
    )
    with pytest.raises(EngineStartError) as info:
        engine.start()
    assert f"cannot run '{tmp_path}/no-vllm'" in str(info.value) and FIX in str(info.value)


def test_the_fix_is_one_line() -> None:
    from launcher.engines.vllm.presence import INSTALL

    assert "\n" not in INSTALL and textwrap.shorten(INSTALL, 400) == INSTALL
