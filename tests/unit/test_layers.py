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
Only that exact test counts (``if not TYPE_CHECKING:`` runs). Each import is resolved to the module it loads:
``from launcher import driver`` and ``from .. import fleet`` load ``launcher.driver`` and ``launcher.fleet``
(keeping only ``node.module`` read them as ``launcher``, floor 0, and let them through), and
``importlib.import_module`` with a literal name counts too. ``router/`` is one floor to the launcher and
has inner floors of its own (``ROUTER_FLOORS``). ``FORMS`` plants each form in a copy of the tree.
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
    "launcher.check": 5,
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


ROUTER_FLOORS: dict[str, tuple[int, str]] = {
    "router.policies": (0, "pure routing policies, shared with the bench and the tests: no state, no HTTP"),
    "router.consumers": (0, "the consumers file and its keys: read by auth, the fair share and the routes"),
    "router.prometheus": (0, "the metrics text format, read by the fleet's engine counters"),
    "router.secrets": (0, "reading a secret file"),
    "router.ports": (0, "choosing and holding a port"),
    "router.state": (1, "the one state (serving set, decision, pause gate, metrics): nothing of HTTP"),
    "router.adapters": (2, "the LoRA tenants' table: on the state, beneath the requests that use it"),
    "router.record": (2, "the request record: what a request's state was, written by http"),
    "router.continuation": (2, "a generation continued on another engine: parsing, stitching, moves"),
    "router.http": (3, "requests in and out: auth, forwarding, relay, over the state and the table"),
    "router.config": (4, "RouterConfig, built from http's limits, the adapters' plan and the policies"),
    "router.fleet": (4, "the engine contract and the /fleet/* routes, served behind http's auth"),
    "router.multiprocess": (5, "worker processes: each runs http and asks the parent's state"),
    "router.server": (6, "GenerationRouter: puts every room together"),
    "router.actor": (7, "the Ray actor around the server"),
    "router.cli": (7, "the router's own command line"),
    "router": (7, "the package's lazy facade (router/__init__.py)"),
}
"""``router/``'s rooms (its sub-packages and top-level modules), each on an inner floor with why, measured
from its imports: a room imports only rooms on lower floors (the same floor, never), so the state never
learns HTTP, the adapter table never reaches up into ``http`` or ``fleet``, and nothing but the server and
above puts the rooms together. ``if TYPE_CHECKING:`` imports are allowed (``http`` and ``record`` name
``RouterConfig`` in annotations)."""


def router_room(module: str) -> str:
    """The room of a ``router`` module: ``router.<sub-package>`` or the top-level module itself."""
    parts = module.split(".")
    if len(parts) >= 2 and (REPO / "router" / parts[1] / "__init__.py").is_file():
        return ".".join(parts[:2])
    return ".".join(parts[:2]) if len(parts) >= 2 else parts[0]


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


def _is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:`` exactly: ``not TYPE_CHECKING``, ``TYPE_CHECKING
    or x`` and the like run at import time (a substring test took them for TYPE_CHECKING and let an import up
    through)."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return (
        isinstance(test, ast.Attribute)
        and test.attr == "TYPE_CHECKING"
        and ast.unparse(test.value) == "typing"
    )


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """``id`` of every node in the body of an ``if TYPE_CHECKING:`` (never its ``else:``, which runs)."""
    nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                nodes.update(id(n) for n in ast.walk(child))
    return nodes


def is_module(name: str) -> bool:
    """``name`` is a module or package of the tree: ``from launcher import driver`` imports the package
    ``launcher.driver``, ``from launcher import __version__`` only ``launcher``."""
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _import_module_literal(node: ast.AST, module: str, package: str) -> list[str]:
    """``importlib.import_module("a.b")`` (or a bare ``import_module``) with a literal name, relative ones
    resolved against their literal ``package`` (or this module's package): the one dynamic form that names
    its target in the source. Names computed at run time (the lazy registries) cannot be read here."""
    if not isinstance(node, ast.Call) or not node.args:
        return []
    func = ast.unparse(node.func)
    if func not in ("importlib.import_module", "import_module"):
        return []
    first = node.args[0]
    if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
        return []
    name = first.value
    if not name.startswith("."):
        return [name]
    anchor: ast.expr | None = node.args[1] if len(node.args) > 1 else None
    for kw in node.keywords:
        if kw.arg == "package":
            anchor = kw.value
    base = package
    if isinstance(anchor, ast.Constant) and isinstance(anchor.value, str):
        base = anchor.value
    elif isinstance(anchor, ast.Name) and anchor.id == "__name__":
        base = module
    level = len(name) - len(name.lstrip("."))
    parts = base.split(".")
    parts = parts[: len(parts) - (level - 1)]
    rest = name.lstrip(".")
    return [".".join([*parts, *([rest] if rest else [])])]


