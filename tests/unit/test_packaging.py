"""Every package under launcher/ and router/ is listed in pyproject.toml, so a wheel is complete.

The list is explicit (``templates/`` is mapped into ``launcher.templates``), so a new subpackage that is
not added would work in the editable checkout and be missing from an installed wheel.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_is_listed() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("launcher", "router")
        for init in (ROOT / top).rglob("__init__.py")
    }
    found.add("launcher.templates")
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
    # and the other way: a package renamed or removed must leave the list, or the wheel build fails
    assert listed <= found, f"remove from [tool.setuptools] packages: {sorted(listed - found)}"
