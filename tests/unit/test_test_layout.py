"""The tests' own layout: every test file sits in a tier folder, and no test module is another's helper.

The tiers (each folder's ``__init__.py`` says what belongs there) go by the heaviest real component a file
needs: dynamo > slurm > vllm > local job > component > unit. A helper that more than one module uses lives
in ``tests/support/``: when test modules imported each other for their helpers, moving or renaming one test
file broke others, and an imported module's fixtures (an autouse one among them) came along unseen.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TIERS = ("unit", "component", "local", "slurm", "vllm", "dynamo")
TEST_FILES = ("test_*.py", "*_test.py")  # pytest's default python_files


def is_test_module(name: str) -> bool:
    """``name`` (dotted, or one part) names a test module: any part is ``test_*`` or ``*_test``."""
    return any(p.startswith("test_") or p.endswith("_test") for p in name.split("."))


def imports_of_test_modules(path: Path) -> list[str]:
    """``file:line: module`` for each import of a test module in ``path``, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = [f"{module}.{a.name}" if module else a.name for a in node.names]
        found += [f"{path.relative_to(TESTS.parent)}:{node.lineno}: {n}" for n in names if is_test_module(n)]
    return found


def test_no_test_module_imports_another() -> None:
    found = [line for path in sorted(TESTS.rglob("*.py")) for line in imports_of_test_modules(path)]
    assert found == [], "import it from tests/support/ instead (move the helper there):\n" + "\n".join(found)


def test_every_test_file_is_in_a_tier_folder() -> None:
    files = sorted({p for pattern in TEST_FILES for p in TESTS.rglob(pattern)})
    misplaced = [
        str(p.relative_to(TESTS.parent))
        for p in files
        if p.parent.parent != TESTS or p.parent.name not in TIERS
    ]
    assert misplaced == [], f"put these in one of tests/{{{','.join(TIERS)}}}/: {misplaced}"
    for tier in TIERS:
        assert (TESTS / tier / "__init__.py").is_file(), f"tests/{tier}/ lacks its __init__.py"
