"""docs/getting-started.md stays true where tests/unit/test_docs.py cannot reach: its spec for a real site
validates as written, its installer lines parse, and its table of the training command's variables is the
set the driver sets (launcher/driver/gym_wiring.py), no more and no fewer.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from tests.support.cli import RL_LAUNCH

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "getting-started.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(kind: str) -> list[str]:
    return [body for lang, body in FENCE.findall(PAGE.read_text()) if lang == kind]


def test_the_site_spec_validates_as_written(tmp_path: Path) -> None:
    specs = [b for b in blocks("yaml") if "cluster: slurm" in b]
    assert specs, "the page shows no spec for a real site"
    for i, text in enumerate(specs):
        path = tmp_path / f"site-{i}.yaml"
        path.write_text(text)
        proc = subprocess.run([RL_LAUNCH, "validate", str(path)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "VLLM_SERVER_DEV_MODE" not in proc.stderr, proc.stderr  # the refit switch is there


def test_every_installer_line_parses(tmp_path: Path) -> None:
    lines = [
        m.group(1) for b in blocks("bash") for m in re.finditer(r"(scripts/install-vllm\.sh[^)\"#\n]*)", b)
    ]
    assert any("--cuda" in line for line in lines) and any("--cpu" in line for line in lines), lines
    for line in lines:
        argv = [w for w in shlex.split(line) if w != "--dry-run"]
        if "--prefix" in argv:
            argv[argv.index("--prefix") + 1] = str(tmp_path / "venv")
        proc = subprocess.run(
            [str(ROOT / argv[0]), *argv[1:], "--dry-run"], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0 and " -m pip install vllm" in proc.stdout, (line, proc.stderr)


def test_the_variables_table_is_what_the_driver_sets() -> None:
    wiring = (ROOT / "launcher" / "driver" / "gym_wiring.py").read_text()
    set_by_driver = set(re.findall(r'env\["(RL_[A-Z_]+)"\] =', wiring))
    set_by_driver |= set(re.findall(r'^\s+"(RL_[A-Z_]+)": ', wiring, re.M))
    table = set(re.findall(r"^\| `(RL_[A-Z_]+)` \|", PAGE.read_text(), re.M))
    assert "RL_POLICY_BASE_URL" in set_by_driver and "RL_CONTROL_API_KEY_FILE" in set_by_driver
    assert table == set_by_driver, (sorted(table - set_by_driver), sorted(set_by_driver - table))
