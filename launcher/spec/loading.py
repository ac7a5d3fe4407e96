"""Loading a spec: YAML with line numbers, pydantic errors rewritten for people (``messages``).

YAML note: the loader keeps ``4:00:00`` a string. PyYAML's YAML 1.1 rules would read it as the base-60
integer 14400, which as minutes would be a 10-day job.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from launcher.spec.collect import collect, covered, path_loc
from launcher.spec.errors import Issue, SpecError
from launcher.spec.job import JobSpec
from launcher.spec.machine import Machine, machine_issues
from launcher.spec.messages import dotted, line_for, spec_path
from launcher.spec.resolved import ResolvedSpec


class _NoSexagesimal:
    """Wraps a YAML 1.1 int/float resolver regex so ``4:00:00`` stays a string (see module docstring)."""

    def __init__(self, regex: re.Pattern[str]) -> None:
        self.regex = regex

    def match(self, value: str) -> re.Match[str] | None:
        return None if ":" in value else self.regex.match(value)


class _SpecLoader(yaml.SafeLoader):
    """SafeLoader without base-60 numbers."""


_SpecLoader.yaml_implicit_resolvers = {
    first: [
        (tag, _NoSexagesimal(regex) if tag.endswith((":int", ":float")) else regex)  # type: ignore[arg-type]
        for tag, regex in resolvers
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _line_map(node: yaml.Node) -> tuple[dict[tuple[Any, ...], int], list[Issue]]:
    """Line (1-based) of every mapping key and sequence item, by path; and duplicate keys, which
    PyYAML would otherwise resolve silently to the last one."""
    lines: dict[tuple[Any, ...], int] = {(): node.start_mark.line + 1}
    dups: list[Issue] = []

    def walk(n: yaml.Node, path: tuple[Any, ...]) -> None:
        if isinstance(n, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, value_node in n.value:
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else repr(key_node)
                sub = (*path, key)
                if key in seen:
                    dups.append(
                        Issue(
                            dotted(sub),
                            "given twice; keep one (YAML would silently use the last)",
                            key_node.start_mark.line + 1,
                        )
                    )
                seen.add(key)
                lines.setdefault(sub, key_node.start_mark.line + 1)
                walk(value_node, sub)
        elif isinstance(n, yaml.SequenceNode):
            for i, item in enumerate(n.value):
                lines.setdefault((*path, i), item.start_mark.line + 1)
                walk(item, (*path, i))

    walk(node, ())
    return lines, dups


def parse_spec(
    data: Any, source: str = "<spec>", lines: Mapping[tuple[Any, ...], int] | None = None
) -> JobSpec:
    """Validate already-parsed YAML data (a mapping); ``SpecError`` naming ``source`` otherwise.

    Shape and cross-field rules are both checked, every problem at once (``launcher.spec.collect``), so
    a returned spec always resolves.
    """
    spec, issues, _ = _collect(data, source, lines or {})
    if issues:
        raise SpecError(source, issues)
    assert spec is not None
    return spec


def _collect(
    data: Any, source: str, lines: Mapping[tuple[Any, ...], int]
) -> tuple[JobSpec | None, list[Issue], list[str]]:
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise SpecError(
            source,
            [Issue("", f"the spec must be a YAML mapping of sections (name, training, ...), got {kind}")],
        )
    return collect(data, lines)


SPEC_DIR = "${spec_dir}"
"""Written in ``training.command`` or ``generation.model``, the absolute directory of the spec file: a
spec that names files beside it (``examples/local.yaml``'s trainer) runs from any directory. Replaced
when the file is loaded, so the resolved spec (``submit --dry-run``, the job's snapshot) shows the path."""
_EXPANDED = (("training", "command"), ("generation", "model"))
_SHELL_SPECIAL = re.compile(r"[\\\"$`\n]")


def _expand_spec_dir(data: Any, spec_dir: Path) -> tuple[Any, list[Issue]]:
    """``data`` with ``${spec_dir}`` replaced in the fields that take it (``SPEC_DIR``)."""
    if not isinstance(data, dict):
        return data, []
    issues = []
    for section, key in _EXPANDED:
        node = data.get(section)
        value = node.get(key) if isinstance(node, dict) else None
        if not isinstance(value, str) or SPEC_DIR not in value:
            continue
        if _SHELL_SPECIAL.search(str(spec_dir)):
            issues.append(
                Issue(
                    f"{section}.{key}",
                    f"{SPEC_DIR} is {str(spec_dir)!r}, which a shell would not read as one path; move the "
                    "spec to a directory without quotes, $, ` or \\ in its path",
                )
            )
            continue
        data = {**data, section: {**node, key: value.replace(SPEC_DIR, str(spec_dir))}}
    return data, issues


# Limits that keep a hostile or broken file from hanging ``validate`` (issue: a 463-byte alias bomb took
# over 50 s and 1.7 GB; 5,000 nested ``[`` raised RecursionError). A real spec has a few hundred nodes and
# a nesting depth under 10, so these are far above any honest use.
MAX_DEPTH = 64
"""Deepest nesting of mappings/sequences the composer accepts."""
MAX_NODES = 100_000
"""Nodes the document may expand to once aliases are followed (a tree walk visits every one)."""


class _Refused(yaml.YAMLError):
    """A document refused by the limits above, with the line where it was noticed."""

    def __init__(self, message: str, line: int | None) -> None:
        super().__init__(message)
        self.message, self.line = message, line


class _BoundedSpecLoader(_SpecLoader):
    """``_SpecLoader`` whose composer refuses nesting deeper than ``MAX_DEPTH`` before Python's stack
    does (PyYAML composes recursively)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise _Refused(
                    f"nested more than {MAX_DEPTH} levels deep; a job spec is a few levels of sections",
                    mark.line + 1,
                )
            return super().compose_node(parent, index)  # type: ignore[no-any-return]
        finally:
            self._depth -= 1


def _check_expanded_size(root: yaml.Node) -> None:
    """Refuse a node graph that expands past ``MAX_NODES`` or refers to itself.

    Aliases make the composed graph a DAG (or a cycle, ``&a [*a]``) that every later step (line map,
    construction, pydantic) walks as a tree: the size is counted once per node (memoized, so the count
    itself is linear) and a node met again while being counted is a cycle.
    """
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise _Refused(
                "an alias refers to a node that contains it (a cycle); remove it", node.start_mark.line + 1
            )
        active.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                total += size(k) + size(v)
                if total > MAX_NODES:
                    break
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                total += size(item)
                if total > MAX_NODES:
                    break
        active.discard(key)
        sizes[key] = total
        if total > MAX_NODES:
            raise _Refused(
                f"expands to more than {MAX_NODES:,} values once aliases (*name) are followed; "
                "a job spec needs a few hundred: remove the nested aliases",
                node.start_mark.line + 1,
            )
        return total

    size(root)


def _parse_yaml(text: str, source: str) -> tuple[Any, yaml.Node | None]:
    """(data, root node) of one YAML document; ``SpecError`` naming ``source`` for anything wrong."""
    loader = _BoundedSpecLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_expanded_size(node)
        data = loader.construct_document(node) if node is not None else None
    except _Refused as exc:
        raise SpecError(source, [Issue("", f"YAML refused: {exc.message}", exc.line)]) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        problem = " ".join(str(p) for p in (exc.context, exc.problem) if p)
        raise SpecError(source, [Issue("", f"YAML syntax error: {problem}", line)]) from None
    except yaml.YAMLError as exc:
        raise SpecError(source, [Issue("", f"YAML error: {exc}")]) from None
    except RecursionError:  # belt and braces: MAX_DEPTH should always fire first
        raise SpecError(source, [Issue("", f"YAML refused: nested too deeply (limit {MAX_DEPTH})")]) from None
    finally:
        loader.dispose()
    return data, node


def _read_yaml(source: str) -> tuple[Any, yaml.Node | None]:
    try:
        text = Path(source).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(source, [Issue("", "no such file; check the path")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(source, [Issue("", f"cannot read the file: {exc}")]) from None
    return _parse_yaml(text, source)


# --------------------------------------------------------------------------------------------------
# --set overrides
# --------------------------------------------------------------------------------------------------

_OVERRIDE_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclasses.dataclass(frozen=True)
class Override:
    """One ``--set key.path=value``: ``value`` is the text parsed as a YAML scalar (``8`` an int,
    ``true`` a bool, ``"04:00:00"`` a string, ``[a, b]`` a list)."""

    text: str
    path: tuple[str, ...]
    value: Any


def parse_override(text: str) -> Override:
    """``key.path=value`` -> ``Override``; ``SpecError`` naming the override when malformed."""
    where = f"--set {text}"
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not _OVERRIDE_KEY_RE.fullmatch(key):
        raise SpecError(where, [Issue("", "expected KEY.PATH=VALUE, e.g. --set generation.nodes=4")])
    value, _ = _parse_yaml(raw, where) if raw.strip() else (None, None)
    return Override(text=text, path=tuple(key.split(".")), value=value)


def apply_overrides(data: Any, overrides: Sequence[Override], source: str) -> Any:
    """A copy of ``data`` (the parsed file) with each override set, creating sections as needed."""
    if not overrides:
        return data
    import copy

    out = copy.deepcopy(data) if isinstance(data, dict) else {}
    for o in overrides:
        node = out
        for i, part in enumerate(o.path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                where = ".".join(o.path[: i + 1])
                raise SpecError(
                    source, [Issue(f"--set {o.text}", f"{where} is not a section (it is {child!r})")]
                )
            node = child
        node[o.path[-1]] = o.value
    return out


def _blame_overrides(exc: SpecError, overrides: Sequence[Override]) -> SpecError:
    """Issues about a field an override set are reported against the override, not the file line."""
    if not overrides:
        return exc
    by_path = {".".join(o.path): o for o in overrides}
    issues = []
    for issue in exc.issues:
        o = next((by_path[p] for p in by_path if issue.path == p or issue.path.startswith(p + ".")), None)
        if o is None:
            o = next((by_path[p] for p in by_path if issue.path.startswith(p + "[")), None)
        issues.append(dataclasses.replace(issue, path=f"--set {o.text}", line=None) if o else issue)
    return SpecError(exc.source, issues)


def attached_to(data: Any, fleet: str) -> Any:
    """``submit --fleet NAME``: the spec's own generation and router give way to the standing fleet's;
    only the model name it would serve is kept, to be checked against the fleet's."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    gen = out.get("generation") if isinstance(out.get("generation"), dict) else {}
    served = gen.get("served_model_name") or gen.get("model")
    out["generation"] = {"fleet": fleet, **({"served_model_name": served} if served else {})}
    out.pop("router", None)
    return out


def load_spec(
    path: str | os.PathLike[str],
    overrides: Sequence[str] = (),
    attach_to: str | None = None,
    machine: Machine | None = None,
) -> JobSpec:
    """Read, parse and validate a spec file, with ``--set`` overrides applied on top (and, with
    ``attach_to``, the job attached to that standing fleet instead of its own). Errors (missing
    file, YAML syntax, schema, rules) raise ``SpecError`` naming the file as given, with line numbers
    where the YAML has them, and naming the override for a field an override set: all of them at once.

    With ``machine``, the spec is also checked against that machine (``launcher.spec.machine``): its
    errors join the others; its warnings are the returned spec's ``warnings`` (or join the error's issues,
    so one run shows everything)."""
    source = os.fspath(path)
    parsed = [parse_override(text) for text in overrides]
    data, node = _read_yaml(source)
    lines, dups = _line_map(node) if node is not None else ({}, [])
    data = apply_overrides(data, parsed, source)
    if attach_to is not None:
        data = attached_to(data, attach_to)
    data, issues = _expand_spec_dir(data, Path(source).resolve().parent)
    spec, found, blocked = _collect(data, source, lines)
    issues = [*dups, *issues, *found]
    if spec is not None:
        spec._source = Path(source).resolve()
        if machine is not None:
            reported = [*blocked, *(i.path for i in issues)]
            issues += [
                dataclasses.replace(i, line=line_for(lines, path_loc(i.path)))
                for i in machine_issues(spec, machine)
                if not covered(i.path, reported)
            ]
    if any(not i.warning for i in issues):
        raise _blame_overrides(SpecError(source, issues), parsed)
    assert spec is not None
    spec._warnings = tuple(_blame_overrides(SpecError(source, issues), parsed).issues) if issues else ()
    return spec


def load_resolved(
    path: str | os.PathLike[str], overrides: Sequence[str] = (), attach_to: str | None = None
) -> ResolvedSpec:
    """``load_spec(path, overrides, attach_to).resolved()``: the one call the CLI and the driver need."""
    return load_checked(path, overrides, attach_to)[0]


def load_checked(
    path: str | os.PathLike[str],
    overrides: Sequence[str] = (),
    attach_to: str | None = None,
    machine: Machine | None = None,
) -> tuple[ResolvedSpec, tuple[Issue, ...]]:
    """``load_resolved``, checked against ``machine`` too: the resolved spec and the warnings."""
    spec = load_spec(path, overrides, attach_to, machine)
    try:
        return spec.resolved(), spec.warnings
    except SpecError as exc:  # cannot happen after load_spec's checks, but keep the file name if it does
        raise SpecError(os.fspath(path), exc.issues) from None


def load_snapshot(path: str | os.PathLike[str]) -> ResolvedSpec:
    """Read back a resolved spec written by ``ResolvedSpec.to_yaml`` (the job directory's snapshot).

    The snapshot is what the job runs, so it is read as data, not re-resolved: defaults derived at submit
    time (``job_root`` expanded on the submitting machine, engine counts) stay as they were. Any problem
    (missing file, YAML, a field this version does not know) is a ``SpecError`` naming the file.
    """
    source = os.fspath(path)
    data = _read_yaml(source)[0]
    if not isinstance(data, dict):
        raise SpecError(source, [Issue("", "not a resolved spec snapshot (expected a YAML mapping)")])
    try:
        return ResolvedSpec.model_validate(data)
    except ValidationError as exc:
        issues = [
            Issue(dotted(spec_path(e["loc"])), f"{e['msg']} (a snapshot from another rl-launch version?)")
            for e in exc.errors(include_url=False)
        ]
        raise SpecError(source, issues) from None
