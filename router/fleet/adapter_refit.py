"""An adapter refit as one transaction: check, canary, every engine, verify, stamp, drain the old one.

The full refit (``router.fleet.refit``) pauses the fleet because every request depends on the base
weights. An adapter's new version concerns its tenant alone, and it is loaded under a name of its own
(``router.adapters.names``) beside the old one, so nothing is paused: other tenants' requests, and
this tenant's in flight, go on while it loads. The steps, under one deadline:

    check the directory (before any engine is asked) -> load it on a canary engine and verify it there
    -> load it on every other serving engine and verify each -> stamp: the router's table routes the
    adapter's name to the new version, on the engines that verified it -> the old version drains (the
    requests already on it finish) and is unloaded from its engines

* **The canary** is the serving engine with the fewest requests in flight. It must answer the load,
  then list the new served name with the directory it was given as its root (``GET /v1/models``) and
  answer ``/health``. If it fails, the transaction ends there (``failed``, answered 500): no other
  engine was asked, the adapter stays on its old version, the canary's half-loaded name is unloaded;
  the canary itself is held out of routing (quarantined, with the reason) only when it does not answer
  ``/health`` after the failure. vLLM 0.32 survives a bad adapter (a 500 from its worker, the base
  model and other adapters still served), and holding a healthy engine out because one tenant's
  directory is broken would shrink every other tenant's fleet for that tenant's mistake.
* **An engine that fails after the canary passed** does not get the new version: it keeps serving the
  base model and the other adapters, and requests for this adapter go to the engines that verified it
  (named in the report, ``missing``). A restarted engine gets every adapter's current version back
  before any adapter request is sent to it (``restore``).
* **The report** (``AdapterTxn.to_json``) has the shape of the full refit's, by construction: both are
  the transaction core's (``router.fleet.txn``: id, phase, steps with their times, the canary,
  per-engine states and reasons, ``moved``, ``error``), and the deadline, the canary step and the load
  step are the core's too; ``GET /fleet/adapters`` shows the last one per adapter.
* Steps run as tasks of their own (``RefitCoordinator.run``'s shield): a trainer that disconnects does
  not cancel a load half-way. At most one transaction per adapter at a time, and none while a full
  refit owns the fleet (that one pauses and reloads every engine under it).
* **Every name the engines may hold has its owner in the table** from the moment its load begins until
  every engine it was sent to dropped it (``AdapterTable.names``): a half-loaded canary, a draining
  version, an unloaded adapter's versions. An unload an engine did not answer keeps the name (refused to
  everyone else) rather than forgetting a name an engine may still serve.
* **After a router restart** nothing is loaded or unloaded, and no adapter request is served, until
  the table has taken in what the serving engines hold (``rebuild``, ``router.adapters.adoption``);
  an engine that joins later with names the table does not know has them adopted too.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from router.adapters.names import check_version, served_name
from router.adapters.table import AdapterCapacity, AdapterTable, AdapterVersion
from router.fleet import adapter_restore
from router.fleet.adapter_check import AdapterDir, AdapterRefused, read_adapter
from router.fleet.adapter_rebuild import rebuild, rejoin
from router.fleet.checkpoint import CheckpointGuard
from router.fleet.engine import EngineAnswer, EngineClient
from router.fleet.fleet import Fleet
from router.fleet.refit import RefitCoordinator, RefitRefused
from router.fleet.txn import QUARANTINED, VERIFIED, Txn, canary_step, load_step

log = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = 300.0
MISSING = "missing"
"""An engine's state in an adapter refit's report when the adapter failed there (the core's
quarantined): the engine serves on, without this version."""
UNTOUCHED = "untouched"
"""An engine's state when the canary failed before it was asked."""
DRAIN_TIMEOUT_S = 600.0
"""How long an old version waits for its requests in flight before it is unloaded anyway (a request
longer than this is not a rollout; the engine aborts it as it would any request for an unknown name)."""


