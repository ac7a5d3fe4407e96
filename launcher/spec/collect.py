"""Every problem of a spec in one run: the schema's errors, then the rules' on what the schema kept.

Why: pydantic's errors stop the spec from being built, and the rules across fields (and each kind's own,
such as the simulator's options) need a built spec; so a bad ``generation.sim.speed`` showed only once the
schema errors were fixed, one more edit-and-rerun per layer of mistakes. Here the fields pydantic refused
are taken out (their defaults stand in; a misspelt required field's value moves to the name it misspells)
and the spec is built again, a bounded number of times; the rules then run on what is left. A rule's issue
about a field already reported, or about one taken out, is dropped: it would judge the default standing in
for the user's value, not the value. When the spec cannot be rebuilt (a required field of the top level
gone, say), only the schema's errors are reported, never a guess.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from launcher.spec.errors import Issue
from launcher.spec.job import JobSpec
from launcher.spec.messages import dotted, issues_of, line_for, misspelt, spec_path

CHOOSERS = frozenset({"cluster", "fleet", "generation.engine", "generation.owner", "generation.fleet"})
"""Fields that choose which rules apply (the engine kind, where the job runs, its role): taken out, their
default would pick other rules (an engine kind refused as a typo would be judged as vLLM, "model
required"), so a spec rebuilt without one is not judged further."""
MAX_PASSES = 4
"""Rebuilds tried after the first failure: each takes out what the last refused (a moved typo's value
of the wrong type, a section left without a required field); a real spec needs one or two."""


def collect(
    data: dict[str, Any], lines: Mapping[tuple[Any, ...], int]
) -> tuple[JobSpec | None, list[Issue], list[str]]:
    """The spec (rebuilt without the refused fields when the schema refused some; ``None`` when it could
    not be), every issue found (the schema's, then the rules' about fields the user set) and the paths
    later checks must not judge (``covered``): those reported, taken out, or holding a moved typo's value."""
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    else:
        issues = rule_issues(spec, lines)
        return spec, issues, [i.path for i in issues]
    issues = issues_of(errors, lines)
    spec, taken = _rebuild(data, errors)
    blocked = [i.path for i in issues] + taken
    if spec is None or CHOOSERS.intersection(taken):
        return None, issues, blocked
    issues += [i for i in rule_issues(spec, lines) if not covered(i.path, blocked)]
    return spec, issues, blocked + [i.path for i in issues]


def rule_issues(spec: JobSpec, lines: Mapping[tuple[Any, ...], int]) -> list[Issue]:
    """``JobSpec.check``'s issues, each with the line of its field (or of the nearest section above)."""
    return [
        dataclasses.replace(i, line=line_for(lines, path_loc(i.path))) if i.line is None else i
        for i in spec.check()
    ]


def covered(path: str, reported: Iterable[str]) -> bool:
    """Whether an issue at ``path`` is about a field already reported or taken out: the same field, one
    inside it, or the section holding it."""
    for other in reported:
        if not other or not path:
            continue
        if path == other or path.startswith((other + ".", other + "[")):
            return True
        if other.startswith((path + ".", path + "[")):
            return True
    return False


def path_loc(path: str) -> tuple[Any, ...]:
    """``generation.vllm_args[2]`` -> ``("generation", "vllm_args", 2)``."""
    out: list[Any] = []
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        out.append(int(part[1:-1]) if part.startswith("[") else part)
    return tuple(out)


def _rebuild(data: dict[str, Any], errors: list[Any]) -> tuple[JobSpec | None, list[str]]:
    """The spec built again without what the schema refused, and the paths taken out."""
    data = copy.deepcopy(data)
    taken: list[str] = []
    for _ in range(MAX_PASSES):
        typos = misspelt(errors)
        meant = {(*path[:-1], name) for path, name in typos.items()}
        for err in errors:
            path = spec_path(err["loc"])
            if path in typos:
                _rename(data, path, typos[path])
                taken.append(dotted((*path[:-1], typos[path])))
                continue
            if err["type"] == "missing" and path in meant:
                continue  # the typo's value stands in for it
            where = _take(data, path, missing=err["type"] == "missing")
            if where is None:
                return None, taken
            taken.append(dotted(where))
        try:
            return JobSpec.model_validate(data), taken
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
    return None, taken


def _parent(data: Any, path: tuple[Any, ...]) -> dict[str, Any] | None:
    node = data
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def _rename(data: dict[str, Any], path: tuple[Any, ...], name: str) -> None:
    parent = _parent(data, path)
    if parent is not None and path[-1] in parent:
        parent[name] = parent.pop(path[-1])


def _take(data: dict[str, Any], path: tuple[Any, ...], missing: bool) -> tuple[Any, ...] | None:
    """Take out what an error is about, so its default applies: the field (a whole list for an item of
    it), or for a missing required field the section it is missing from. A required field of the top
    level (``name``) gets a stand-in instead; ``None`` when there is nothing to take (an error about the
    whole document)."""
    if any(isinstance(p, int) for p in path):
        path = path[: next(i for i, p in enumerate(path) if isinstance(p, int))]
    if missing:
        if len(path) == 1:
            data[path[0]] = "unnamed"  # the only required field of the top level is the job's name
            return path
        path = path[:-1]
    if not path:
        return None
    parent = _parent(data, path)
    if parent is not None:
        parent.pop(path[-1], None)
    return path