def imports_of(path: Path) -> list[Import]:
    """Every import of ``launcher``/``router`` modules in ``path``, at any depth (lazy ones included), each
    resolved to the module it loads: ``from pkg import name`` is ``pkg.name`` when that is a module,
    relative imports are made absolute, and ``importlib.import_module`` with a literal name counts."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(), str(path))
    tc = _type_checking_nodes(tree)
    out = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            targets = [
                f"{source}.{a.name}" if is_module(f"{source}.{a.name}") else source for a in node.names
            ]
        else:
            targets = _import_module_literal(node, module, package)
        for t in dict.fromkeys(targets):
            if t.split(".")[0] in ("launcher", "router"):
                out.append(Import(module, t, path, node.lineno, id(node) in tc))
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


def router_floor_violations(paths: list[Path]) -> list[str]:
    """``file:line: A (router floor a) imports B (router floor b)`` for each runtime import inside
    ``router/`` that does not run down ``ROUTER_FLOORS``; and each room without a floor."""
    problems = []
    for path in paths:
        for imp in imports_of(path):
            if imp.source.split(".")[0] != "router" or imp.target.split(".")[0] != "router":
                continue
            src, dst = router_room(imp.source), router_room(imp.target)
            where = f"{imp.path.relative_to(REPO)}:{imp.line}"
            for room in (src, dst):
                if room not in ROUTER_FLOORS:
                    problems.append(f"{where}: router room {room} has no floor: add it to ROUTER_FLOORS")
            if src == dst or imp.type_checking or src not in ROUTER_FLOORS or dst not in ROUTER_FLOORS:
                continue
            if ROUTER_FLOORS[dst][0] >= ROUTER_FLOORS[src][0]:
                problems.append(
                    f"{where}: {imp.source} (router floor {ROUTER_FLOORS[src][0]}) imports {imp.target} "
                    f"(router floor {ROUTER_FLOORS[dst][0]}): move what it needs down"
                )
    return sorted(set(problems))


def module_cycles(paths: list[Path]) -> list[list[str]]:
    """Circles among modules through imports that run when a module is imported (top level, not under
    ``TYPE_CHECKING``): the ones that make import order matter."""
    graph: dict[str, set[str]] = defaultdict(set)
    known = {module_name(p) for p in paths}
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        top = {n.lineno for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)}
        for imp in imports_of(path):
            if imp.line in top and not imp.type_checking:
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


def test_the_router_rooms_import_down_their_inner_floors() -> None:
    problems = router_floor_violations(project_modules())
    assert not problems, "imports against the router's floors:\n" + "\n".join(problems)
    rooms = {router_room(module_name(p)) for p in (REPO / "router").rglob("*.py")}
    assert rooms == set(ROUTER_FLOORS), (
        sorted(rooms - set(ROUTER_FLOORS)),
        sorted(set(ROUTER_FLOORS) - rooms),
    )


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


FORMS = [
    # (planted file, its body, what the report must say)
    ("launcher/jobdir/planted_probe.py", "from launcher import driver\n", "launcher.driver (floor 4)"),
    ("launcher/jobdir/planted_probe.py", "from .. import fleet\n", "launcher.fleet (floor 3)"),
    (
        "launcher/net/planted_probe.py",
        "from typing import TYPE_CHECKING\n"
        "if not TYPE_CHECKING:\n"
        "    from launcher.driver.driver import Driver\n",
        "launcher.driver.driver (floor 4)",
    ),
    (
        "launcher/steps/planted_probe.py",
        "import importlib\ndef f():\n    return importlib.import_module('launcher.bench.replay')\n",
        "launcher.bench.replay (floor 5)",
    ),
    (
        "router/adapters/planted_probe.py",
        "from router.http import auth\n",
        "router.http.auth (router floor 3)",
    ),
    ("router/state/planted_probe.py", "from ..fleet import api\n", "router.fleet.api (router floor 4)"),
    ("router/policies/planted_probe.py", "from router import state\n", "router.state (router floor 1)"),
]


def violations_in_copy(tmp_path: Path, planted: str, body: str) -> list[str]:
    """The floors' report on a copy of the tree with ``body`` planted at ``planted``."""
    import shutil

    copy = tmp_path / "repo"
    for d in ("launcher", "router", "tests"):
        shutil.copytree(REPO / d, copy / d, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / planted).write_text(body)
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(copy / "tests" / "unit")!r})
        import test_layers as t
        t.REPO = t.Path({str(copy)!r})
        paths = t.project_modules(t.REPO)
        for line in t.floor_violations(paths) + t.router_floor_violations(paths):
            print(line)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@pytest.mark.parametrize(
    ("planted", "body", "says"), FORMS, ids=[f[1].splitlines()[-1].strip() for f in FORMS]
)
def test_every_import_form_is_resolved(tmp_path: Path, planted: str, body: str, says: str) -> None:
    """Each way Python spells an import up is caught: ``from pkg import module`` (the module, not the
    package, is what is imported), a relative ``from .. import x``, an import under ``if not
    TYPE_CHECKING:`` (it runs), ``importlib.import_module`` with a literal name; and inside ``router/``,
    an import up its inner floors."""
    lines = violations_in_copy(tmp_path, planted, body)
    assert len(lines) == 1 and lines[0].startswith(f"{planted}:"), lines
    assert says in lines[0], lines


def test_a_planted_circle_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two modules importing each other at module level are reported as a circle (the floors alone
    allow it: both sit in one room)."""
    import shutil

    copy = tmp_path / "repo"
    for d in ("launcher", "router"):
        shutil.copytree(REPO / d, copy / d, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "router/state/planted_a.py").write_text("from router.state import planted_b\n")
    (copy / "router/state/planted_b.py").write_text("from . import planted_a\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", copy)
    cycles = module_cycles(project_modules(copy))
    assert cycles == [["router.state.planted_a", "router.state.planted_b", "router.state.planted_a"]]
