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
``fan_out`` here. What one engine call is and how its answer is judged belongs to ``router.fleet.engine``.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from router.fleet.engine import EngineAnswer, EngineClient

T = TypeVar("T")


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


async def fan_out(
    urls: Sequence[str],
    call: Callable[[EngineClient, str], Awaitable[T]],
    *,
    api_key: str | None = None,
    timeout_s: float = 60.0,
) -> list[T]:
    """``call(engines, url)`` on every engine at once, over one session of its own; answers in ``urls``'
    order. Each call is judged by ``router.fleet.engine`` (an error, a timeout, a non-2xx answer, an
    ``"error"`` in the body or an answer that does not say what was asked fails that engine)."""
    async with EngineClient.open(api_key, timeout_s) as engines:
        return await engines.each(urls, call)


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
