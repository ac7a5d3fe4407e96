"""A small, bounded mutation tester: one mutant at a time, each judged by a chosen set of fast tests.

Why not mutmut: it rewrites the whole tree and runs the suite its own way; on a shared 2-core machine a
bounded, explainable run on a few modules is what is needed. Operators (each applied at one site):

* comparison flipped (``<``/``<=``/``>``/``>=``/``==``/``!=``/``in``/``is`` to their counterpart),
* arithmetic swapped (``+``/``-``, ``*``/``/``, ``//``/``*``, ``%``/``*``), ``and``/``or`` swapped,
  ``not x`` to ``x``,
* integer constants moved by one (``n`` to ``n+1`` and ``n-1``), ``True``/``False`` swapped,
* a call statement deleted (``tried.add(url)`` -> ``pass``), a ``return x`` to ``return None``.

Docstrings, annotations and ``log``/``raise`` message strings are left alone. The mutated module is
written into a scratch copy of the working tree (files git tracks or does not ignore), never into the
working tree itself, and
tests run there with ``-x`` (a killed mutant stops at its first failing test) under a per-mutant timeout
(a hang counts as killed).

    python tools/mutants.py router/http/status.py -- tests/component/test_router_hardening.py -k "literal"
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_COMPARE = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
_BINOP = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
    ast.Mod: ast.Mult,
}


@dataclass(frozen=True)
class Mutant:
    index: int
    line: int
    description: str


class _Sites(ast.NodeTransformer):
    """Visits mutation sites in a fixed order; applies the one numbered ``target`` (or none: -1)."""

    def __init__(self, target: int = -1) -> None:
        self.target = target
        self.count = 0
        self.found: list[Mutant] = []

    def _site(self, node: ast.AST, description: str) -> bool:
        i = self.count
        self.count += 1
        self.found.append(Mutant(i, getattr(node, "lineno", 0), description))
        return i == self.target

    # -- skip what is not behaviour ---------------------------------------------------------------
    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        node.body = self._body(node.body)
        for deco in node.decorator_list:
            self.visit(deco)
        self.visit(node.args)
        return node

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_arguments(self, node: ast.arguments) -> ast.AST:
        node.defaults = [self.visit(d) for d in node.defaults]
        node.kw_defaults = [None if d is None else self.visit(d) for d in node.kw_defaults]
        return node

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        node.body = self._body(node.body)
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        if node.value is not None:
            node.value = self.visit(node.value)
        return node

    def visit_JoinedStr(self, node: ast.JoinedStr) -> ast.AST:
        return node

    def visit_Raise(self, node: ast.Raise) -> ast.AST:
        return node  # the exception type is behaviour but its message is not; leave both

    def visit_Module(self, node: ast.Module) -> ast.AST:
        node.body = self._body(node.body)
        return node

    def _body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:] or [ast.Pass()]  # the docstring
        return [self.visit(stmt) for stmt in body]

    # -- operators ---------------------------------------------------------------------------------
    def visit_Expr(self, node: ast.Expr) -> ast.AST:
        if isinstance(node.value, (ast.Call, ast.Await)):
            call = node.value.value if isinstance(node.value, ast.Await) else node.value
            if isinstance(call, ast.Call) and _name(call.func).split(".")[0] not in ("log", "logging"):
                if self._site(node, f"delete call {_name(call.func)}()"):
                    return ast.copy_location(ast.Pass(), node)
        node.value = self.visit(node.value)
        return node

    def visit_Return(self, node: ast.Return) -> ast.AST:
        if node.value is not None and not (isinstance(node.value, ast.Constant) and node.value.value is None):
            if self._site(node, "return None"):
                return ast.copy_location(ast.Return(value=ast.Constant(None)), node)
            node.value = self.visit(node.value)
        return node

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        node.left = self.visit(node.left)
        node.comparators = [self.visit(c) for c in node.comparators]
        for i, op in enumerate(node.ops):
            swap = _COMPARE.get(type(op))
            if swap is not None and self._site(node, f"{type(op).__name__} -> {swap.__name__}"):
                node.ops = [*node.ops[:i], swap(), *node.ops[i + 1 :]]
        return node

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        node.left = self.visit(node.left)
        node.right = self.visit(node.right)
        if _is_str(node.left) or _is_str(node.right):
            return node  # string formatting / concatenation
        swap = _BINOP.get(type(node.op))
        if swap is not None and self._site(node, f"{type(node.op).__name__} -> {swap.__name__}"):
            node.op = swap()
        return node

    def visit_AugAssign(self, node: ast.AugAssign) -> ast.AST:
        node.value = self.visit(node.value)
        swap = _BINOP.get(type(node.op))
        if swap is not None and self._site(node, f"{type(node.op).__name__}= -> {swap.__name__}="):
            node.op = swap()
        return node

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.AST:
        node.values = [self.visit(v) for v in node.values]
        swap = ast.Or if isinstance(node.op, ast.And) else ast.And
        if self._site(node, f"{type(node.op).__name__} -> {swap.__name__}"):
            node.op = swap()
        return node

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        node.operand = self.visit(node.operand)
        if isinstance(node.op, ast.Not) and self._site(node, "not x -> x"):
            return node.operand
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        value = node.value
        if isinstance(value, bool):
            if self._site(node, f"{value} -> {not value}"):
                return ast.copy_location(ast.Constant(not value), node)
        elif isinstance(value, int):
            if self._site(node, f"{value} -> {value + 1}"):
                return ast.copy_location(ast.Constant(value + 1), node)
            if self._site(node, f"{value} -> {value - 1}"):
                return ast.copy_location(ast.Constant(value - 1), node)
        return node


def _is_str(node: ast.AST) -> bool:
    return isinstance(node, (ast.JoinedStr,)) or (
        isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes))
    )


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return type(node).__name__


def mutants(source: str) -> list[Mutant]:
    sites = _Sites()
    sites.visit(ast.parse(source))
    return sites.found


def mutate(source: str, index: int) -> str:
    tree = ast.parse(source)
    sites = _Sites(index)
    tree = sites.visit(copy.deepcopy(tree))
    ast.fix_missing_locations(tree)
    return ast.unparse(tree)


def _scratch_copy() -> Path:
    """The working tree as it is (tracked and untracked files, not ignored ones) in a temporary folder."""
    work = Path(tempfile.mkdtemp(prefix="mutants-"))
    listed = subprocess.run(
        ["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            dest = work / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)
    return work


def run_tests(work: Path, pytest_args: list[str], timeout_s: float) -> str:
    """``killed``, ``survived`` or ``timeout`` (counted as killed)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *pytest_args]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        proc = subprocess.run(cmd, cwd=work, capture_output=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return "timeout"
    return "survived" if proc.returncode == 0 else "killed"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    split = args.index("--") if "--" in args else len(args)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("module", help="path of the module to mutate, relative to the repository")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per mutant (a hang is killed)")
    ap.add_argument("--max-mutants", type=int, default=400, help="bound on the run")
    ap.add_argument("--only", type=str, default="", help="comma-separated mutant indices to run")
    ap.add_argument("--json", type=Path, default=None, help="write every mutant's outcome here")
    opts = ap.parse_args(args[:split])
    pytest_args = args[split + 1 :]
    source = (ROOT / opts.module).read_text()
    found = mutants(source)[: opts.max_mutants]
    if opts.only:
        wanted = {int(x) for x in opts.only.split(",")}
        found = [m for m in found if m.index in wanted]
    work = _scratch_copy()
    target = work / opts.module
    outcomes: list[dict[str, object]] = []
    try:
        if run_tests(work, pytest_args, opts.timeout * 3) != "survived":
            print("the tests fail (or hang) without any mutant: fix them first", file=sys.stderr)
            return 2
        t0 = time.monotonic()
        for m in found:
            target.write_text(mutate(source, m.index))
            outcome = run_tests(work, pytest_args, opts.timeout)
            outcomes.append({"index": m.index, "line": m.line, "mutant": m.description, "outcome": outcome})
            mark = "SURVIVED" if outcome == "survived" else outcome
            print(f"{m.index:4d} line {m.line:4d} {m.description:<40} {mark}", flush=True)
        target.write_text(source)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    killed = sum(o["outcome"] != "survived" for o in outcomes)
    total = len(outcomes)
    took = time.monotonic() - t0
    print(f"\n{opts.module}: {killed}/{total} killed ({100 * killed / max(total, 1):.0f}%) in {took:.0f} s")
    for o in outcomes:
        if o["outcome"] == "survived":
            print(f"  survived: #{o['index']} line {o['line']}: {o['mutant']}")
    if opts.json:
        opts.json.write_text(json.dumps({"module": opts.module, "outcomes": outcomes}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
