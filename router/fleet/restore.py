"""Bring an engine held out without the fleet's weights back to them, from the last verified directory.

Without this, every engine that lost or never had the current weights waits for the trainer: a canary
quarantined because a checkpoint failed in its loader (on vLLM 0.32 that leaves it with no weights at
all), an engine the fleet controller restarted (it comes back on the checkpoint it was started from),
an engine of a node the fleet grew by. A trainer between steps, or a standing fleet with no trainer,
may not refit for a long time, and the fleet serves short-handed (or not at all) meanwhile.

The refit coordinator remembers where the fleet's current weights are on disk
(``router.fleet.refit.WeightSource``): the directory of the last refit that moved the fleet, or, before
any refit, the absolute directory the engines were started from (the served model's ``/v1/models``
root). A restore of one engine, run between transactions (``RefitCoordinator.between_refits``; a refit
that begins meanwhile waits for it):

    re-check the directory (``router.fleet.checkpoint`` and its tensors, off the loop under its
    deadline: it may have been deleted or overwritten since) -> its weight files must be as the refit
    verified them (``router.fleet.tensor_manifest``: size, mtime, ctime, inode, header) -> reload it into
    the engine -> its files still as verified -> its checksum (every weight the engine computes with,
    ``router.fleet.weight_checksums``) must equal the fleet's -> reset its prefix cache -> stamp the
    fleet's version -> readmit it (``clear_stale``)

Each attempt is a transaction of the fleet's core (``router.fleet.txn``): those steps as a list, each
timed, the load bounded by one deadline that keeps a reserve for the steps after it (``RestoreTxn``;
``Restorer.last`` keeps each engine's last one). A failed attempt is retried under the core's retry policy
(``ATTEMPTS`` tries with a growing pause), releasing the lock in between; one that still fails leaves the
engine STALE with ``restore from DIR failed: ...`` (and a warning in the log).

When nothing is restored, and why:

* The fleet's weights came by stream (NCCL) or by the trainer's own means (``external``): they are in no
  directory the router knows. Such an engine stays STALE until the trainer refits it; its reason says so.
* The fleet's version was stamped (``POST /fleet/weight_version``) after the directory was verified:
  the router cannot tell whether the weights changed with it, so it does not guess.
* The engine's weights are lost and a reload cannot bring them back. Measured on vLLM 0.32 CPU: after a
  reload that failed on a tensor of the wrong shape, every later reload fails the same way (its layerwise
  loader keeps the bad tensor and replays it), while after a truncated file, an unparsable one or an
  unknown tensor name a reload from a good directory brings back exactly its weights. So when the
  retries are spent and the engine's checksum is still unreadable (its weights are detached), the reason
  ends with ``LOST``: the fleet controller condemns such an engine (``needs_restart``) and restarts it,
  and the restarted engine, which joins on its start checkpoint, is restored like any other.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from router.fleet.checkpoint import CheckpointRefused
from router.fleet.engine import EngineAnswer
from router.fleet.fleet import Fleet
from router.fleet.ops import checksum_digest, compare_checksums, fan_out
from router.fleet.refit import DEFAULT_DEADLINE_S, RefitCoordinator, WeightSource
from router.fleet.tensor_manifest import DirectoryRecord, check_checkpoints
from router.fleet.txn import LOADED, PENDING, STEP_TIMEOUT_S, VERIFIED, RetryPolicy, Txn, run_one, run_steps

log = logging.getLogger(__name__)

ATTEMPTS = 3
"""Tries per restore: a reload can fail once for a passing reason (storage, an engine still busy with a
load that missed a refit's deadline)."""
BACKOFF_S = 2.0
"""The pause after a failed attempt, doubled after each."""
LOAD_TIMEOUT_S = DEFAULT_DEADLINE_S
"""The most one reload may take (what a refit's whole deadline allows a load)."""
RESERVE_S = 3 * STEP_TIMEOUT_S
"""What a restore's load leaves of its deadline to the checksum, the cache reset and the stamp (each at
most ``STEP_TIMEOUT_S``, the core's bound of a step)."""
LOST = "its weights are lost and a reload does not bring them back: restart it"
"""The end of the stale reason of an engine only a restart can bring back (``needs_restart``)."""


def needs_restart(reason: str) -> bool:
    """Whether the front's stale reason says the engine must be restarted (the fleet controller's test)."""
    return reason.endswith(LOST)


class NothingToRestore(Exception):
    """No verified directory holds the fleet's current weights (the message says why)."""


@dataclass(kw_only=True)
class RestoreTxn(Txn):
    """One attempt to restore one engine from ``source``: the core's record (``router.fleet.txn``) plus
    what one step hands the next."""

    KIND: ClassVar[str] = "restore"
    source: WeightSource
    phase: str = "checking"
    record: DirectoryRecord | None = None
    """The directory's files as this attempt's check read them."""
    loaded: EngineAnswer | None = None
    lost: bool = False
    """The engine's checksum was unreadable after a failed load: its weights are detached."""

    @property
    def reserve(self) -> float:
        return RESERVE_S

    def fail(self, why: str, lost: bool = False) -> None:
        """End this attempt: ``DIR failed: why`` (the engine's stale reason, after ``restore from``)."""
        self.error = f"{self.source.path} failed: {why}"
        self.lost = lost
        for url in self.engines:
            self.quarantine(url, self.error)
        self.phase, self.ended_at = "failed", time.time()

    def to_json(self) -> dict[str, Any]:
        return {**self.report(), "path": self.source.path, "version": self.source.version, "lost": self.lost}


class Restorer:
    """Restores engines one task per engine, at most one at a time per engine."""

    def __init__(self, fleet: Fleet, coordinator: RefitCoordinator) -> None:
        """``fleet``: its backends, engine key and version now (``current_version``), the served model's
        directory as the engines report it (``served_root``) and the checkpoint check's runner
        (``checks``, shared with the refit routes, so one stalled mount holds one thread, not one per
        caller)."""
        self.fleet = fleet
        self.backends = fleet.backends
        self.coordinator = coordinator
        self.api_key = fleet.engine_key
        self._served_root = fleet.served_root
        self._guard = fleet.checks
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.restored_total = 0
        self._closed = False
        self.failed_total = 0
        self.last: dict[str, RestoreTxn] = {}
        """Each engine's last restore attempt (its steps, their timings, why it failed)."""

    # -- requests -------------------------------------------------------------------------------------
    def request(self, url: str) -> None:
        """Restore ``url`` soon (a no-op while a restore of it runs: that one reads the fleet's state
        again at each attempt)."""
        if url in self._tasks or self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not serving: nothing to restore into
            return
        task = loop.create_task(self._restore(url), name=f"restore {url}")
        self._tasks[url] = task
        task.add_done_callback(lambda t: self._tasks.pop(url, None))

    def request_all(self, urls: list[str]) -> None:
        for url in urls:
            self.request(url)

    def reports(self) -> dict[str, dict[str, Any]]:
        """Each member's last restore attempt (``GET /fleet/stale``'s ``restores``); departed engines'
        are dropped here, so the record stays as small as the fleet."""
        for url in [u for u in self.last if u not in self.backends.members]:
            del self.last[url]
        return {u: txn.to_json() for u, txn in self.last.items()}

    def pending(self) -> list[str]:
        return sorted(self._tasks)

    async def close(self) -> None:
        """Cancel every restore (the router is stopping); an engine half-restored stays STALE."""
        self._closed = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- one engine -----------------------------------------------------------------------------------
    async def _restore(self, url: str) -> None:
        """Restore ``url`` under the retry policy, each attempt under the coordinator's lock (the pause
        between attempts releases it)."""
        policy = RetryPolicy(ATTEMPTS, BACKOFF_S)

        async def attempt(n: int) -> bool:
            try:
                async with self.coordinator.between_refits():
                    if url not in self.backends.stale:
                        return True  # readmitted meanwhile (a refit or a stamp), or gone
                    txn = await self._once(url)
                    self.last[url] = txn
                    if txn.moved:
                        self.restored_total += 1
                        return True
                    reason = f"restore from {txn.error}"
                    if n == policy.attempts and txn.lost:
                        reason = f"{reason}; {LOST}"
                    self.backends.hold_out_stale(url, reason)
            except NothingToRestore as exc:
                why = self.backends.stale.get(url)
                if why is not None and "not restored:" not in why:
                    self.backends.hold_out_stale(url, f"{why}; not restored: {exc}")
                log.info("engine %s stays stale until a refit: %s", url, exc)
                return True
            log.warning("engine %s: %s (attempt %d of %d)", url, reason, n, policy.attempts)
            return False

        if not await policy.run(attempt):
            self.failed_total += 1

    async def _once(self, url: str) -> RestoreTxn:
        """One attempt, under the coordinator's lock: the restore's steps (module doc) on ``url``; the
        transaction ``moved`` when ``url`` was readmitted, else ``failed`` with ``DIR failed: why``."""
        txn = RestoreTxn(
            id=secrets.token_hex(6), deadline_s=LOAD_TIMEOUT_S + RESERVE_S, source=await self._source(url)
        )
        txn.enlist([url], touched=True)
        steps = (self._check, self._load, self._verify, self._reset, self._stamp, self._readmit)
        await run_steps(txn, [lambda step=step: step(txn, url) for step in steps])
        return txn

    async def _check(self, txn: RestoreTxn, url: str) -> None:
        """The directory passes the check again, its files as its version was verified with."""
        with txn.timed("checking", 1):
            path = txn.source.path
            try:
                root = await self._served_root()
                checked = await self._guard.run(
                    check_checkpoints, [path], root, None, txn.source.started_from
                )
            except CheckpointRefused as exc:
                return txn.fail(f"the directory no longer passes the check: {exc}")
            txn.record = checked.records[path]
            if changed := self._changed(txn.source, txn.record):
                txn.fail(changed)

    async def _load(self, txn: RestoreTxn, url: str) -> None:
        path = txn.source.path
        txn.loaded = await run_one(
            self.fleet, txn, "loading", "reload_weights", url, lambda e, u: e.reload_weights(u, path), "load"
        )
        txn.engines[url].state = LOADED if txn.loaded.ok else PENDING

    async def _verify(self, txn: RestoreTxn, url: str) -> None:
        """Its checksum is the fleet's, and the directory's files did not change while it loaded (read
        even after a failed load: an unreadable checksum then says its weights are lost)."""
        read = await run_one(self.fleet, txn, "verifying", "checksum", url, lambda e, u: e.checksum(u))
        loaded = txn.loaded
        if loaded is None or not loaded.ok:
            return txn.fail(loaded.detail if loaded else "not loaded", lost=not read.ok)
        if not read.ok:
            return txn.fail(f"checksum unreadable after the load: {read.detail}", lost=True)
        digest = txn.engines[url].checksum = checksum_digest(read.body.get("checksums") or {})
        wanted = txn.source.checksum or await self._fleet_checksum(url)
        if wanted is not None and digest != wanted:
            return txn.fail(f"checksum {digest} differs from the fleet's {wanted}")
        assert txn.record is not None
        try:  # written during this load: the engine holds what nobody verified
            after = await self._guard.run(txn.record.again)
        except CheckpointRefused as exc:
            return txn.fail(f"the directory is not readable again after the load: {exc}")
        if changed := self._changed(txn.source, after):
            return txn.fail(changed)
        txn.engines[url].state = VERIFIED

    async def _reset(self, txn: RestoreTxn, url: str) -> None:
        a = await run_one(
            self.fleet, txn, "resetting", "reset_prefix_cache", url, lambda e, u: e.reset_cache(u)
        )
        if not a.ok:
            txn.fail(f"prefix cache not reset: {a.detail}")

    async def _stamp(self, txn: RestoreTxn, url: str) -> None:
        if (v := txn.source.version) is not None:
            a = await run_one(
                self.fleet, txn, "stamping", "set_weight_version", url, lambda e, u: e.stamp(u, v)
            )
            if not a.ok:
                txn.fail(f"version {v!r} not stamped: {a.detail}")

    async def _readmit(self, txn: RestoreTxn, url: str) -> None:
        source = txn.source
        if self.fleet.current_version != source.version or url not in self.backends.members:
            return txn.fail("the fleet moved on while it loaded")
        if source.version is not None:
            self.backends.versions.stamped(url, source.version)
        self.backends.clear_stale(url)
        txn.moved, txn.phase, txn.ended_at = True, "done", time.time()
        log.info(
            "engine %s restored from %s (version %r, checksum %s): readmitted",
            url,
            source.path,
            source.version,
            txn.engines[url].checksum,
        )

    @staticmethod
    def _changed(source: WeightSource, now: DirectoryRecord) -> str:
        """Why the directory's files are not those its version was verified with ("" when they are, or
        when no record was kept: the start directory, whose engines' checksums are compared instead)."""
        if source.record is None:
            return ""
        changes = source.record.changes(now)
        if not changes:
            return ""
        return (
            f"its files changed since version {source.version!r} was verified from it "
            f"({'; '.join(changes)}): it no longer holds that version's weights; refit the fleet"
        )

    async def _source(self, url: str) -> WeightSource:
        """The verified directory of the fleet's current weights, or ``NothingToRestore``."""
        c = self.coordinator
        current = self.fleet.current_version
        if c.source_set:
            if c.source is None:
                raise NothingToRestore(
                    "the fleet's weights came by stream or by the trainer's own means, from no directory "
                    "the router verified: refit it"
                )
            source = c.source
        else:
            root = await self._served_root()
            if not root or not root.startswith("/"):
                raise NothingToRestore(
                    f"no refit moved the fleet, and the served model {root!r} is no absolute directory"
                )
            source = WeightSource(None, root, None, started_from=True)
        if source.version != current:
            raise NothingToRestore(
                f"the fleet's version {current!r} was stamped after {source.path} was verified (as "
                f"{source.version!r}): the router cannot tell it holds those weights"
            )
        return source

    async def _fleet_checksum(self, url: str) -> str | None:
        """The serving engines' one checksum (other than ``url``); ``None`` when none serves."""
        others = [u for u in self.backends.serving if u != url]
        if not others:
            return None
        reads = await fan_out(
            others, lambda e, u: e.checksum(u), api_key=self.api_key, timeout_s=STEP_TIMEOUT_S
        )
        groups: dict[str, Any] = compare_checksums(reads)[0]["groups"]
        if len(groups) != 1:
            raise NothingToRestore(f"the serving engines' weights are not one checksum ({sorted(groups)})")
        return next(iter(groups))