@dataclass(kw_only=True)
class AdapterTxn(Txn):
    """One adapter refit: the core's record (``router.fleet.txn``) plus the adapter, its version and
    directory. An engine the adapter failed on is quarantined in the transaction, reported ``missing``:
    it keeps serving the base model and the other adapters."""

    KIND: ClassVar[str] = "adapter refit"
    adapter: str
    version: str
    served: str
    path: str
    caller: str
    phase: str = "checking"
    previous_version: str | None = None
    check: str = ""
    held_out: dict[str, str] = field(default_factory=dict)
    """Engines taken out of routing (a canary that stopped answering ``/health`` after the failure)."""
    unloaded: list[str] = field(default_factory=list)
    """The old versions' served names unloaded once drained (filled after the answer)."""
    kept_by: set[str] = field(default_factory=set)
    """Engines a failed load left the new served name on (their unload failed): its owner is kept."""

    def to_json(self) -> dict[str, Any]:
        out = self.report()
        engines = {
            u: {"state": MISSING if e.state == QUARANTINED else e.state, "reason": e.reason}
            for u, e in self.engines.items()
        }
        missing = {u: e.reason for u, e in self.engines.items() if e.state != VERIFIED}
        return {
            **out,
            "adapter": self.adapter,
            "version": self.version,
            "served_name": self.served,
            "path": self.path,
            "by": self.caller,
            "engines": engines,
            "verified": sorted(out["verified"]),
            "missing": missing,
            "quarantined": dict(self.held_out),
            "previous_version": self.previous_version,
            "check": self.check,
            "unloaded": list(self.unloaded),
            "ok": self.moved and not missing,
        }


