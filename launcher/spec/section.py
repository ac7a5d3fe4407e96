"""What every spec section is written in, the spec's own and those a front or engine kind adds.

Kept apart from ``schema`` (which imports the kind registries to build the ``router`` and ``generation``
sections) so that a kind's package can declare its section with the spec's strictness without importing
the schema that imports it: the layers stay ``section`` <- kinds <- ``schema``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Tag


class Section(BaseModel):
    """Every section refuses unknown fields and silent type coercion: ``"8"`` for a GPU count, or a
    misspelt key, is far more likely a mistake than an intent."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=False)


def str_args(value: Any) -> Any:
    """Lists of command-line arguments: YAML numbers become strings (``["--max-model-len", 8192]`` is
    what people write), booleans are refused (``yes`` would silently become ``True``)."""
    if not isinstance(value, list):
        return value
    out = []
    for item in value:
        if isinstance(item, bool):
            raise ValueError(
                f"arguments must be strings; quote {item!r} (YAML reads yes/no/true as booleans)"
            )
        out.append(str(item) if isinstance(item, int | float) else item)
    return out


@dataclasses.dataclass(frozen=True)
class ChosenBy:
    """Marks a section that is one of several models, picked by one of its fields (``router``, by
    ``kind``): the loader reads it to report an unknown field as "a field of another kind" and a bad
    choice at ``<section>.<key>``, instead of at the union pydantic builds."""

    key: str
    default: str


def chosen_by(key: str, default: str, members: Mapping[str, type[BaseModel]]) -> Any:
    """The type of a section that is one of ``members``, picked by its field ``key`` (``default`` when
    the section does not say): each member refuses the others' fields as unknown ones of its own."""

    def choose(value: Any) -> Any:
        if isinstance(value, dict):
            chosen = value.get(key, default)
            return chosen if isinstance(chosen, str) else repr(chosen)  # a tag must be hashable
        return getattr(value, key, None)

    tagged = tuple(Annotated[model, Tag(name)] for name, model in members.items())
    return Annotated[Union[tagged], Discriminator(choose), ChosenBy(key, default)]  # noqa: UP007
