"""The one change the router makes to a request body: the adapter name a tenant sends becomes the
served name of the adapter's current version (``router.adapters.names``).

The body is read once, strictly (``requested_model``): a body orjson refuses is refused, never passed
on unread. Everything else stays byte for byte: the value of the top-level ``"model"`` is replaced in
place when it can be found exactly once and the result parses with the new name; only a body where that
fails (the name written with escapes, or the same key and value nested in another object as well) is
parsed and written again whole, which keeps its meaning but not its spacing.
"""

from __future__ import annotations

import re
from typing import Any

import orjson


class UnreadableBody(ValueError):
    """A generation body the router cannot read (answered 400 on a fleet with adapters).

    The router and the engines must agree on what a body names: vLLM parses with ``json.loads``, which
    takes what orjson refuses (``NaN``, a UTF-8 byte order mark, a lone surrogate escape). A body the
    router could not read used to be forwarded as a base-model request, and the engine served the adapter
    it named to whoever sent it; refused here, nothing unread reaches an engine."""


def requested_model(body: bytes) -> str | None:
    """The top-level ``"model"`` of a generation body: None when it names none (absent or null: the
    engine's default, the base model); ``UnreadableBody`` for a body that is not one JSON object orjson
    reads, or a ``model`` that is not a string."""
    try:
        data: Any = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise UnreadableBody(f"the request body is not JSON the router can read ({exc})") from None
    if not isinstance(data, dict):
        raise UnreadableBody("the request body must be one JSON object")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise UnreadableBody(f'"model" must be a string, got {type(model).__name__}')
    return model


def model_of(body: bytes) -> str | None:
    """The top-level ``"model"`` of a JSON object body, or None (no body, not JSON, not a string)."""
    if not body or body.lstrip()[:1] != b"{":
        return None
    try:
        data: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None


def with_model(body: bytes, old: str, new: str) -> bytes:
    """``body`` with its top-level ``"model": old`` replaced by ``new``."""
    pattern = re.compile(rb'("model"\s*:\s*")' + re.escape(old.encode()) + rb'"')
    if len(pattern.findall(body)) == 1:
        out = pattern.sub(lambda m: m.group(1) + new.encode() + b'"', body)
        if model_of(out) == new:
            return out
    data = orjson.loads(body)
    data["model"] = new
    return orjson.dumps(data)
