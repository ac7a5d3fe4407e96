"""The launcher's floors: a package imports only packages on its own floor or below, never above.

Floor 0 is the router (it never imports ``launcher``); floor 1 the plumbing everything shares (the job
directory, Slurm, the launcher's HTTP, starting steps and the job's Ray, the reader of the request
record); floor 2 the kinds and the spec built from them; 3 the fleet wing; 4 the driver; 5 the login
side, the dashboard and the bench; 6 the CLI. When a small piece of shared plumbing lived in a feature
package, lower packages reached up for it (a front imported the driver for its listener, the elastic
manager the bench for two gauge names) and 12 of 14 packages ended in one import knot. This test reads
every import with ``ast``, the lazy ones inside functions included, so a new arrow up fails here with
its file and line instead of in a review.

Imports under ``if TYPE_CHECKING:`` are allowed in any direction: they never run, and a lower floor may
name a higher floor's type in an annotation (the spec's ``ResolvedSpec`` in a Slurm helper's signature).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FLOORS: dict[str, int] = {
    "router": 0,
    "launcher": 0,  # launcher/__init__.py: the version only
    "launcher.jobdir": 1,
    "launcher.slurm": 1,
    "launcher.net": 1,
    "launcher.steps": 1,
    "launcher.record": 1,
    "launcher.engines": 2,
    "launcher.gateways": 2,
    "launcher.spec": 2,
    "launcher.fleet": 3,
    "launcher.driver": 4,
    "launcher.submit": 5,
    "launcher.status": 5,
    "launcher.bench": 5,
    "launcher.cli": 6,
}
"""Every package of ``launcher/`` and ``router/``, by floor (docs/architecture.md draws them)."""

SIDEWAYS: dict[tuple[str, str], str] = {
    ("launcher.spec", "launcher.engines"): "the spec's union of kind sections is built from the registries",
    ("launcher.spec", "launcher.gateways"): "the spec's union of kind sections is built from the registries",
    ("launcher.engines", "launcher.spec"): "a kind's section is built from spec/section.py and errors.py",
    ("launcher.gateways", "launcher.spec"): "a kind's section is built from spec/section.py and errors.py",
    ("launcher.gateways", "launcher.engines"): "a front starts engines of the kinds it serves (Ray Serve)",
    ("launcher.slurm", "launcher.jobdir"): "cancel_own names the user the job dir's owner check uses",
    ("launcher.steps", "launcher.jobdir"): "the reaper matches its parent by the job dir's start ticks",
    ("launcher.steps", "launcher.slurm"): "a step on a node is an srun line",
}
"""Imports between two packages of one floor that are allowed, each with why. Any other import across
packages of one floor fails, so each such pair is a decision someone wrote down. Floor 1 is ordered
inside: ``slurm`` and ``jobdir`` below ``steps``, ``jobdir`` below ``slurm``; never the other way."""


@dataclass(frozen=True)
class Import:
    source: str  # module
    target: str  # module (or package) imported
    path: Path
    line: int
    type_checking: bool


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """The floor-bearing package of ``module``: ``router`` for the router, else ``launcher.<top>``."""
    parts = module.split(".")
    if parts[0] == "router":
        return "router"
    if len(parts) == 1:
        return "launcher"
    return ".".join(parts[:2])


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                for n in ast.walk(child):
                    if hasattr(n, "lineno"):
                        lines.add(n.lineno)
    return lines


def imports_of(path: Path) -> list[Import]:
    """Every import of ``launcher``/``router`` modules in ``path``, at any depth (lazy ones included)."""
    module = module_name(path)
    tree = ast.parse(path.read_text(), str(path))
    tc = _type_checking_lines(tree)
    out = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                targets = [".".join([*base, *([node.module] if node.module else [])])]
            else:
                targets = [node.module or ""]
        for t in targets:
            if t.split(".")[0] in ("launcher", "router"):
                out.append(Import(module, t, path, node.lineno, node.lineno in tc))
    return out


def project_modules(root: Path = REPO) -> list[Path]:
    return sorted(p for d in ("launcher", "router") for p in (root / d).rglob("*.py"))


def floor_violations(paths: list[Path]) -> list[str]:
    """``file:line: A (floor a) imports B (floor b)`` for each runtime import up a floor, or across
    packages of one floor without a ``SIDEWAYS`` entry; and each module whose package has no floor."""
    problems = []
    for path in paths:
        for imp in imports_of(path):
            src, dst = package_of(imp.source), package_of(imp.target)
            where = f"{imp.path.relative_to(REPO)}:{imp.line}"
            for pkg in (src, dst):
                if pkg not in FLOORS:
                    problems.append(f"{where}: package {pkg} has no floor: add it to FLOORS")
            if src == dst or imp.type_checking or src not in FLOORS or dst not in FLOORS:
                continue
            if FLOORS[dst] > FLOORS[src]:
                problems.append(
                    f"{where}: {imp.source} (floor {FLOORS[src]}) imports {imp.target} "
                    f"(floor {FLOORS[dst]}): move what it needs down a floor"
                )
            elif FLOORS[dst] == FLOORS[src] and (src, dst) not in SIDEWAYS:
                problems.append(
                    f"{where}: {imp.source} imports {imp.target} on its own floor {FLOORS[src]}: "
                    "move it down, or add the pair to SIDEWAYS with why"
                )
    return sorted(set(problems))


def module_cycles(paths: list[Path]) -> list[list[str]]:
    """Circles among modules through imports that run when a module is imported (top level, not under
    ``TYPE_CHECKING``): the ones that make import order matter."""
    graph: dict[str, set[str]] = defaultdict(set)
    known = {module_name(p) for p in paths}
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        tc = _type_checking_lines(tree)
        top = {n.lineno for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)}
        for imp in imports_of(path):
            if imp.line in top and imp.line not in tc:
                target = imp.target
                while target not in known and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in known and target != imp.source:
                    graph[imp.source].add(target)
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append([*stack[stack.index(n) :], n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def package_cycles(paths: list[Path]) -> list[list[str]]:
    """Circles among ``launcher/`` packages through runtime imports (lazy included), minus the pairs
    ``SIDEWAYS`` allows: the knot the floors exist to prevent."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in paths:
        for imp in imports_of(path):
            src, dst = package_of(imp.source), package_of(imp.target)
            if src != dst and not imp.type_checking and (src, dst) not in SIDEWAYS:
                graph[src].add(dst)
    cycles = []
    for a in sorted(graph):
        seen, todo = set(), [(a, [a])]
        while todo:
            node, trail = todo.pop()
            for n in sorted(graph[node]):
                if n == a:
                    cycles.append([*trail, a])
                elif n not in seen:
                    seen.add(n)
                    todo.append((n, [*trail, n]))
    return cycles


