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

A failed attempt is retried ``ATTEMPTS`` times with a growing pause, releasing the lock in between; one
that still fails leaves the engine STALE with ``restore from DIR failed: ...`` (and a warning in the log).

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
from typing import Any

from router.fleet.checkpoint import CheckpointRefused
from router.fleet.engine import EngineClient
from router.fleet.fleet import Fleet
from router.fleet.ops import checksum_digest, compare_checksums, fan_out
from router.fleet.refit import DEFAULT_DEADLINE_S, RefitCoordinator, WeightSource
from router.fleet.tensor_manifest import DirectoryRecord, check_checkpoints

log = logging.getLogger(__name__)

ATTEMPTS = 3
"""Tries per restore: a reload can fail once for a passing reason (storage, an engine still busy with a
load that missed a refit's deadline)."""
BACKOFF_S = 2.0
"""The pause after a failed attempt, doubled after each."""
LOAD_TIMEOUT_S = DEFAULT_DEADLINE_S
"""The most one reload may take (what a refit's whole deadline allows a load)."""
STEP_TIMEOUT_S = 120.0
"""The most a checksum, a cache reset or a stamp may take."""
LOST = "its weights are lost and a reload does not bring them back: restart it"
"""The end of the stale reason of an engine only a restart can bring back (``needs_restart``)."""


def needs_restart(reason: str) -> bool:
    """Whether the front's stale reason says the engine must be restarted (the fleet controller's test)."""
    return reason.endswith(LOST)


class NothingToRestore(Exception):
    """No verified directory holds the fleet's current weights (the message says why)."""


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
        pause = BACKOFF_S
        for attempt in range(1, ATTEMPTS + 1):
            try:
                async with self.coordinator.between_refits():
                    if url not in self.backends.stale:
                        return  # readmitted meanwhile (a refit or a stamp), or gone
                    failed = await self._once(url)
                    if failed is None:
                        self.restored_total += 1
                        return
                    detail, lost = failed
                    reason = f"restore from {detail}"
                    if attempt == ATTEMPTS and lost:
                        reason = f"{reason}; {LOST}"
                    self.backends.hold_out_stale(url, reason)
            except NothingToRestore as exc:
                why = self.backends.stale.get(url)
                if why is not None and "not restored:" not in why:
                    self.backends.hold_out_stale(url, f"{why}; not restored: {exc}")
                log.info("engine %s stays stale until a refit: %s", url, exc)
                return
            log.warning("engine %s: %s (attempt %d of %d)", url, reason, attempt, ATTEMPTS)
            if attempt < ATTEMPTS:
                await asyncio.sleep(pause)
                pause *= 2
        self.failed_total += 1

    async def _once(self, url: str) -> tuple[str, bool] | None:
        """One attempt, under the coordinator's lock: ``None`` when ``url`` was readmitted, else
        (``DIR failed: why``, whether its weights were left unreadable)."""
        source = await self._source(url)
        path = source.path
        try:
            root = await self._served_root()
            checked = await self._guard.run(check_checkpoints, [path], root, None, source.started_from)
        except CheckpointRefused as exc:
            return f"{path} failed: the directory no longer passes the check: {exc}", False
        changed = self._changed(source, checked.records[path])
        if changed:
            return f"{path} failed: {changed}", False
        async with EngineClient.open(self.api_key, LOAD_TIMEOUT_S) as engines:
            loaded = await engines.reload_weights(url, path)
            engines.timeout_s = STEP_TIMEOUT_S
            read = await engines.checksum(url)
            if not loaded.ok:
                return f"{path} failed: {loaded.detail}", not read.ok
            if not read.ok:
                return f"{path} failed: checksum unreadable after the load: {read.detail}", True
            digest = checksum_digest(read.body.get("checksums") or {})
            wanted = source.checksum or await self._fleet_checksum(url)
            if wanted is not None and digest != wanted:
                return f"{path} failed: checksum {digest} differs from the fleet's {wanted}", False
            try:  # written during this load: the engine holds what nobody verified
                after = await self._guard.run(checked.records[path].again)
            except CheckpointRefused as exc:
                return f"{path} failed: the directory is not readable again after the load: {exc}", False
            changed = self._changed(source, after)
            if changed:
                return f"{path} failed: {changed}", False
            reset = await engines.reset_cache(url)
            if not reset.ok:
                return f"{path} failed: prefix cache not reset: {reset.detail}", False
            if source.version is not None:
                stamp = await engines.stamp(url, source.version)
                if not stamp.ok:
                    return f"{path} failed: version {source.version!r} not stamped: {stamp.detail}", False
        if self.fleet.current_version != source.version or url not in self.backends.members:
            return f"{path} failed: the fleet moved on while it loaded", False
        if source.version is not None:
            self.backends.versions.stamped(url, source.version)
        self.backends.clear_stale(url)
        log.info(
            "engine %s restored from %s (version %r, checksum %s): readmitted",
            url,
            path,
            source.version,
            digest,
        )
        return None

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
