"""The refit transaction: new weights into every engine, verified, stamped and resumed as one unit.

What it prevents, each a failure users of RL stacks report: a failed sync that leaves the fleet paused
with some engines updated and some not; an engine serving new weights under the old version (or the
reverse, the stamp racing the load); a trainer that dies mid-refit and leaves every rollout hanging; an
engine that missed the update serving again after resume. So one transaction runs, under one deadline:

    pause (keep) -> load (from a directory: one canary engine first, then the rest) or receive (streamed
    by the trainer) -> verify (the directory's files as checked; every engine's checksum of every weight
    it computes with, ``router.fleet.weight_checksums``, equal, and equal to the trainer's expected one
    when given) -> reset prefix caches -> stamp the version -> resume

* An engine that fails any step, or misses the deadline, is **quarantined**: held out of routing as
  STALE with the reason (the same hold-out ``router.fleet.api`` keeps for restarted engines, so every
  front that reads the stale list drops it), its in-flight requests aborted (they would finish on weights
  nobody verified), and named in the report. The others resume on the new version.
* **A directory is tried on one engine first** (the *canary*: a serving engine reading the shared
  ``from`` directory, the one with the fewest requests in flight). A checkpoint that passed the check
  before the pause can still fail in the engine's loader, and on vLLM 0.32 a failed ``reload_weights``
  leaves the engine without weights: loaded into every engine at once, one such checkpoint empties the
  fleet. The canary must answer its reload, then show a readable checksum (vLLM's read fails while the
  weights are detached: "Cannot copy out of meta tensor"), equal to ``expected_checksum`` when the
  trainer gave it, and answer ``/health``. No generation is sent: the engine is paused for the window,
  and on detached weights a generation step kills vLLM's engine core. A canary that fails is
  quarantined and the transaction ends there (``failed``): no other engine was touched, and they resume
  on the fleet's current version. Streamed (``stream``) and ``external`` weights have no canary: a
  stream is one collective every engine of the group joins at once, and external weights are sent by
  the trainer, not the router.
* **The fleet remembers where its current weights are on disk** (``WeightSource``: after a directory
  refit that moved it, that version, directory and checksum; a streamed or external refit clears it,
  since those weights are on no disk the router knows). ``router.fleet.restore`` reloads from it every
  engine held out without the current weights (``on_held_out``, and the fleet API on a joining engine),
  between transactions (``between_refits``).
* **The pause is a lease** the router holds. A trainer-driven transaction (``begin`` ... ``commit``)
  renews it; if the trainer dies or stops renewing, the router ends the transaction itself when the lease
  runs out: the engines the transaction touched (sent weights to) and did not verify stay out, the
  untouched ones resume on the old version, and held requests are released (when no engine is left
  serving, once the restore has brought one back on the old version). A directory load run by
  the router alone holds the lease itself and is bounded by the deadline only.
* Steps run as tasks of the router's own, shielded from the HTTP handler: a trainer that disconnects
  mid-call does not cancel a load half-way.

Its steps, over the transaction core's runner: ``begin`` [pausing] -> ``load`` [canary, loading] or
``receive`` [receiving] -> ``commit`` [verifying, resetting, stamping] -> the end [resuming]. This module
runs the steps in their order and keeps the fleet's side (the gate, the lease, the stamp, the
weights' source); the transaction's record (its JSON: ``GET /fleet/refit``), the step runner and the checks
of what an engine loaded are ``router.fleet.txn``'s, the part every weight path needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from router.fleet.engine import EngineAnswer, EngineClient
from router.fleet.fleet import Fleet
from router.fleet.tensor_manifest import DirectoryRecord
from router.fleet.txn import (
    DEFAULT_DEADLINE_S,
    DEFAULT_LEASE_S,
    LOADED,
    RefitTxn,
    canary_step,
    load_and_verify,
    load_step,
    run_step,
    run_steps,
    verify,
)
from router.fleet.txn import SOURCES as SOURCES  # the routes import it from here
from router.state.pause_gate import PauseGate

log = logging.getLogger(__name__)

RESTORE_HOLD_S = 120.0
"""How long the requests a pause held wait for a restored engine when the transaction ended with none
serving (``_end``); past it they are released and answered as a fleet with no healthy backend is."""


class RefitRefused(ValueError):
    """A transaction request refused before anything was paused or sent (the HTTP answer is 400/409)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class WeightSource:
    """Where the fleet's current weights are on disk, as verified: the directory a refit loaded into
    engines whose checksums then agreed (``checksum``), under the version it stamped (``version``;
    ``None`` for the directory the engines were started from, before any stamp). What
    ``router.fleet.restore`` reloads an engine from."""

    version: str | None
    path: str
    checksum: str | None
    """``None`` only for the start directory when no serving engine could be read."""
    started_from: bool = False
    """The directory the engines were started from (the job's own choice), not a refit's."""
    record: DirectoryRecord | None = None
    """Its weight files as the refit checked them and found them again after the load
    (``router.fleet.tensor_manifest``): a restore refuses files that changed since."""