def test_every_import_runs_down_the_floors() -> None:
    problems = floor_violations(project_modules())
    assert not problems, "imports against the floors:\n" + "\n".join(problems)


def test_no_import_circle_between_modules_or_packages() -> None:
    paths = project_modules()
    assert module_cycles(paths) == []
    assert package_cycles(paths) == []


def test_the_router_never_imports_the_launcher() -> None:
    bad = [
        f"{i.path.relative_to(REPO)}:{i.line}: {i.target}"
        for p in (REPO / "router").rglob("*.py")
        for i in imports_of(p)
        if i.target.split(".")[0] == "launcher"
    ]
    assert bad == []


def test_every_package_has_a_floor() -> None:
    packages = {package_of(module_name(p)) for p in project_modules()}
    assert packages <= set(FLOORS), f"add to FLOORS: {sorted(packages - set(FLOORS))}"
    assert set(FLOORS) <= packages, f"FLOORS names packages that are gone: {sorted(set(FLOORS) - packages)}"


@pytest.mark.parametrize(
    ("planted", "lazy"),
    [
        ("launcher/steps/planted_probe.py", False),  # floor 1 reaching the driver (4)
        ("launcher/gateways/planted_probe.py", True),  # floor 2 reaching the bench (5), inside a function
    ],
)
def test_a_planted_upward_import_fails(tmp_path: Path, planted: str, lazy: bool) -> None:
    """The check is not vacuous: a module planted in a copy of the tree, importing up, is reported with
    its file and line, both at module level and lazily inside a function (where most arrows up hid)."""
    import shutil

    copy = tmp_path / "repo"
    for d in ("launcher", "router", "tests"):
        shutil.copytree(REPO / d, copy / d, ignore=shutil.ignore_patterns("__pycache__"))
    body = (
        "def f():\n"
        "    from launcher.bench.replay import default_results_dir\n"
        "    return default_results_dir\n"
        if lazy
        else "from launcher.driver.driver import Driver\n"
    )
    (copy / planted).write_text(body)
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(copy / "tests" / "unit")!r})
        import test_layers as t
        t.REPO = t.Path({str(copy)!r})
        for line in t.floor_violations(t.project_modules(t.REPO)):
            print(line)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{planted}:"), out.stdout
    assert "move what it needs down a floor" in lines[0]
