"""Fleet operations: one HTTP call fanned out to every engine, one report of who complied.

The refit window between RL steps (pause, weight update, cache reset, version stamp, resume) is only
correct when *every* engine did its part: one engine left unpaused keeps generating with the old policy,
one engine left on the old version serves stale rollouts. So each operation here is sent to all engines at
once, each answer is judged on its own (transport error, timeout, non-2xx, an ``"error"`` in the body, or
an answer that does not say what the operation asked for), and the report's ``ok`` is true only when every
engine complied. Nothing retries: a half-applied refit must surface, not be papered over.

This module owns the report's shape (``FleetOpReport``): the router's ``/fleet/*`` admin routes answer
with it, ``rl-launch fleet ...`` prints it and ``launcher.fleet.client`` hands it to the trainer.
``router.fleet.cache_reset`` keeps its own report type (the job directory records it) and sends through
``fan_out`` here.

The engine routes are vLLM 0.32's (``VLLM_SERVER_DEV_MODE=1``; ``vllm/entrypoints/rl/online/api_router.py``
and the dev routes), which the simulator (``launcher.engines.sim``) serves with the same semantics.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

PAUSE_MODES = ("abort", "wait", "keep")
"""vLLM's ``PauseMode``: abort in-flight requests, wait for them to finish, or freeze them until resume."""

Check = Callable[[Any], str | None]
"""Judges a parsed 2xx body: ``None`` when it shows the engine complied, else why not."""


@dataclass
class EngineAnswer:
    url: str
    ok: bool
    status: int | None
    detail: str = ""
    body: Any = None
    """The engine's parsed JSON answer (``None`` when it sent none)."""


@dataclass
class FleetOpReport:
    op: str
    engines: list[EngineAnswer] = field(default_factory=list)
    result: dict[str, Any] = field(default_factory=dict)
    """What the operation found fleet-wide (versions, checksum groups, held requests...)."""
    error: str = ""
    """Why the operation failed beyond single engines (e.g. checksums disagree); empty when none."""
    at: float = field(default_factory=time.time)
    took_s: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.engines) and all(e.ok for e in self.engines) and not self.error

    def failures(self) -> list[EngineAnswer]:
        return [e for e in self.engines if not e.ok]

    def why(self) -> str:
        """One line saying what went wrong (empty when ok)."""
        if self.ok:
            return ""
        if not self.engines:
            return "no engine is serving"
        if self.error:
            return self.error
        bad = self.failures()
        return f"{len(bad)} of {len(self.engines)} engine(s) did not comply: {bad[0].url}: {bad[0].detail}"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FleetOpReport:
        return cls(
            op=str(data.get("op", "")),
            engines=[EngineAnswer(**e) for e in data.get("engines", [])],
            result=dict(data.get("result") or {}),
            error=str(data.get("error") or ""),
            at=float(data.get("at", 0.0)),
            took_s=float(data.get("took_s", 0.0)),
        )


def dev_mode_hint(status: int) -> str:
    if status == 404:
        return " (vLLM serves the RL routes only with VLLM_SERVER_DEV_MODE=1 in generation.env)"
    return ""


async def fan_out(
    urls: Sequence[str],
    method: str,
    path: str,
    *,
    json_body: Any = None,
    params: dict[str, str] | None = None,
    check: Check | None = None,
    api_key: str | None = None,
    timeout_s: float = 60.0,
    hint: Callable[[int], str] = dev_mode_hint,
) -> list[EngineAnswer]:
    """Send ``method path`` to every engine at once; an error, a timeout, a non-2xx answer, an
    ``"error"`` key in the body or a failed ``check`` is a failure of that engine."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def one(session: aiohttp.ClientSession, url: str) -> EngineAnswer:
        try:
            async with session.request(
                method, url + path, json=json_body, params=params, headers=headers, allow_redirects=False
            ) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            return EngineAnswer(url, False, None, f"{type(exc).__name__}: {exc}")
        try:
            body = json.loads(text) if text else None
        except ValueError:
            body = None
        if not 200 <= resp.status < 300:
            why = f"HTTP {resp.status}{hint(resp.status)}: {text[:300]}"
            return EngineAnswer(url, False, resp.status, why)
        if isinstance(body, dict) and "error" in body:
            return EngineAnswer(url, False, resp.status, f"engine error: {str(body['error'])[:300]}", body)
        why = check(body) if check is not None else None
        if why is not None:
            return EngineAnswer(url, False, resp.status, why, body)
        return EngineAnswer(url, True, resp.status, "", body)

    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(await asyncio.gather(*(one(session, u) for u in urls)))


# -- what each engine route must answer --------------------------------------------------------------
def expect(key: str, value: Any) -> Check:
    def check(body: Any) -> str | None:
        got = body.get(key) if isinstance(body, dict) else None
        return None if got == value else f"answered {key}={got!r}, expected {value!r}"

    return check


def has(key: str) -> Check:
    def check(body: Any) -> str | None:
        return None if isinstance(body, dict) and key in body else f"answer lacks {key!r}: {body!r}"[:300]

    return check


def checksum_digest(checksums: dict[str, str]) -> str:
    """One short digest of an engine's per-parameter checksums: equal digests, equal weights."""
    blob = json.dumps(checksums, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def compare_checksums(answers: list[EngineAnswer]) -> tuple[dict[str, Any], str]:
    """Group the engines by weights; returns (result, error). Engines that failed are not grouped."""
    groups: dict[str, list[str]] = {}
    tables: dict[str, dict[str, str]] = {}
    for a in answers:
        if a.ok and isinstance(a.body, dict):
            table = a.body.get("checksums") or {}
            digest = checksum_digest(table)
            groups.setdefault(digest, []).append(a.url)
            tables.setdefault(digest, table)
    result: dict[str, Any] = {"groups": groups, "parameters": len(next(iter(tables.values()), {}))}
    if len(groups) <= 1:
        return result, ""
    # Name the parameters that differ between the largest group and each other one.
    ranked = sorted(groups, key=lambda d: -len(groups[d]))
    base = tables[ranked[0]]
    differing: dict[str, list[str]] = {}
    for d in ranked[1:]:
        other = tables[d]
        differing[d] = sorted(k for k in base.keys() | other.keys() if base.get(k) != other.get(k))[:20]
    result["differing_parameters"] = differing
    minority = [u for d in ranked[1:] for u in groups[d]]
    return result, f"engines serve different weights: {len(groups)} checksum groups; odd ones: {minority}"
