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
* **The report** (``AdapterTxn.to_json``) has the shape of the full refit's: id, phase, steps with their
  times, the canary, per-engine states and reasons, ``moved``, ``ok``, ``error``; ``GET /fleet/adapters``
  shows the last one per adapter.
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
from typing import Any

from router.adapters.names import check_version, served_name
from router.adapters.table import AdapterCapacity, AdapterTable, AdapterVersion
from router.fleet import adapter_restore
from router.fleet.adapter_check import AdapterDir, AdapterRefused, read_adapter
from router.fleet.adapter_rebuild import rebuild, rejoin
from router.fleet.checkpoint import CheckpointGuard
from router.fleet.engine import EngineAnswer, EngineClient
from router.fleet.fleet import Fleet
from router.fleet.refit import RefitCoordinator, RefitRefused

log = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = 300.0
DRAIN_TIMEOUT_S = 600.0
"""How long an old version waits for its requests in flight before it is unloaded anyway (a request
longer than this is not a rollout; the engine aborts it as it would any request for an unknown name)."""


@dataclass
class AdapterTxn:
    id: str
    adapter: str
    version: str
    served: str
    path: str
    caller: str
    deadline_s: float
    phase: str = "checking"
    started_at: float = field(default_factory=time.time)
    ended_at: float | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    engines: dict[str, dict[str, str]] = field(default_factory=dict)
    canary: str | None = None
    previous_version: str | None = None
    check: str = ""
    error: str = ""
    moved: bool = False
    held_out: dict[str, str] = field(default_factory=dict)
    """Engines taken out of routing (a canary that stopped answering ``/health`` after the failure)."""
    unloaded: list[str] = field(default_factory=list)
    """The old versions' served names unloaded once drained (filled after the answer)."""
    kept_by: set[str] = field(default_factory=set)
    """Engines a failed load left the new served name on (their unload failed): its owner is kept."""
    _t0: float = field(default_factory=time.monotonic, repr=False)

    def remaining(self) -> float:
        return max(0.0, self._t0 + self.deadline_s - time.monotonic())

    def to_json(self) -> dict[str, Any]:
        missing = {u: e["reason"] for u, e in self.engines.items() if e["state"] != "verified"}
        return {
            "id": self.id,
            "adapter": self.adapter,
            "version": self.version,
            "served_name": self.served,
            "path": self.path,
            "by": self.caller,
            "phase": self.phase,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "elapsed_s": round((self.ended_at or time.time()) - self.started_at, 4),
            "deadline_s": self.deadline_s,
            "steps": list(self.steps),
            "canary": self.canary,
            "engines": dict(self.engines),
            "verified": sorted(u for u, e in self.engines.items() if e["state"] == "verified"),
            "missing": missing,
            "quarantined": dict(self.held_out),
            "previous_version": self.previous_version,
            "check": self.check,
            "error": self.error,
            "moved": self.moved,
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
            secrets.token_hex(6), name, version, served_name(name, version), path, caller, deadline_s
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
        txn.steps.append({"phase": "checking", "took_s": round(time.monotonic() - t0, 4), "failed": {}})
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
            txn.error or f"verified on {len(txn.to_json()['verified'])} engine(s)",
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
        if draining := self._draining(txn):
            await self._timed(txn, "draining", self._drained(txn, draining))
        urls = list(self.fleet.backends.serving)
        if not urls:
            txn.error = "no engine is serving: nothing to load the adapter into"
            return
        in_flight = self.fleet.backends.load.in_flight
        canary = min(urls, key=in_flight)
        txn.canary = canary
        txn.engines = {u: {"state": "pending", "reason": ""} for u in urls}
        answer = await self._timed(txn, "canary", self._load_one(txn, canary))
        if not answer.ok:
            await self._canary_failed(txn, canary, answer.detail)
            return
        rest = [u for u in urls if u != canary]
        if rest:
            answers = await self._timed(
                txn, "loading", asyncio.gather(*(self._load_one(txn, u) for u in rest))
            )
            for a in answers:
                if not a.ok and not _dropped(await self._unload(a.url, txn.served)):
                    txn.kept_by.add(a.url)
        verified = {u for u, e in txn.engines.items() if e["state"] == "verified"}
        new = AdapterVersion(txn.version, txn.served, txn.path, checked.rank, verified, digest=checked.digest)
        owner = self.table.owner_of(txn.adapter) or txn.caller
        old = self.table.stamp(txn.adapter, owner, new)
        txn.moved = True
        txn.phase = "stamped"
        txn.steps.append({"phase": "stamped", "took_s": 0.0, "engines": len(verified), "failed": {}})
        if old is not None:
            self._spawn(self._drain(txn, old))

    async def _load_one(self, txn: AdapterTxn, url: str) -> EngineAnswer:
        """Load and verify ``txn``'s version on one engine, within what the deadline leaves."""
        timeout = txn.remaining()
        state = txn.engines[url]
        if timeout <= 0:
            state.update(state="missing", reason="the adapter refit's deadline passed")
            return EngineAnswer(url, False, None, state["reason"])
        async with EngineClient.open(self.fleet.engine_key, timeout) as engines:
            loaded = await engines.load_adapter(url, txn.served, txn.path)
            if not loaded.ok:
                state.update(state="missing", reason=f"load failed: {loaded.detail}")
                return EngineAnswer(url, False, loaded.status, state["reason"])
            models = await engines.models(url)
            root = (models.value or {}).get(txn.served)
            if root is None:
                why = models.error or f"/v1/models does not list {txn.served!r} after the load"
                state.update(state="missing", reason=f"not verified: {why}")
                return EngineAnswer(url, False, None, state["reason"])
            if root != txn.path:  # vLLM lists the path as it was given
                state.update(state="missing", reason=f"serves {txn.served!r} from {root}, not {txn.path}")
                return EngineAnswer(url, False, None, state["reason"])
            health = await engines.health(url)
            if not health.ok:
                state.update(state="missing", reason=f"/health failed after the load: {health.detail}")
                return EngineAnswer(url, False, None, state["reason"])
        state.update(state="verified", reason="")
        return EngineAnswer(url, True, 200)

    async def _canary_failed(self, txn: AdapterTxn, canary: str, why: str) -> None:
        """The transaction ends at the canary: no other engine asked, its half-load undone, the canary
        held out only when it stopped answering."""
        for u, e in txn.engines.items():
            if u != canary:
                e.update(state="untouched", reason="not asked: the canary failed")
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
    async def _timed(self, txn: AdapterTxn, phase: str, step: Awaitable[Any]) -> Any:
        txn.phase = phase
        t0 = time.monotonic()
        try:
            return await step
        finally:
            failed = {u: e["reason"] for u, e in txn.engines.items() if e["state"] == "missing"}
            txn.steps.append({"phase": phase, "took_s": round(time.monotonic() - t0, 4), "failed": failed})

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
