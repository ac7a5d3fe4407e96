"""The refit transaction's record and the parts of it every weight path needs: per-engine state, the
deadline's budget and the lease, the timed step runner, the load-and-verify of one engine (the canary's
test), and the verify step with its checksum verdict.

Why this is apart from ``router.fleet.refit``: that module decides *which* steps a full refit runs and in
what order (pause, canary, load or receive, verify, reset, stamp, end) and keeps the fleet's side of it
(the pause gate, the lease's watchdog, the version stamp, where the current weights are on disk). This one
holds what a transaction needs whatever its steps are: an engine's state (pending -> loaded -> verified, or
quarantined with its reason), one deadline a load may spend but for the reserve the steps after it need,
each step fanned out under that budget and timed into the report, and the checks that turn what engines
loaded into verified and quarantined ones. Those are the parts the adapter refit
(``router.fleet.adapter_refit``: ``AdapterTxn``, ``_timed``, ``_load_one``) and the restore
(``router.fleet.restore``) still write again for themselves (architecture review 2026-12-05, section 2);
today only the full refit runs on this module, and the shared transaction core is meant to grow here
rather than beside it.

This module owns the transaction's JSON (``RefitTxn.to_json``: what ``GET /fleet/refit`` answers and
``rl-launch status`` shows while a refit runs).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from router.fleet.engine import EngineAnswer, EngineClient
from router.fleet.fleet import EngineCall, Fleet
from router.fleet.ops import FleetOpReport, checksum_digest, compare_checksums
from router.fleet.tensor_manifest import DirectoryRecord

log = logging.getLogger(__name__)

SOURCES = ("directory", "stream", "external")
"""Where the weights come from: a checkpoint directory the router loads; a stream from the trainer
(vLLM's weight-transfer API, ``update_weights`` through the router); or the trainer's own means (the
router cannot tell which engines were touched, so every engine counts as touched)."""
DEFAULT_LEASE_S = 30.0
DEFAULT_DEADLINE_S = 900.0
RESERVE_FRACTION = 0.1
RESERVE_MAX_S = 30.0
"""The part of the deadline a load or receive step leaves to verify, reset, stamp and resume (a tenth, at
most 30 s): an engine that is still loading when the deadline nears is cut off, and the engines that made
it still move to the new version instead of missing the deadline together."""
STEP_TIMEOUT_S = 120.0
"""The most one engine may take over a step other than the load (pause, checksum, reset, stamp): one that
hangs there must not eat the reserve the steps after it need."""


@dataclass
class EngineRefit:
    """One engine's part: ``state`` moves pending -> loaded -> verified, or to quarantined (``reason``)."""

    url: str
    state: str = "pending"
    touched: bool = False
    reason: str = ""
    checksum: str | None = None


@dataclass
class RefitTxn:
    """One transaction towards ``version``: its engines' parts, its deadline and lease, its steps as run."""

    id: str
    version: str
    source: str
    mode: str
    deadline_s: float
    lease_s: float
    path: str | None = None
    expected_checksum: str | None = None
    records: dict[str, DirectoryRecord] = field(default_factory=dict, repr=False)
    """What the check before the pause read of each directory (``from`` and ``from_by_engine``'s)."""
    paths: dict[str, str] = field(default_factory=dict, repr=False)
    """Each engine's own directory (``from_by_engine``); the others read ``path``."""
    uncovered: list[str] = field(default_factory=list)
    """Parameters an engine's checksum could not see (vLLM's ``/weight_checker`` fallback on an engine
    without the launcher's worker extension: ``router.fleet.weight_checksums``)."""
    phase: str = "pausing"
    started_at: float = field(default_factory=time.time)
    ended_at: float | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    engines: dict[str, EngineRefit] = field(default_factory=dict)
    canary: str | None = None
    """The engine a directory was loaded into first (``None``: no directory load, or not yet)."""
    previous_version: str | None = None
    previous_checksum: str | None = None
    checksum: str | None = None
    error: str = ""
    moved: bool = False
    """True once the fleet's version is ``version`` (some engine verified and stamped)."""
    router_holding: bool = True
    """False where the front holds no request during the pause (vllm-router: the engines hold them)."""
    holder: str | None = None
    """The consumer whose key began it (``router.http.auth.holder_of``); None: the fleet's owner. Revoking
    that key ends the transaction (``abort_if_held_by``, from ``router.fleet.revocation``)."""
    released: dict[str, Any] = field(default_factory=dict)
    """What the router held during the pause: ``released`` requests and their ``longest_wait_s``."""
    _t0: float = field(default_factory=time.monotonic, repr=False)
    _lease_until: float = 0.0

    @property
    def deadline(self) -> float:
        return self._t0 + self.deadline_s

    @property
    def ended(self) -> bool:
        return self.phase in ("done", "failed", "expired", "aborted")

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    @property
    def reserve(self) -> float:
        return min(RESERVE_MAX_S, self.deadline_s * RESERVE_FRACTION)

    def hold_lease(self) -> None:
        """While the router itself works on a step the lease cannot run out (the deadline still bounds)."""
        self._lease_until = self.deadline

    def renew_lease(self) -> None:
        """The lease runs ``lease_s`` from now (never past the deadline): the trainer is still there."""
        self._lease_until = min(self.deadline, time.monotonic() + self.lease_s)

    def live(self) -> list[str]:
        """Engines still in the transaction (not quarantined)."""
        return [u for u, e in self.engines.items() if e.state != "quarantined"]

    def quarantine(self, url: str, reason: str) -> None:
        e = self.engines[url]
        if e.state != "quarantined":
            e.state, e.reason = "quarantined", reason

    def to_json(self) -> dict[str, Any]:
        quarantined = {u: e.reason for u, e in self.engines.items() if e.state == "quarantined"}
        return {
            "id": self.id,
            "version": self.version,
            "source": self.source,
            "path": self.path,
            "mode": self.mode,
            "phase": self.phase,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "elapsed_s": round((self.ended_at or time.time()) - self.started_at, 4),
            "deadline_s": self.deadline_s,
            "lease_s": self.lease_s,
            "lease_left_s": round(max(0.0, self._lease_until - time.monotonic()), 3) if not self.ended else 0,
            "steps": list(self.steps),
            "canary": self.canary,
            "engines": {
                u: {"state": e.state, "reason": e.reason, "checksum": e.checksum}
                for u, e in self.engines.items()
            },
            "verified": [u for u, e in self.engines.items() if e.state == "verified"],
            "quarantined": quarantined,
            "previous_version": self.previous_version,
            "checksum": self.checksum,
            "previous_checksum": self.previous_checksum,
            "expected_checksum": self.expected_checksum,
            "uncovered_parameters": self.uncovered,
            "error": self.error,
            "moved": self.moved,
            "held": self.released,
            "router_holding": self.router_holding,
            "holder": self.holder,
            "ok": self.moved and not quarantined,
        }


async def run_step(
    fleet: Fleet,
    txn: RefitTxn,
    phase: str,
    op: str,
    urls: list[str],
    call: EngineCall,
    bound: str = "step",
) -> FleetOpReport:
    """Run one step of ``txn`` (its ``phase``, the engine ``op``) on ``urls``, timed into ``txn.steps``.
    ``bound``: ``"load"``, a step that may take minutes, gets what the deadline leaves but the
    reserve; ``"step"`` that too, at most ``STEP_TIMEOUT_S``; ``"end"`` (abort, resume) is never cut by
    the deadline: a transaction that ran out of time must still resume every engine."""
    txn.phase = phase
    t0 = time.monotonic()
    left: float | None
    if bound == "end":
        left = None
    elif bound == "load":
        left = txn.remaining() - txn.reserve
    else:
        left = min(txn.remaining(), STEP_TIMEOUT_S)
    if left is not None and left <= 0:
        report = FleetOpReport(
            op, [EngineAnswer(u, False, None, "the refit's deadline passed") for u in urls]
        )
    elif not urls:
        report = FleetOpReport(op, error="no engine left in the refit")
    else:
        report = await fleet.fan(op, urls, call, left)
        for a in report.engines:
            if not a.ok and a.status is None and "Timeout" in a.detail:
                a.detail = f"missed the refit's deadline ({txn.deadline_s:g} s): {a.detail}"
    txn.steps.append(
        {
            "phase": phase,
            "took_s": round(time.monotonic() - t0, 4),
            "engines": len(urls),
            "failed": {a.url: a.detail for a in report.failures()},
        }
    )
    return report


def checksum_verdict(txn: RefitTxn, report: FleetOpReport) -> None:
    """Settle the verify step from its ``checksum`` report: an engine whose checksum is unreadable, or
    differs from the expected one (or, with none expected, from the majority's), is quarantined; the rest
    are verified, and ``txn.checksum`` is the one they hold (``None``, with ``txn.error`` saying why, when
    no checksum wins: nothing is verified rather than a tie broken by chance)."""
    for a in report.failures():
        txn.quarantine(a.url, f"checksum unreadable: {a.detail}")
    txn.uncovered = sorted({n for a in report.engines if a.ok for n in (a.body or {}).get("uncovered") or []})
    if txn.uncovered:
        log.warning(
            "refit %s: the engines' checksums cannot see %d parameters (hashed as zero bytes: an "
            "engine without the launcher's worker extension, or weights held where it cannot read): %s",
            txn.id,
            len(txn.uncovered),
            txn.uncovered[:8],
        )
    groups: dict[str, list[str]] = compare_checksums(report.engines)[0]["groups"]
    for digest, members in groups.items():
        for u in members:
            txn.engines[u].checksum = digest
    winner: str | None = None
    if txn.expected_checksum is not None:
        winner = txn.expected_checksum if txn.expected_checksum in groups else None
        why = f"expected checksum {txn.expected_checksum}"
    elif groups:
        ranked = sorted(groups.values(), key=len, reverse=True)
        if len(ranked) == 1 or len(ranked[0]) > len(ranked[1]):
            winner = next(d for d, us in groups.items() if us is ranked[0])
        why = "no checksum held by a majority of the engines; pass expected_checksum to decide"
    for digest, members in groups.items():
        if digest != winner:
            for u in members:
                reason = why if winner is None else f"checksum {digest} differs from the fleet's {winner}"
                txn.quarantine(u, reason)
    for u in txn.live():
        txn.engines[u].state = "verified"
    txn.checksum = winner
    if winner is None and not txn.error:
        txn.error = f"no engine verified: {why}" if groups else "no engine verified"


async def load_and_verify(txn: RefitTxn, e: EngineClient, u: str, path: str) -> EngineAnswer:
    """Reload engine ``u`` from ``path``, then check what it holds: a readable checksum (vLLM's read fails
    while the weights are detached), equal to ``txn.expected_checksum`` when the trainer gave it, and a
    ``/health`` that answers. The canary's test: a checkpoint that passed the check before the pause can
    still fail in the engine's loader, and must fail on one engine, not on every engine at once."""
    expected = txn.expected_checksum
    loaded = await e.reload_weights(u, path)
    if not loaded.ok:
        return EngineAnswer(u, False, loaded.status, f"reload from {path} failed: {loaded.detail}")
    read = await e.checksum(u)
    if not read.ok:
        return EngineAnswer(u, False, read.status, f"checksum unreadable after the load: {read.detail}")
    digest = checksum_digest(read.body.get("checksums") or {})
    txn.engines[u].checksum = digest
    if expected is not None and digest != expected:
        return EngineAnswer(u, False, read.status, f"checksum {digest} differs from the expected {expected}")
    health = await e.health(u)
    if not health.ok:
        return EngineAnswer(u, False, None, f"/health failed after the load: {health.detail}")
    return EngineAnswer(u, True, read.status, "", {"checksum": digest})


async def quarantine_changed(txn: RefitTxn) -> None:
    """Read each checked directory again: an engine that loaded from one whose files changed since
    the check (written during the refit: what it loaded is not what was checked, and may differ from
    what its neighbours loaded) is quarantined, naming the files."""
    for where, record in txn.records.items():
        try:
            now = await asyncio.wait_for(asyncio.to_thread(record.again), STEP_TIMEOUT_S)
            changes = record.changes(now)
        except (ValueError, OSError, TimeoutError) as exc:
            changes = [f"not readable again ({exc or type(exc).__name__})"]
        if not changes:
            continue
        why = f"checkpoint {where} changed while the refit loaded it: {'; '.join(changes)}"
        for u in txn.live():
            if txn.paths.get(u, txn.path) == where:
                txn.quarantine(u, why)


async def verify(fleet: Fleet, txn: RefitTxn) -> None:
    """The verify step: an engine that received no weights is quarantined, so is one whose checked
    directory changed under it (``quarantine_changed``); the rest are read and judged by their checksums
    (``checksum_verdict``)."""
    urls = [u for u in txn.live() if txn.engines[u].state == "loaded" or txn.source == "external"]
    for u in txn.live():
        if u not in urls:
            txn.quarantine(u, "received no weights in this refit")
    if txn.records:
        await quarantine_changed(txn)
        urls = [u for u in urls if u in txn.live()]
    report = await run_step(fleet, txn, "verifying", "checksum", urls, lambda e, u: e.checksum(u))
    checksum_verdict(txn, report)
