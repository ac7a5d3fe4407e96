"""How the control URL (``router.fleet.vllm_control``) answers, in vLLM 0.32's shapes.

Why a module of its own: a trainer's vLLM client reads vLLM's error bodies (``error.message``) and
statuses, and the routes and the LoRA routes of the control URL must answer them alike; one place
spells the shapes (vLLM's ``ErrorResponse``, FastAPI's validation error as vLLM renders it, FastAPI's
``bool`` query parsing, a JSON body read as vLLM's handlers read it).
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from aiohttp import web

_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def json_answer(status: int, payload: object) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


def vllm_error(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    """vLLM's ``ErrorResponse`` body, what its exception handlers answer."""
    return json_answer(status, {"error": {"message": message, "type": kind, "param": param, "code": status}})


def validation(loc: str, kind: str, msg: str, value: Any) -> web.Response:
    """FastAPI's ``RequestValidationError`` as vLLM renders it (400, one line per error)."""
    shown = f"<{type(value).__name__} of {len(value)} items>" if isinstance(value, list | dict) else value
    line = str({"type": kind, "loc": loc, "msg": msg, "input": shown})
    return vllm_error(400, f"1 validation error:\n  {line}", "Bad Request", loc)


def field_missing(loc: str, value: Any, expected: str = "string") -> web.Response:
    """A required body field that is absent (``missing``) or of another type."""
    if value is None:
        return validation(loc, "missing", "Field required", value)
    kind = "dict_type" if expected == "dictionary" else f"{expected}_type"
    return validation(loc, kind, f"Input should be a valid {expected}", value)


def flag(raw: str | None, default: bool) -> bool | None:
    """A FastAPI ``bool`` query parameter (None: not a boolean)."""
    if raw is None:
        return default
    low = raw.lower()
    return True if low in _TRUE else False if low in _FALSE else None


def not_a_flag(loc: str, raw: str | None) -> web.Response:
    return validation(loc, "bool_parsing", "Input should be a valid boolean, unable to interpret input", raw)


async def read_json(request: web.Request) -> Any:
    """The request's JSON (``{}`` when empty); ``ValueError`` when it is not JSON."""
    raw = await request.read()
    return json.loads(raw) if raw.strip() else {}


def not_json(exc: ValueError) -> web.Response:
    return validation("body", "json_invalid", "JSON decode error", str(exc))
