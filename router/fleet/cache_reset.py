"""Fleet-wide prefix-cache invalidation: one POST per serving engine, one report of who complied.

After a weight update every engine's prefix (KV) cache holds blocks computed with the old weights; a hit
on them silently mixes policies. The trainer therefore flushes the whole fleet at once, and a single
engine that did not comply must fail the call loudly (a partial flush looks like success otherwise).

The report's shape is owned here: the router's admin route (``POST /fleet/reset_prefix_cache``) answers
with it, ``rl-launch fleet reset-cache`` prints it and the job directory records it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from router.fleet.ops import fan_out


@dataclass
class EngineReset:
    url: str
    ok: bool
    status: int | None
    detail: str = ""


@dataclass
class CacheResetReport:
    engines: list[EngineReset] = field(default_factory=list)
    router_entries_dropped: int | None = None
    """The router's prefix-index entries forgotten (``None``: not our router)."""
    at: float = field(default_factory=time.time)

    @property
    def ok(self) -> bool:
        return bool(self.engines) and all(e.ok for e in self.engines)

    def failures(self) -> list[EngineReset]:
        return [e for e in self.engines if not e.ok]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CacheResetReport:
        return cls(
            engines=[EngineReset(**e) for e in data.get("engines", [])],
            router_entries_dropped=data.get("router_entries_dropped"),
            at=float(data.get("at", 0.0)),
        )


async def reset_engines(
    urls: Sequence[str], path: str, api_key: str | None = None, timeout_s: float = 30.0
) -> list[EngineReset]:
    """POST ``path`` (the engine kind's route: ``router.fleet.engine.VLLM_RESET_PATH`` or
    ``DYNAMO_RESET_PATH``) on every engine at once; an error, a timeout or a non-2xx answer is a failure.
    Sent through ``router.fleet.ops.fan_out``, the one fan-out every fleet operation uses."""
    answers = await fan_out(urls, lambda e, u: e.reset_cache(u, path), api_key=api_key, timeout_s=timeout_s)
    return [EngineReset(a.url, a.ok, a.status, _said(a.body) if a.ok else a.detail) for a in answers]


def _said(body: object) -> str:
    return json.dumps(body)[:300] if body is not None else ""
