"""The one change the router makes to a request body: the adapter name a tenant sends becomes the
served name of the adapter's current version (``router.adapters.names``).

Everything else stays byte for byte: the value of the top-level ``"model"`` is replaced in place when it
can be found exactly once and the result parses with the new name; only a body where that fails (the
name written with escapes, or the same key and value nested in another object as well) is parsed and
written again whole, which keeps its meaning but not its spacing.
"""

from __future__ import annotations

import re
from typing import Any

import orjson


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