class AdapterRefits:
    """The adapter transactions of one router (``router.fleet.adapter_routes`` calls them)."""

    def __init__(
        self,
        fleet: Fleet,
        table: AdapterTable,
        coordinator: RefitCoordinator,
        guard: CheckpointGuard | None = None,
        served_root: Callable[[], Awaitable[str | None]] | None = None,
    ) -> None:
        """``guard`` and ``served_root``: the fleet's (``Fleet.checks``, ``Fleet.served_root``) unless
        given."""
        self.fleet = fleet
        self.table = table
        self.coordinator = coordinator
        self.guard = guard or fleet.checks
        self.served_root = served_root or fleet.served_root
        self.active: dict[str, AdapterTxn] = {}
        self.last: dict[str, AdapterTxn] = {}
        self.drain_timeout_s = DRAIN_TIMEOUT_S
        self._tasks: set[asyncio.Task[Any]] = set()
        self.joined = asyncio.Event()
        """Set when an engine enters the serving set (what a rebuild with none yet waits for)."""

    # -- load -----------------------------------------------------------------------------------------------
    def begin(self, name: str, path: str, version: str | None, caller: str, deadline_s: float) -> AdapterTxn:
        """Refuse (``RefitRefused``, ``AdapterForbidden``) before anything is read or sent; else the
        transaction, registered as this adapter's active one."""
        self.table.may_change(name, caller)
        self._check_rebuilt()
        if name in self.active:
            raise RefitRefused(f"adapter {name!r} is being refit already ({self.active[name].id})", 409)
        if busy := self.coordinator.busy():
            raise RefitRefused(f"{busy}: load the adapter once it ends", 409)
        try:
            self.table.admit_new(name)
        except AdapterCapacity as exc:
            raise RefitRefused(str(exc), 409) from None
        adapter = self.table.adapters.get(name)
        history = adapter.history if adapter is not None else []
        if version is None:
            version = f"v{len(history) + 1}"
        check_version(version)
        if version in history:
            raise RefitRefused(
                f"adapter {name!r} already had version {version!r}: give each load a new version (its name "
                "on the engines is the version's, so that no cached prefix crosses versions)",
                409,
            )
        txn = AdapterTxn(
            id=secrets.token_hex(6),
            deadline_s=deadline_s,
            adapter=name,
            version=version,
            served=served_name(name, version),
            path=path,
            caller=caller,
        )
        txn.previous_version = adapter.current.version if adapter and adapter.current else None
        self.active[name] = txn
        self.table.pending[name] = version
        self.table.names[txn.served] = self.table.owner_of(name) or caller
        return txn

    def _check_rebuilt(self) -> None:
        if not self.table.rebuilt:
            raise RefitRefused(
                "the router is reading which adapters the engines hold (it restarted): retry in a moment", 409
            )

    async def check(self, txn: AdapterTxn, allow_foreign: bool = False) -> AdapterDir:
        """The directory's check (``router.fleet.adapter_check``) off the loop, before any engine is asked;
        ``AdapterRefused`` ends the transaction (``end``) with nothing touched."""
        root = await self.served_root()
        t0 = time.monotonic()
        try:
            checked = await self.guard.run(read_adapter, txn.path, self.table.plan, root, allow_foreign)
            if checked.lm_head and self.table.plan.base_model and await self._on_cpu():
                raise AdapterRefused(
                    f"adapter {txn.path} adapts lm_head, and this fleet's engines run on CPUs, where vLLM "
                    "0.32 applies the lm_head of a loaded adapter to requests of the base model (punica's "
                    "CPU path reads 'no adapter' as the last slot): every base-model consumer would sample "
                    "from this tenant's head. Train without lm_head, or serve adapters only "
                    "(generation.lora.base_model: false)"
                )
        except ValueError as exc:
            txn.error = str(exc)
            self.end(txn)
            raise AdapterRefused(str(exc)) from None
        txn.check = checked.summary()
        txn.add_step("checking", t0)
        return checked

    async def _on_cpu(self) -> bool:
        """Whether the fleet's engines run on CPUs (``Fleet.device``). An engine that does not say counts
        as not on CPUs."""
        return await self.fleet.device() == "cpu"

    async def run(self, txn: AdapterTxn, checked: AdapterDir) -> AdapterTxn:
        """Load, verify and stamp a checked adapter (module doc); ends the transaction whatever happens."""
        try:
            await self._load_all(txn, checked)
        except Exception as exc:  # a bug must not leave the adapter marked busy
            log.exception("adapter refit %s failed", txn.id)
            txn.error = txn.error or f"{type(exc).__name__}: {exc}"
        finally:
            self.end(txn)
        return txn

    def end(self, txn: AdapterTxn) -> None:
        txn.phase = "done" if txn.moved else "failed"
        txn.ended_at = time.time()
        self.active.pop(txn.adapter, None)
        self.table.pending.pop(txn.adapter, None)
        if not txn.moved and not txn.kept_by:
            self.table.forget(txn.served)
        self.table.announce()
        self.last[txn.adapter] = txn
        log.info(
            "adapter refit %s of %r to %r %s in %.3f s (by %s): %s",
            txn.id,
            txn.adapter,
            txn.version,
            txn.phase,
            txn.ended_at - txn.started_at,
            txn.caller,
            txn.error or f"verified on {len(txn.verified())} engine(s)",
        )

    def _draining(self, txn: AdapterTxn) -> list[AdapterVersion]:
        adapter = self.table.adapters.get(txn.adapter)
        return [d for d in adapter.draining if d.in_flight] if adapter is not None else []

    async def _drained(self, txn: AdapterTxn, draining: list[AdapterVersion]) -> None:
        """Wait (at most half of what the deadline leaves) for the adapter's versions still draining from
        its last refit: the plan gives each adapter two versions on an engine (``--max-cpu-loras``), and
        a third would make vLLM evict one, maybe the one a request is still decoding on. Past the wait
        the load goes on (the step's refit matters more), and the log says so."""
        try:
            await asyncio.wait_for(asyncio.gather(*(d.idle.wait() for d in draining)), txn.remaining() / 2)
        except TimeoutError:
            log.warning(
                "adapter refit %s: %s still in flight; loading %s beside them",
                txn.id,
                ", ".join(f"{d.served} ({d.in_flight})" for d in draining),
                txn.served,
            )

    async def _load_all(self, txn: AdapterTxn, checked: AdapterDir) -> None:
        """The steps after the check: draining (the versions before), canary, loading, stamped."""
        if draining := self._draining(txn):
            with txn.timed("draining"):
                await self._drained(txn, draining)
        urls = list(self.fleet.backends.serving)
        if not urls:
            txn.error = "no engine is serving: nothing to load the adapter into"
            return
        txn.enlist(urls)
        canary = min(urls, key=self.fleet.backends.load.in_flight)

        async def load(engines: EngineClient, url: str) -> EngineAnswer:  # adapter_restore's check
            why = await adapter_restore.load_and_verify(engines, url, txn.served, txn.path)
            return EngineAnswer(url, why is None, None, why or "")

        why = await canary_step(self.fleet, txn, canary, load, VERIFIED)
        if why is not None:
            await self._canary_failed(txn, canary, why)
            return
        if rest := [u for u in urls if u != canary]:
            report = await load_step(self.fleet, txn, "loading", "load_adapter", rest, load, VERIFIED)
            for a in report.failures():
                if not _dropped(await self._unload(a.url, txn.served)):
                    txn.kept_by.add(a.url)
        verified = set(txn.verified())
        new = AdapterVersion(txn.version, txn.served, txn.path, checked.rank, verified, digest=checked.digest)
        owner = self.table.owner_of(txn.adapter) or txn.caller
        old = self.table.stamp(txn.adapter, owner, new)
        txn.moved = True
        txn.phase = "stamped"
        txn.add_step("stamped", time.monotonic(), len(verified))
        if old is not None:
            self._spawn(self._drain(txn, old))

    async def _canary_failed(self, txn: AdapterTxn, canary: str, why: str) -> None:
        """The transaction ends at the canary: no other engine asked, its half-load undone, the canary
        held out only when it stopped answering."""
        for u, e in txn.engines.items():
            if u != canary:
                e.state, e.reason = UNTOUCHED, "not asked: the canary failed"
        if not _dropped(await self._unload(canary, txn.served)):
            txn.kept_by.add(canary)
        async with EngineClient.open(self.fleet.engine_key, 15.0) as engines:
            health = await engines.health(canary)
        if not health.ok:
            reason = f"adapter refit {txn.id} ({txn.served}): {health.detail} after a failed load"
            self.fleet.backends.hold_out_stale(canary, reason)
            txn.held_out[canary] = reason
        txn.error = (
            f"the canary {canary} failed, so no other engine was asked and adapter {txn.adapter!r} stays on "
            f"{txn.previous_version!r}: {why}"
        )

    async def _unload(self, url: str, served: str) -> EngineAnswer:
        async with EngineClient.open(self.fleet.engine_key, 30.0) as engines:
            return await engines.unload_adapter(url, served)

    # -- the old version ---------------------------------------------------------------------------------
    async def _drain(self, txn: AdapterTxn | None, old: AdapterVersion) -> None:
        """Unload ``old`` from its engines once no request is in flight on it (bounded)."""
        try:
            await asyncio.wait_for(old.idle.wait(), self.drain_timeout_s)
        except TimeoutError:
            log.warning(
                "adapter version %s: %d request(s) still in flight after %g s; unloading it",
                old.served,
                old.in_flight,
                self.drain_timeout_s,
            )
        for adapter in self.table.adapters.values():
            if old in adapter.draining:
                adapter.draining.remove(old)
        engines, old.engines = sorted(old.engines), set()
        answers = await asyncio.gather(*(self._unload(u, old.served) for u in engines))
        if all(_dropped(a) for a in answers):
            self.table.forget(old.served)
        else:  # an engine may still serve it: its owner stays known, and it stays refused to others
            log.warning("adapter version %s: not unloaded from every engine: %s", old.served, answers)
        if txn is not None:
            txn.unloaded.append(old.served)
        log.info("adapter version %s unloaded from %d engine(s)", old.served, len(engines))

    async def unload(self, name: str, caller: str) -> dict[str, Any]:
        """Stop serving adapter ``name``: its entry goes at once (new requests for it are refused), each
        version is unloaded from its engines once its requests in flight end."""
        self.table.may_change(name, caller)
        self._check_rebuilt()
        if name in self.active:
            raise RefitRefused(
                f"adapter {name!r} is being refit ({self.active[name].id}); unload it after", 409
            )
        adapter = self.table.drop(name)
        if adapter is None:
            raise RefitRefused(f"adapter {name!r} is not loaded", 404)
        versions = [v for v in (adapter.current, *adapter.draining) if v is not None]
        await asyncio.gather(*(self._drain(None, v) for v in versions))
        return {"adapter": name, "unloaded": [v.served for v in versions], "by": caller}

    # -- restarted engines ----------------------------------------------------------------------------------
    def on_serving(self, url: str) -> None:
        """``url`` (re)entered the serving set: no adapter request goes there until its adapters are
        checked and reloaded (a restarted engine has none; vLLM would answer 404 mid-rollout), and what
        it holds that the table does not know is adopted (``router.fleet.adapter_rebuild``)."""
        self.table.engines_left(url)
        self.joined.set()
        if self.table.rebuilt:  # before, the rebuild reads every serving engine
            self._spawn(rejoin(self, url))

    def drain_later(self, version: AdapterVersion) -> None:
        """Unload ``version`` from its engines once nothing is in flight on it (an adopted stale one)."""
        self._spawn(self._drain(None, version))

    def start(self) -> None:
        """Called once the router's loop runs: the table is rebuilt before any adapter is served."""
        self._spawn(rebuild(self))

    async def restore(self, url: str) -> None:
        """Give ``url`` every version the table routes, each only after the check of a fresh load and
        with the digest its files had when it was loaded, before and after the engine reads them; the
        others are left off that engine and reported ``missing`` there (``router.fleet.adapter_restore``:
        a restore that reloaded the recorded path unchecked served another user's adapter under a
        tenant's version)."""
        await adapter_restore.restore(self, url)

    # -- plumbing ---------------------------------------------------------------------------------------
    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _dropped(answer: EngineAnswer) -> bool:
    """The engine no longer holds the name: it unloaded it, or never had it (vLLM's 404)."""
    return answer.ok or answer.status == 404
