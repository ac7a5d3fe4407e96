"""Pydantic's errors about a spec, rewritten as one ``Issue`` each: the spec's field path, what is wrong
and what to do, and the line in the file.

A section that is one of several models (``router``: the front ``router.kind`` names, see
``launcher.spec.section.chosen_by``) gets its own words: pydantic reports a field of another kind as an
unknown field under a path carrying the chosen kind (``router.builtin.url``); here it is ``router.url``,
"only for router.kind: vllm-router, not builtin", and a kind no front has is reported at ``router.kind``.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from launcher.spec.errors import Issue
from launcher.spec.job import JobSpec
from launcher.spec.section import ChosenBy


def dotted(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def line_for(lines: Mapping[tuple[Any, ...], int], loc: Sequence[Any]) -> int | None:
    loc = tuple(loc)
    while loc:
        if loc in lines:
            return lines[loc]
        loc = loc[:-1]
    return None


@dataclasses.dataclass(frozen=True)
class _Choice:
    """A section that is one of several models (``ChosenBy``): the one chosen and the others."""

    key: str
    chosen: str
    members: dict[str, type[BaseModel]]


def _members(field: Any) -> tuple[ChosenBy, dict[str, type[BaseModel]]] | None:
    """``(ChosenBy, {tag: model})`` of a field whose type ``launcher.spec.section.chosen_by`` made."""
    chosen_by = next((m for m in field.metadata if isinstance(m, ChosenBy)), None)
    if chosen_by is None:
        return None
    members = {}
    for arm in typing.get_args(field.annotation):
        model, *meta = typing.get_args(arm)
        members[next(m.tag for m in meta if hasattr(m, "tag"))] = model
    return chosen_by, members


def _walk(loc: Sequence[Any]) -> tuple[tuple[Any, ...], type[BaseModel] | None, _Choice | None]:
    """``loc`` as the spec's field path (pydantic puts the chosen member's tag into it: ``router.dynamo.x``
    comes as ``("router", "dynamo", "dynamo", "x")``), the model of the section holding its last part, and
    the choice that section was, if it was one."""
    model: type[BaseModel] | None = JobSpec
    path: list[Any] = []
    choice: _Choice | None = None
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        path.append(part)
        field = model.model_fields.get(str(part)) if model is not None else None
        if not parts:
            break
        choice = None
        if field is None:
            model = None
            continue
        union = _members(field)
        if union is not None:
            chosen_by, members = union
            if parts and parts[0] in members:
                tag = parts.pop(0)
                model, choice = members[tag], _Choice(chosen_by.key, tag, members)
            else:
                model = None
            continue
        candidates = [field.annotation]
        if (
            isinstance(field.annotation, types.UnionType)
            or typing.get_origin(field.annotation) is typing.Union
        ):
            candidates = list(typing.get_args(field.annotation))
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return tuple(path), model, choice


def spec_path(loc: Sequence[Any]) -> tuple[Any, ...]:
    """A pydantic error location as the spec's field path (without the chosen member's tag)."""
    return _walk(loc)[0]


def _foreign(section: str, field: str, choice: _Choice) -> str | None:
    """An unknown field that another member of the choice has: which ones, and what to set instead."""
    owners = [
        tag for tag, model in choice.members.items() if tag != choice.chosen and field in model.model_fields
    ]
    if not owners:
        return None
    hints: dict[str, str] = getattr(choice.members[choice.chosen], "field_hints", {})
    hint = f" ({hints[field]})" if field in hints else ""
    return f"only for {section}.{choice.key}: {' or '.join(owners)}, not {choice.chosen}; remove it{hint}"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _one_of(names: Sequence[str]) -> str:
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _choice_error(err: Mapping[str, Any]) -> tuple[tuple[Any, ...], str] | None:
    """A section that is one of several models, given a choice none of them is (``router.kind: nginx``)
    or given as something other than a mapping: reported at its key, or at the section."""
    path, parent, _ = _walk(err["loc"])
    field = parent.model_fields.get(str(path[-1])) if parent is not None and path else None
    union = _members(field) if field is not None else None
    if union is None:
        return None
    chosen_by, members = union
    got = err.get("input")
    if err["type"] == "union_tag_invalid" and isinstance(got, dict):
        given = _show(got.get(chosen_by.key))
        return (*path, chosen_by.key), f"must be one of {_one_of(list(members))} (got {given})"
    return path, f"must be a section (a mapping of fields) (got {_show(got)})"


KNOWN_SHOWN = 6
"""Field names an unknown field's message lists: a section such as ``router:`` has 16, and the whole
list made each line 300 characters long; the did-you-mean names the likely one, docs/spec.md has all."""


def _first_few(names: Sequence[str]) -> str:
    if len(names) <= KNOWN_SHOWN + 1:
        return ", ".join(names)
    return f"{', '.join(names[:KNOWN_SHOWN])} and {len(names) - KNOWN_SHOWN} more (docs/spec.md)"


def _closest_field(loc: Sequence[Any]) -> str | None:
    """The known field of the section an unknown field at ``loc`` is closest to, if any is close."""
    model = _walk(loc)[1]
    if model is None:
        return None
    hint = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    return hint[0] if hint else None


def misspelt(errors: Sequence[Mapping[str, Any]]) -> dict[tuple[Any, ...], str]:
    """``{path of an unknown field: the required field it misspells}``: an unknown field whose closest
    name is a field reported missing in the same section (``comand`` for ``command``). One typo is one
    mistake: it is reported once, as the unknown field with its did-you-mean, and the loader's second
    pass reads its value under the intended name."""
    missing = {spec_path(e["loc"]) for e in errors if e["type"] == "missing"}
    out: dict[tuple[Any, ...], str] = {}
    for e in errors:
        if e["type"] != "extra_forbidden":
            continue
        path, hint = spec_path(e["loc"]), _closest_field(e["loc"])
        if hint is not None and (*path[:-1], hint) in missing:
            out[path] = hint
    return out


def issues_of(errors: Sequence[Mapping[str, Any]], lines: Mapping[tuple[Any, ...], int]) -> list[Issue]:
    """Every pydantic error as one ``Issue``; a misspelt required field (``misspelt``) is one issue, not
    "required field is missing" beside "unknown field"."""
    typos = misspelt(errors)
    meant = {(*path[:-1], name) for path, name in typos.items()}
    issues = []
    for e in errors:
        path = spec_path(e["loc"])
        if e["type"] == "missing" and path in meant:
            continue
        issue = issue_of(e, lines)
        if path in typos:
            issue = dataclasses.replace(
                issue,
                message=f"unknown field; did you mean {typos[path]!r}? rename it ({typos[path]} is required)",
            )
        issues.append(issue)
    return issues


def issue_of(err: Mapping[str, Any], lines: Mapping[tuple[Any, ...], int]) -> Issue:
    if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
        at = _choice_error(err)
        if at is not None:
            return Issue(dotted(at[0]), at[1], line_for(lines, at[0]))
    path = _walk(err["loc"])[0]
    return Issue(dotted(path), _describe(err), line_for(lines, path))


def _describe(err: Mapping[str, Any]) -> str:
    """A pydantic error rewritten as what is wrong and what to do."""
    kind, ctx, loc, got = err["type"], err.get("ctx") or {}, err["loc"], err.get("input")
    if kind == "extra_forbidden":
        path, model, choice = _walk(loc)
        if model is None:
            return "unknown field; remove it"
        foreign = _foreign(dotted(path[:-1]), str(path[-1]), choice) if choice is not None else None
        if foreign is not None:
            return foreign
        known = list(model.model_fields)
        hint = difflib.get_close_matches(str(loc[-1]), known, n=1)
        did = f"did you mean {hint[0]!r}? " if hint else ""
        return f"unknown field; {did}known fields here: {_first_few(known)}"
    if kind == "missing":
        model = _walk(loc)[1]
        field = model.model_fields.get(str(loc[-1])) if model else None
        what = f" ({field.description})" if field and field.description else ""
        return f"required field is missing; add it{what}"
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return f"must be {bounds[kind]} {limit} (got {_show(got)})"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')} (got {_show(got)})"
    quote_hint = "; quote it if you meant text" if isinstance(got, int | float | bool) else ""
    type_words = {
        "int_type": "an integer",
        "int_from_float": "a whole number",
        "float_type": "a number",
        "bool_type": "true or false",
        "string_type": "a string",
        "dict_type": "a mapping (key: value lines)",
        "list_type": "a list",
        "tuple_type": "a list",
        "model_type": "a section (a mapping of fields)",
        "model_attributes_type": "a section (a mapping of fields)",
    }
    if kind in type_words:
        hint = quote_hint if kind == "string_type" else ""
        if (
            kind in {"int_type", "float_type"}
            and isinstance(got, str)
            and re.fullmatch(r"\s*[-+]?[\d.]+\s*", got)
        ):
            hint = "; remove the quotes"
        return f"must be {type_words[kind]} (got {_show(got)}){hint}"
    if kind in {"value_error", "assertion_error"}:
        msg = str(err["msg"])
        return msg.split(", ", 1)[1] if msg.startswith(("Value error, ", "Assertion failed, ")) else msg
    return f"{err['msg']} (got {_show(got)})"