class RefitCoordinator:
    """Runs at most one transaction at a time for one fleet (the router's, or the fleet endpoint's)."""

    def __init__(self, fleet: Fleet, gate: PauseGate, holds_requests: bool = True) -> None:
        """``fleet``: its engines (serving and stale) are the transaction's, its ``current_version`` is
        the version before it and becomes the new one when the transaction moves the fleet."""
        self.fleet = fleet
        self.backends = fleet.backends
        self.gate = gate
        self.holds_requests = holds_requests
        self.active: RefitTxn | None = None
        self.last: RefitTxn | None = None
        self.source: WeightSource | None = None
        """The last verified directory of the fleet's current weights (``None``: none known)."""
        self.source_set = False
        """True once a refit moved the fleet: ``source`` is then the whole truth (a ``None`` there means
        the weights came by stream or by the trainer's means), and the start directory no longer is."""
        self.on_held_out: Callable[[list[str]], None] | None = None
        """Called with the engines a transaction held out, once it ended (``router.fleet.restore``)."""
        self.restores_pending: Callable[[], bool] = lambda: False
        """Whether a restore ``on_held_out`` started still runs (``router.fleet.restore``)."""
        self._lock = asyncio.Lock()
        self._idle = asyncio.Event()
        self._idle.set()
        self._watchdog: asyncio.Task[None] | None = None
        self._restoring: asyncio.Task[None] | None = None
        """The gate's deferred release after a transaction that left no engine serving (``_end``)."""
        self._running: set[asyncio.Task[Any]] = set()

    # -- the public steps (each shielded from its caller's cancellation) -------------------------------
    async def run(self, coro: Awaitable[Any]) -> Any:
        """Run one step as a task of the coordinator's: a caller that goes away does not cancel it."""
        task = asyncio.ensure_future(coro)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return await asyncio.shield(task)

    def between_refits(self) -> _BetweenRefits:
        """``async with``: hold the coordinator's lock at a moment no transaction is active. A restore of
        one engine must not reload it while a transaction pauses, loads or stamps it; a transaction that
        begins meanwhile waits for the lock (a restore is bounded by its own timeouts)."""
        return _BetweenRefits(self)

    def find(self, txn_id: str | None) -> RefitTxn:
        txn = self.active
        if txn is None or txn.ended:
            last = self.last
            if last is not None and txn_id == last.id:
                raise RefitRefused(f"refit {last.id} already ended ({last.phase}): {last.error}", 409)
            raise RefitRefused("no refit in progress", 409)
        if txn_id is not None and txn_id != txn.id:
            raise RefitRefused(f"refit {txn_id} is not the one in progress ({txn.id})", 409)
        return txn

    def busy(self) -> str | None:
        """Why a plain pause/resume/stamp must wait (a transaction owns the fleet), or None."""
        txn = self.active
        if (txn is None or txn.ended) and self._restoring is not None and self.last is not None:
            return (
                f"refit {self.last.id} ended ({self.last.phase}) with every engine holding unverified "
                "weights: they are being restored, and the requests held since its pause wait for them"
            )
        if txn is None or txn.ended:
            return None
        return (
            f"refit {txn.id} to {txn.version!r} is in progress ({txn.phase}); it owns pause, resume "
            "and stamps"
        )

    async def begin(
        self,
        version: str,
        source: str,
        mode: str = "keep",
        lease_s: float = DEFAULT_LEASE_S,
        deadline_s: float = DEFAULT_DEADLINE_S,
        path: str | None = None,
        held_by_router: bool = False,
        holder: str | None = None,
    ) -> RefitTxn:
        """Pause the fleet for a transaction towards ``version``. Refused (nothing paused) when another
        runs or no engine is in the fleet. ``held_by_router``: the router itself runs every step (a
        directory load in one call), so no trainer renews the lease: only the deadline bounds it."""
        async with self._lock:
            reason = self.busy()
            if reason is not None:
                raise RefitRefused(reason, 409)
            targets = self.fleet.all_engines()
            if not targets:
                raise RefitRefused("no engine is in the fleet: nothing to refit", 409)
            txn = RefitTxn(
                id=secrets.token_hex(6),
                version=version,
                source=source,
                mode=mode,
                deadline_s=deadline_s,
                lease_s=deadline_s if held_by_router else lease_s,
                path=path,
                previous_version=self.fleet.current_version,
                previous_checksum=self.last.checksum if self.last is not None else None,
                router_holding=self.holds_requests,
                holder=holder,
            )
            txn.enlist(targets, touched=source == "external")
            txn._lease_until = time.monotonic() + txn.lease_s
            self.active = txn
            self._idle.clear()
            self.backends.versions.announce(version)
            self.gate.close(mode)
            report = await run_step(
                self.fleet, txn, "pausing", "pause", txn.live(), lambda e, u: e.pause(u, mode)
            )
            for a in report.failures():
                txn.quarantine(a.url, f"did not pause: {a.detail}")
            txn.phase = "paused"
            if not held_by_router:  # the router's own run ends the transaction itself, within its steps
                self._watchdog = asyncio.get_running_loop().create_task(self._watch(txn))
            log.info("refit %s to %r begun (%s, %d engines)", txn.id, version, source, len(targets))
            return txn

    def renew(self, txn_id: str) -> RefitTxn:
        txn = self.find(txn_id)
        txn.renew_lease()
        return txn

    async def load(
        self,
        txn_id: str,
        path: str,
        per_engine: dict[str, str] | None = None,
        expected_checksum: str | None = None,
        records: dict[str, DirectoryRecord] | None = None,
    ) -> RefitTxn:
        """Every engine still in the transaction reloads its weights from ``path`` (checked by the caller
        before the pause: ``records``, what the check read of each directory, is read again before the
        verify), or from its own entry of ``per_engine`` (a node-local copy), each bounded by
        what is left of the deadline. For a ``directory`` transaction one canary engine loads first and
        is verified (``expected_checksum`` too, when given); if it fails, it is quarantined and the
        transaction ends here, the others untouched (``txn.ended``: there is nothing to commit)."""
        paths = per_engine or {}
        async with self._lock:
            txn = self.find(txn_id)
            txn.path = path
            txn.records, txn.paths = dict(records or {}), dict(paths)
            if expected_checksum is not None:
                txn.expected_checksum = expected_checksum
            txn.hold_lease()
            urls = txn.live()
            if txn.source == "directory" and urls:
                canary = self._pick_canary(urls, path, paths)
                at = paths.get(canary, path)
                why = await canary_step(
                    self.fleet,
                    txn,
                    canary,
                    lambda e, u: load_and_verify(txn, e, u, at),
                    why=lambda a: f"canary: {a.detail}",
                )
                if why is not None:
                    txn.error = (
                        f"the canary {canary} failed, so no other engine was touched and the fleet stays on "
                        f"{txn.previous_version!r}: {why}"
                    )
                    await self._end(txn, "failed")
                    return txn
                urls = [u for u in urls if u != canary]
            if urls:
                await load_step(
                    self.fleet,
                    txn,
                    "loading",
                    "reload_weights",
                    urls,
                    lambda e, u: e.reload_weights(u, paths.get(u, path)),
                    why=lambda a: f"reload from {paths.get(a.url, path)} failed: {a.detail}",
                )
            txn.renew_lease()
            return txn

    def _pick_canary(self, urls: list[str], path: str, paths: dict[str, str]) -> str:
        """A serving engine that reads the shared ``path`` (the directory the router checked), the one
        with the fewest requests in flight (in keep mode they are frozen on it, and a failed canary's are
        aborted); else a stale one reading ``path``; else any. A stale engine may be broken for reasons
        of its own, and a node-local copy is not the checkpoint the others read."""
        serving = set(self.backends.serving)
        in_flight = self.backends.load.in_flight

        def rank(u: str) -> tuple[int, int, int]:
            return (u in paths and paths[u] != path, u not in serving, in_flight(u) if u in serving else 0)

        return min(urls, key=rank)

    async def receive(self, txn_id: str, update_info: dict[str, Any], group: set[str]) -> RefitTxn:
        """One streamed round (vLLM's weight transfer): each engine of the trainer's ``group`` starts an
        update, receives the round the trainer broadcasts meanwhile, and finishes it. An engine outside
        the group (it joined the fleet after the group formed) is quarantined without a call: on vLLM a
        weight update without a transfer group fails in the worker and leaves the engine without weights."""
        async with self._lock:
            txn = self.find(txn_id)
            txn.hold_lease()
            for u in txn.live():
                if u not in group:
                    txn.quarantine(u, "not in the trainer's weight-transfer group (joined after it formed)")

            async def one(e: EngineClient, u: str) -> EngineAnswer:
                for call in (
                    lambda: e.start_weight_update(u),
                    lambda: e.update_weights(u, update_info),
                    lambda: e.finish_weight_update(u),
                ):
                    a = await call()
                    if not a.ok:
                        return a
                return a

            await load_step(
                self.fleet,
                txn,
                "receiving",
                "update_weights",
                txn.live(),
                one,
                LOADED,
                lambda a: f"weight update failed: {a.detail}",
            )
            txn.renew_lease()
            return txn

    async def commit(
        self, txn_id: str, expected_checksum: str | None = None, reset_cache: bool = True
    ) -> RefitTxn:
        """Verify, reset caches, stamp and resume; the transaction ends here whatever happens."""
        async with self._lock:
            txn = self.find(txn_id)
            if expected_checksum is not None:
                txn.expected_checksum = expected_checksum
            txn.hold_lease()
            steps = [lambda: verify(self.fleet, txn), lambda: self._reset(txn), lambda: self._stamp(txn)]
            try:
                await run_steps(txn, steps if reset_cache else [steps[0], steps[2]])
            finally:
                await self._end(txn, "done" if txn.moved else "failed")
            return txn

    async def abort_if_held_by(self, holder: str, why: str) -> RefitTxn | None:
        """Abort the transaction in progress if ``holder`` began it (its key was revoked: nobody will
        commit it, and the fleet must not stay paused until the lease or deadline runs out); the
        transaction aborted, or None. A step running now (a load) finishes first (the lock)."""
        txn = self.active
        if txn is None or txn.ended or txn.holder != holder:
            return None
        try:
            return await self.abort(txn.id, why)
        except RefitRefused:  # it ended meanwhile
            return None

    async def abort(self, txn_id: str | None, why: str) -> RefitTxn:
        """End the transaction without moving the fleet: touched engines stay out, the rest resume."""
        async with self._lock:
            txn = self.find(txn_id)
            txn.error = why
            await self._end(txn, "aborted")
            return txn

    # -- the steps -----------------------------------------------------------------------------------
    async def _reset(self, txn: RefitTxn) -> None:
        report = await run_step(
            self.fleet, txn, "resetting", "reset_prefix_cache", txn.live(), lambda e, u: e.reset_cache(u)
        )
        for a in report.failures():
            txn.quarantine(a.url, f"prefix cache not reset (it would serve the old weights' KV): {a.detail}")
        self.backends.policy.reset_cache_state()

    async def _stamp(self, txn: RefitTxn) -> None:
        v = txn.version
        report = await run_step(
            self.fleet, txn, "stamping", "set_weight_version", txn.live(), lambda e, u: e.stamp(u, v)
        )
        for a in report.failures():
            txn.quarantine(a.url, f"version {v!r} not stamped: {a.detail}")
        versions = self.backends.versions
        for u in txn.live():
            versions.stamped(u, v)
            self.backends.clear_stale(u)
        if txn.live():
            txn.moved = True
            self.fleet.current_version = v
            versions.fleet_moved_to(v)
            self.source_set = True
            if txn.source == "directory" and txn.path is not None and txn.checksum is not None:
                self.source = WeightSource(v, txn.path, txn.checksum, record=txn.records.get(txn.path))
            else:  # streamed or external: these weights are in no directory the router verified
                self.source = None
        elif not txn.error:
            txn.error = "no engine took the new version"

    async def _end(self, txn: RefitTxn, phase: str) -> None:
        """Hold out what is not verified, abort its frozen requests, resume every engine, open the gate."""
        if txn.ended:
            return
        out = {
            u: e
            for u, e in txn.engines.items()
            if e.state == "quarantined" or (e.touched and e.state != "verified")
        }
        for u, e in out.items():
            if e.state != "quarantined":
                txn.quarantine(
                    u,
                    f"refit {txn.id} ended ({phase}: {txn.error or 'lease ran out'}) before its weights "
                    "were verified",
                )
            self.backends.hold_out_stale(u, f"refit {txn.id} to {txn.version!r}: {txn.engines[u].reason}")
        if out:
            # In keep mode their requests are frozen mid-generation on weights nobody verified: abort them
            # (vLLM answers them 200 with finish_reason "abort"), then resume so no engine stays paused.
            await run_step(
                self.fleet, txn, "resuming", "abort", list(out), lambda e, u: e.abort(u, []), bound="end"
            )
        await run_step(
            self.fleet, txn, "resuming", "resume", list(txn.engines), lambda e, u: e.resume(u), bound="end"
        )
        txn.phase = phase
        txn.ended_at = time.time()
        if out and self.on_held_out is not None and not self.backends.serving:
            # Every engine took weights nobody verified (a trainer gone between its load and its commit):
            # released now, the held requests would find no engine and all fail (no healthy backend).
            # They wait for the restore to bring an engine back on the fleet's version instead.
            txn.released = {"released": 0, "waiting_for_restore": len(out)}
            self._restoring = asyncio.get_running_loop().create_task(self._release_when_serving(txn))
        else:
            txn.released = self.gate.release()
        if self.backends.versions.pending == txn.version:
            self.backends.versions.announce(None)
        self.last, self.active = txn, None
        self._idle.set()
        if self._watchdog is not None and self._watchdog is not asyncio.current_task():
            self._watchdog.cancel()
        self._watchdog = None
        if out and self.on_held_out is not None:
            self.on_held_out(list(out))  # restores wait for the lock this transaction still holds
        log.info(
            "refit %s to %r %s in %.3f s: %d verified, %d quarantined %s",
            txn.id,
            txn.version,
            phase,
            txn.ended_at - txn.started_at,
            sum(e.state == "verified" for e in txn.engines.values()),
            len(out),
            {u: txn.engines[u].reason for u in out},
        )

    async def _release_when_serving(self, txn: RefitTxn) -> None:
        """Open the gate once an engine serves again (the restore readmitted it) or ``RESTORE_HOLD_S``
        passed, whichever is first; a transaction begun meanwhile owns the gate then."""
        back = asyncio.Event()

        def entered(_url: str) -> None:
            back.set()

        until = time.monotonic() + RESTORE_HOLD_S
        self.backends.serving_listeners.append(entered)
        try:
            # A restore that gives up (nothing on disk to restore from) ends the wait too: held on, the
            # requests would only wait out the bound for the same 'no healthy backend'.
            while not self.backends.serving and self.restores_pending() and time.monotonic() < until:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(back.wait(), 0.1)
        finally:
            self.backends.serving_listeners.remove(entered)
        if self.active is None:
            got = self.gate.release()
            txn.released = {
                **got,
                "waited_for_restore_s": round(time.time() - (txn.ended_at or time.time()), 3),
            }
            log.info("refit %s: the held requests go to the restored engines (%s)", txn.id, txn.released)
        self._restoring = None

    # -- the lease --------------------------------------------------------------------------------------
    async def _watch(self, txn: RefitTxn) -> None:
        """End ``txn`` when its lease or deadline runs out (a trainer that died, hung or forgot)."""
        while True:
            wait = min(txn._lease_until, txn.deadline) - time.monotonic()
            if wait <= 0:
                break
            await asyncio.sleep(min(wait, 1.0))
        async with self._lock:
            if txn.ended or self.active is not txn:
                return
            late = "deadline" if time.monotonic() >= txn.deadline else "lease"
            txn.error = (
                f"the refit's {late} ran out ({txn.deadline_s if late == 'deadline' else txn.lease_s:g} s) "
                "before it was committed"
            )
            log.warning("refit %s: %s; resuming the fleet", txn.id, txn.error)
            await self._end(txn, "expired")


class _BetweenRefits:
    """``RefitCoordinator.between_refits``' context (a class, so a task cancelled or destroyed at the
    router's shutdown releases the lock plainly)."""

    def __init__(self, coordinator: RefitCoordinator) -> None:
        self._c = coordinator

    async def __aenter__(self) -> None:
        c = self._c
        while True:
            await c._idle.wait()
            await c._lock.acquire()
            if c.active is None or c.active.ended:
                return
            c._lock.release()

    async def __aexit__(self, *exc: object) -> None:
        self._c._lock.release()
