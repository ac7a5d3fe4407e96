"""The one transaction core of the fleet's weight paths: a small step runner that the full refit, the
adapter refit and the restore each run as a list of steps.

Why one core: the fleet loads weights three ways (a full refit, ``router.fleet.refit``; an adapter's new
version, ``router.fleet.adapter_refit``; an engine brought back to the fleet's verified weights,
``router.fleet.restore``). Each was written by hand with its own record type, its own per-engine state,
its own step timer and its own deadline arithmetic, and only the restore retried (architecture review
2026-12-05, section 2): a fix to one had to be written again in the others, and their reports drifted
apart (two ``to_json``s, per-engine state kept two ways, two step timers). Here is what they share:

* **Per-engine state** (``EngineState``): ``pending -> loaded -> verified``, or ``quarantined`` with its
  reason (out of this transaction; what that means for routing is the transaction's business: the full
  refit holds the engine out of the fleet, an adapter refit only keeps the adapter off it).
* **One deadline** (``Txn.deadline_s``) that every step spends, a load all of it but the ``reserve`` the
  steps after it need, any other step at most ``STEP_TIMEOUT_S``, the end (resume) never cut by it.
* **The step runner** (``run_step``: one engine call fanned out under that budget, timed into the
  report; ``load_step``: the same for a load, settling each engine loaded or quarantined; ``Txn.timed``:
  a step of the router's own; ``run_steps``: a list of steps in order, stopping once the transaction
  ended).
* **Canary first** (``canary_step``: a load and its checks on one engine, before the rest; both refits).
* **A retry policy** (``RetryPolicy``: attempts and a growing pause; the restore's, the others try once).
* **One report shape** (``Txn.report``: id, phase, times, deadline, steps with their timings and
  failures, canary, per-engine states, verified, error, moved), which each transaction extends.

Also here, the full refit's checks of what an engine loaded (``load_and_verify``, the canary's test;
``verify`` with ``checksum_verdict``), and its record (``RefitTxn``, whose JSON ``GET /fleet/refit``
answers and ``rl-launch status`` shows).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

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


PENDING, LOADED, VERIFIED, QUARANTINED = "pending", "loaded", "verified", "quarantined"
ENDED = ("done", "failed", "expired", "aborted")
"""The phases a transaction ends in."""


@dataclass
class EngineState:
    """One engine's part: ``state`` moves pending -> loaded -> verified, or to quarantined (``reason``);
    ``touched``: it was sent weights (an engine touched and not verified must not serve them)."""

    url: str
    state: str = PENDING
    touched: bool = False
    reason: str = ""
    checksum: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "reason": self.reason, "checksum": self.checksum}


@dataclass(frozen=True)
class RetryPolicy:
    """How often a transaction is tried (``attempts``), with a pause after each failed one that starts
    at ``backoff_s`` and grows by ``factor``."""

    attempts: int = 1
    backoff_s: float = 0.0
    factor: float = 2.0

    async def run(self, attempt: Callable[[int], Awaitable[bool]]) -> bool:
        """``attempt(n)`` for n = 1, 2, ... until one returns True (then True) or none is left (False)."""
        pause = self.backoff_s
        for n in range(1, self.attempts + 1):
            if await attempt(n):
                return True
            if n < self.attempts:
                await asyncio.sleep(pause)
                pause *= self.factor
        return False


@dataclass(kw_only=True)
class Txn:
    """One transaction's record: its engines' parts, its one deadline, its steps as they ran."""

    KIND: ClassVar[str] = "transaction"
    """What the reports call it (``the refit's deadline passed``)."""
    id: str
    deadline_s: float
    phase: str = PENDING
    started_at: float = field(default_factory=time.time)
    ended_at: float | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    engines: dict[str, EngineState] = field(default_factory=dict)
    canary: str | None = None
    """The engine loaded first (``None``: no canary, or not yet)."""
    error: str = ""
    moved: bool = False
    """True once the transaction's new weights serve (some engine verified and stamped)."""
    _t0: float = field(default_factory=time.monotonic, repr=False)

    @property
    def deadline(self) -> float:
        return self._t0 + self.deadline_s

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    @property
    def reserve(self) -> float:
        """The part of the deadline a load leaves to the steps after it (none here)."""
        return 0.0

    @property
    def ended(self) -> bool:
        return self.phase in ENDED

    def enlist(self, urls: list[str], touched: bool = False) -> None:
        """The transaction's engines, each pending."""
        self.engines = {u: EngineState(u, touched=touched) for u in urls}

    def live(self) -> list[str]:
        """Engines still in the transaction (not quarantined)."""
        return [u for u, e in self.engines.items() if e.state != QUARANTINED]

    def verified(self) -> list[str]:
        return [u for u, e in self.engines.items() if e.state == VERIFIED]

    def quarantine(self, url: str, reason: str) -> None:
        e = self.engines[url]
        if e.state != QUARANTINED:
            e.state, e.reason = QUARANTINED, reason

    def add_step(
        self, phase: str, since: float, engines: int = 0, failed: dict[str, str] | None = None
    ) -> None:
        """Time a step into the report: it began at ``since`` (``time.monotonic``)."""
        self.steps.append(
            {
                "phase": phase,
                "took_s": round(time.monotonic() - since, 4),
                "engines": engines,
                "failed": dict(failed or {}),
            }
        )

    @contextmanager
    def timed(self, phase: str, engines: int = 0) -> Iterator[dict[str, str]]:
        """``with txn.timed(phase) as failed:`` one step of the router's own, timed into the report
        whatever happens; what the body puts in ``failed`` (``{url: why}``) is reported with it."""
        self.phase = phase
        t0, failed = time.monotonic(), dict[str, str]()
        try:
            yield failed
        finally:
            self.add_step(phase, t0, engines, failed)

    def report(self) -> dict[str, Any]:
        """The fields every transaction reports (each extends them)."""
        return {
            "id": self.id,
            "phase": self.phase,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "elapsed_s": round((self.ended_at or time.time()) - self.started_at, 4),
            "deadline_s": self.deadline_s,
            "steps": list(self.steps),
            "canary": self.canary,
            "engines": {u: e.to_json() for u, e in self.engines.items()},
            "verified": self.verified(),
            "error": self.error,
            "moved": self.moved,
        }


@dataclass(kw_only=True)
class RefitTxn(Txn):
    """One full refit towards ``version``: the core's record plus its source, lease and checksums."""

    KIND: ClassVar[str] = "refit"
    version: str
    source: str
    mode: str
    lease_s: float
    phase: str = "pausing"
    path: str | None = None
    expected_checksum: str | None = None
    records: dict[str, DirectoryRecord] = field(default_factory=dict, repr=False)
    """What the check before the pause read of each directory (``from`` and ``from_by_engine``'s)."""
    paths: dict[str, str] = field(default_factory=dict, repr=False)
    """Each engine's own directory (``from_by_engine``); the others read ``path``."""
    uncovered: list[str] = field(default_factory=list)
    """Parameters an engine's checksum could not see (vLLM's ``/weight_checker`` fallback on an engine
    without the launcher's worker extension: ``router.fleet.weight_checksums``)."""
    previous_version: str | None = None
    previous_checksum: str | None = None
    checksum: str | None = None
    router_holding: bool = True
    """False where the front holds no request during the pause (vllm-router: the engines hold them)."""
    holder: str | None = None
    """The consumer whose key began it (``router.http.auth.holder_of``); None: the fleet's owner. Revoking
    that key ends the transaction (``abort_if_held_by``, from ``router.fleet.revocation``)."""
    released: dict[str, Any] = field(default_factory=dict)
    """What the router held during the pause: ``released`` requests and their ``longest_wait_s``."""
    _lease_until: float = 0.0

    @property
    def reserve(self) -> float:
        return min(RESERVE_MAX_S, self.deadline_s * RESERVE_FRACTION)

    def hold_lease(self) -> None:
        """While the router itself works on a step the lease cannot run out (the deadline still bounds)."""
        self._lease_until = self.deadline

    def renew_lease(self) -> None:
        """The lease runs ``lease_s`` from now (never past the deadline): the trainer is still there."""
        self._lease_until = min(self.deadline, time.monotonic() + self.lease_s)

    def to_json(self) -> dict[str, Any]:
        quarantined = {u: e.reason for u, e in self.engines.items() if e.state == QUARANTINED}
        return {
            **self.report(),
            "version": self.version,
            "source": self.source,
            "path": self.path,
            "mode": self.mode,
            "lease_s": self.lease_s,
            "lease_left_s": round(max(0.0, self._lease_until - time.monotonic()), 3) if not self.ended else 0,
            "quarantined": quarantined,
            "previous_version": self.previous_version,
            "checksum": self.checksum,
            "previous_checksum": self.previous_checksum,
            "expected_checksum": self.expected_checksum,
            "uncovered_parameters": self.uncovered,
            "held": self.released,
            "router_holding": self.router_holding,
            "holder": self.holder,
            "ok": self.moved and not quarantined,
        }


async def run_step(
    fleet: Fleet,
    txn: Txn,
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
    kind = txn.KIND
    with txn.timed(phase, len(urls)) as failed:
        left: float | None
        if bound == "end":
            left = None
        elif bound == "load":
            left = txn.remaining() - txn.reserve
        else:
            left = min(txn.remaining(), STEP_TIMEOUT_S)
        if left is not None and left <= 0:
            report = FleetOpReport(
                op, [EngineAnswer(u, False, None, f"the {kind}'s deadline passed") for u in urls]
            )
        elif not urls:
            report = FleetOpReport(op, error=f"no engine left in the {kind}")
        else:
            report = await fleet.fan(op, urls, call, left)
            for a in report.engines:
                if not a.ok and a.status is None and "Timeout" in a.detail:
                    a.detail = f"missed the {kind}'s deadline ({txn.deadline_s:g} s): {a.detail}"
        failed.update({a.url: a.detail for a in report.failures()})
    return report


async def run_one(
    fleet: Fleet, txn: Txn, phase: str, op: str, url: str, call: EngineCall, bound: str = "step"
) -> EngineAnswer:
    """``run_step`` on one engine: its answer."""
    return (await run_step(fleet, txn, phase, op, [url], call, bound)).engines[0]


async def load_step(
    fleet: Fleet,
    txn: Txn,
    phase: str,
    op: str,
    urls: list[str],
    call: EngineCall,
    passed: str = LOADED,
    why: Callable[[EngineAnswer], str] = lambda a: a.detail,
) -> FleetOpReport:
    """A load (``run_step`` bounded as one) on ``urls``, each touched: an engine that answered is
    ``passed`` (loaded; verified where ``call`` verified it too), the others quarantined with ``why``."""
    for u in urls:
        txn.engines[u].touched = True
    report = await run_step(fleet, txn, phase, op, urls, call, bound="load")
    for a in report.engines:
        if a.ok:
            txn.engines[a.url].state = passed
        else:
            txn.quarantine(a.url, why(a))
    return report


async def canary_step(
    fleet: Fleet,
    txn: Txn,
    url: str,
    call: EngineCall,
    passed: str = LOADED,
    why: Callable[[EngineAnswer], str] = lambda a: a.detail,
) -> str | None:
    """Canary first: ``call`` (a load and its checks) on ``url`` alone, as the step ``canary``; ``None``
    when it passed, else why not (it is then quarantined, and the caller touches no other engine)."""
    txn.canary = url
    await load_step(fleet, txn, "canary", "canary", [url], call, passed, why)
    e = txn.engines[url]
    return e.reason if e.state == QUARANTINED else None


async def run_steps(txn: Txn, steps: Sequence[Callable[[], Awaitable[Any]]]) -> None:
    """A transaction's steps in order, stopping once it ended (a step may end it: a failed canary)."""
    for step in steps:
        if txn.ended:
            return
        await step()


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
