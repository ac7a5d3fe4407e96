"""The router's table of the fleet's adapters: who owns each, which version serves, on which engines.

Every request whose ``model`` names an adapter is resolved here before a backend is chosen
(``AdapterTable.resolve``), and every adapter refit changes it only at its end
(``router.fleet.adapter_refit``), so a request either goes to the version before a refit or to the one
after, never to a mix:

* **Ownership.** An adapter belongs to the consumer that the fleet's spec reserved it for
  (``fleet.consumers.<job>.adapters``, carried by the consumers file), else to whoever first loaded it
  (the fleet's owner, or an admin consumer). Another consumer may neither call it (its requests are
  refused 403, never counted or sent to an engine) nor load or unload it. The fleet's owner may do
  everything. A tenant's adapter weights are its training run: another team sampling from them reads
  its results, and another team loading over them ruins its run.
* **Every served name has an owner.** Each ``NAME@VERSION`` the engines may hold (a version being
  loaded, the current one, one draining, one unloaded from some engines but not yet all) is kept with its
  owner (``names``) until its engines dropped it, and a request naming any ``NAME@VERSION`` is checked
  against that owner; a served name the table does not know is refused, never passed on. Before, a
  name outside the table (a draining version after its adapter's unload, any name after a router
  restart, any name while the table was empty) went to the engines as a base-model request, and they
  served another tenant's adapter to whoever asked.
* **Rebuilt after a restart.** The table lives in the router's memory; a restarted router starts with
  it not ``rebuilt`` and refuses every adapter-looking name (a reserved one, any ``NAME@VERSION``) until
  it has read what the engines hold (``router.adapters.adoption``, owners from the reservations).
* **Where a version is.** A version is routed only to the engines that loaded and verified it
  (``AdapterVersion.engines``): an engine that failed the load keeps serving the base model and the
  other adapters, and is never sent this adapter (vLLM would answer 404 "model does not exist" in the
  middle of a rollout).
* **Versions drain.** When a refit stamps a new version, the old one keeps the requests already in
  flight on it (they finish on the weights they started with) and is unloaded from its engines once
  none is left (``draining``), bounded by the refit code's drain deadline.
* **Capacity.** The plan's ``max_adapters`` bounds how many adapters the fleet serves; a load of one
  more is refused with the reason before any engine is touched (``admit_new``), rather than vLLM
  evicting an adapter from its cache and a tenant meeting the reload (or a 404, if its directory is
  gone) at rollout time. A reservation holds its slot: an unreserved name fits only in what the
  reservations not loaded yet leave (else one tenant's scratch adapters lock another out of the adapter
  the fleet's spec promised it).

The table lives on the loop of the router process (a router with worker processes is refused with
adapters, ``launcher.spec``): no lock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.adapters.names import served_name, split_served
from router.adapters.plan import LoraPlan
from router.consumers import OWNER
from router.state.versions import UnknownVersion, VersionWant


class AdapterForbidden(Exception):
    """A caller that may not use or change an adapter (answered 403, with the message)."""


class AdapterUnavailable(Exception):
    """An adapter that no engine serves now (answered the no-healthy-backend status: nothing a client
    retry fixes; its owner loads it)."""


class TableRebuilding(AdapterUnavailable):
    """An adapter-looking name asked for before the table holds what the engines serve (a restarted
    router): waited for a moment (``AdapterRequests.prepare``), then refused."""


class BaseModelNotServed(Exception):
    """A request that names no adapter on a fleet that serves its adapters only (answered 404)."""


class AdapterCapacity(Exception):
    """A load the fleet's LoRA plan has no room for (answered 409, with the reason)."""


@dataclass
class AdapterVersion:
    version: str
    served: str
    path: str
    rank: int
    engines: set[str] = field(default_factory=set)
    """The engines that loaded and verified it: the only ones its requests go to."""
    in_flight: int = 0
    stamped_at: float = field(default_factory=time.time)
    idle: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    """Set while no request is in flight on it: what its drain waits for."""
    digest: str = ""
    """The digest of its files as the load's check read them (``router.fleet.adapter_check``); what a
    restarted engine's restore compares the directory with (``router.fleet.adapter_restore``). Empty
    for a version adopted from the engines, whose files this router never read."""

    def __post_init__(self) -> None:
        self.idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        if not self.in_flight:
            self.idle.set()

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "served_name": self.served,
            "path": self.path,
            "rank": self.rank,
            "engines": sorted(self.engines),
            "in_flight": self.in_flight,
            "stamped_at": self.stamped_at,
        }


@dataclass
class Adapter:
    name: str
    owner: str
    """A consumer's name, or ``router.consumers.OWNER`` for the fleet's owner."""
    current: AdapterVersion | None = None
    draining: list[AdapterVersion] = field(default_factory=list)
    history: list[str] = field(default_factory=list)
    """Versions stamped, oldest first: what a gated request (``>=V``) is ordered by."""
    requests: int = 0

    def version(self, v: str) -> AdapterVersion | None:
        if self.current is not None and self.current.version == v:
            return self.current
        return next((d for d in self.draining if d.version == v), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "owner": self.owner,
            "version": self.current.version if self.current else None,
            "current": self.current.to_json() if self.current else None,
            "draining": [d.to_json() for d in self.draining],
            "versions": list(self.history[-20:]),
            "requests": self.requests,
        }


@dataclass(frozen=True)
class AdapterRoute:
    """Where one request for an adapter may go: ``served`` on one of ``engines``."""

    adapter: Adapter
    target: AdapterVersion

    @property
    def served(self) -> str:
        return self.target.served

    @property
    def version(self) -> str:
        return self.target.version


class AdapterTable:
    def __init__(self, plan: LoraPlan, reserved: Callable[[], dict[str, str]] | None = None) -> None:
        """``reserved``: adapter name -> the consumer the fleet's spec reserved it for (read from the
        consumers file each time; a consumer attached later brings its names with it)."""
        self.plan = plan
        self.adapters: dict[str, Adapter] = {}
        self._reserved = reserved or dict
        self.pending: dict[str, str] = {}
        """Adapter -> the version a refit in progress is loading (what a gated request may wait for)."""
        self.names: dict[str, str] = {}
        """Served name -> the owner of the version it names, for every name the engines may hold
        (loading, current, draining, unloading): kept until its engines dropped it (``forget``)."""
        self.rebuilt = False
        """Whether the table holds what the engines serve (``router.adapters.adoption``): until then
        every adapter-looking name is refused (a restarted router knows nothing of what they hold)."""
        self._changed = asyncio.Event()

    # -- who may ---------------------------------------------------------------------------------------
    def owner_of(self, name: str) -> str | None:
        """The adapter's owner: the consumer it is reserved for now, else its entry's (whoever loaded it
        first), else None (free). The reservation is read live: a consumer is a job, so a trainer
        resubmitted after its job ended attaches as a new consumer, and the fleet's spec reserving the
        adapter for its job name hands it the adapter its last run trained."""
        reserved = self._reserved().get(name)
        if reserved is not None:
            return reserved
        known = self.adapters.get(name)
        return known.owner if known is not None else None

    def owner_of_served(self, served: str) -> str | None:
        """The owner of a served name ``NAME@VERSION``: its adapter's reservation, else the owner the
        version was loaded for (kept while any engine may hold it), else None (not one of this fleet's)."""
        parts = split_served(served)
        if parts is None:
            return None
        reserved = self._reserved().get(parts[0])
        if reserved is not None:
            return reserved
        adapter = self.adapters.get(parts[0])
        if adapter is not None and adapter.version(parts[1]) is not None:
            return adapter.owner
        return self.names.get(served)

    def may_change(self, name: str, caller: str) -> None:
        """Raise ``AdapterForbidden`` unless ``caller`` (a consumer name, or OWNER) may load or unload
        ``name``."""
        owner = self.owner_of(name)
        if caller == OWNER or owner is None or owner == caller:
            return
        raise AdapterForbidden(
            f"adapter {name!r} belongs to consumer {owner!r}: {caller!r} may not load or unload it"
        )

    # -- requests ---------------------------------------------------------------------------------------
    def resolve(self, model: str, caller: str) -> AdapterRoute | None:
        """Where a request for ``model`` goes, when it names an adapter (or one of its served versions);
        None when it names none (the base model, or a plain name the engines judge: they serve adapters
        under ``NAME@VERSION`` only). ``caller``: the consumer's name, or OWNER. Raises
        ``AdapterForbidden`` / ``AdapterUnavailable``; every ``NAME@VERSION`` is checked against its
        owner, whether the table holds it or not (class doc)."""
        parts = split_served(model)
        if parts is None:
            adapter = self.adapters.get(model)
            if adapter is None:
                owner = self._reserved().get(model)
                if owner is None:
                    return None
                self._check_caller(model, owner, caller)
                self._check_rebuilt(model)
                raise AdapterUnavailable(
                    f"adapter {model!r} is not loaded on this fleet yet: its owner loads it first "
                    "(FleetClient.load_adapter, rl-launch fleet refit --adapter)"
                )
            self._check_caller(adapter.name, self.owner_of(adapter.name) or adapter.owner, caller)
            target = adapter.current
            if target is None:
                raise AdapterUnavailable(f"adapter {adapter.name!r} is not loaded on any engine")
        else:
            name, pinned = parts
            owner = self.owner_of_served(model)
            if owner is None:
                self._check_rebuilt(model)
                raise AdapterUnavailable(f"no adapter version {model!r} is served on this fleet")
            self._check_caller(name, owner, caller)
            self._check_rebuilt(model)
            adapter = self.adapters.get(name)
            target = adapter.version(pinned) if adapter is not None else None
            if adapter is None or target is None:
                current = adapter.current.version if adapter is not None and adapter.current else None
                raise AdapterUnavailable(
                    f"version {pinned!r} of adapter {name!r} is not served now (current: {current!r})"
                )
        if not target.engines:
            raise AdapterUnavailable(f"no engine serving adapter {target.served!r} is in the fleet")
        return AdapterRoute(adapter, target)

    def _check_rebuilt(self, model: str) -> None:
        if not self.rebuilt:
            raise TableRebuilding(
                f"{model!r}: the router is reading which adapters the engines hold (it restarted); "
                "retry in a moment"
            )

    @staticmethod
    def _check_caller(name: str, owner: str, caller: str) -> None:
        if caller != OWNER and caller != owner:
            raise AdapterForbidden(
                f"adapter {name!r} belongs to consumer {owner!r}: {caller!r} may not call it (use your "
                "own adapter, or the base model)"
            )

    def engines_left(self, url: str) -> None:
        """``url`` left the fleet (removed, or restarted without its adapters): no version is routed
        there until a load puts it back (``router.fleet.adapter_refit.AdapterRefits.restore``)."""
        for adapter in self.adapters.values():
            for v in (adapter.current, *adapter.draining):
                if v is not None:
                    v.engines.discard(url)

    # -- capacity and changes ----------------------------------------------------------------------------
    def admit_new(self, name: str) -> None:
        """Raise ``AdapterCapacity`` when ``name`` is a new adapter the plan has no room for: the loaded
        adapters and the new ones being loaded take a slot each, and an unreserved name fits only in
        what the reservations not loaded yet leave."""
        if name in self.adapters:
            return
        taken = set(self.adapters) | {n for n in self.pending if n != name}
        most = self.plan.max_adapters
        held = sorted(n for n in self._reserved() if n not in taken and n != name)
        if name in self._reserved():
            held = []  # its own reservation is the slot it takes
        if len(taken) + len(held) >= most:
            owed = f"; reserved for consumers, not loaded yet: {', '.join(held)}" if held else ""
            raise AdapterCapacity(
                f"the fleet serves {len(taken)} adapters and holds {len(held)} slot(s) for reserved ones, "
                f"the most its plan allows (generation.lora.max_adapters: {most}; loaded: "
                f"{', '.join(sorted(taken)) or 'none'}{owed}): unload one, or plan more"
            )

    def stamp(self, name: str, owner: str, new: AdapterVersion) -> AdapterVersion | None:
        """Make ``new`` the adapter's current version; the version it replaces (now draining) or None."""
        adapter = self.adapters.get(name)
        if adapter is None:
            adapter = self.adapters[name] = Adapter(name, owner)
        old = adapter.current
        adapter.current = new
        adapter.history.append(new.version)
        self.names[new.served] = adapter.owner
        if old is not None:
            adapter.draining.append(old)
        self.announce()
        return old

    def satisfies(self, route: AdapterRoute, want: VersionWant) -> AdapterRoute | None:
        """``route`` narrowed to ``want`` (a gated request's ``V`` or ``>=V``, on the adapter's versions):
        the current version when it satisfies it, a draining one asked for exactly, None while the
        version is the one a refit in progress is loading; ``UnknownVersion`` for any other."""
        adapter, history = route.adapter, route.adapter.history
        if want.version in history:
            if want.at_least:  # every version stamped is at or after one in the history: the current
                return AdapterRoute(adapter, adapter.current) if adapter.current else None
            exact = adapter.version(want.version)
            if exact is not None and exact.engines:
                return AdapterRoute(adapter, exact)
        if self.pending.get(adapter.name) == want.version:
            return None
        raise UnknownVersion(
            f"adapter {adapter.name!r} has no version {want.version!r} to serve (versions: "
            f"{', '.join(history[-5:]) or 'none'}; current: "
            f"{adapter.current.version if adapter.current else None!r})"
        )

    async def changed(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` for the next stamp of any adapter."""
        event = self._changed
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            pass

    async def until_rebuilt(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the table to be rebuilt; whether it is."""
        until = time.monotonic() + timeout_s
        while not self.rebuilt and (left := until - time.monotonic()) > 0:
            await self.changed(left)
        return self.rebuilt

    def announce(self) -> None:
        """Wake the requests waiting in ``changed`` (a stamp, or a refit that ended without one)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def forget(self, served: str) -> None:
        """No engine holds ``served`` any more: its owner need not be kept."""
        self.names.pop(served, None)

    def drop(self, name: str) -> Adapter | None:
        """Forget the adapter (after its unload); its versions' requests still in flight finish."""
        return self.adapters.pop(name, None)

    def served_on(self) -> dict[str, list[str]]:
        """Engine URL -> the served names it holds (current and draining), for the dashboard."""
        out: dict[str, list[str]] = {}
        for adapter in self.adapters.values():
            for v in (adapter.current, *adapter.draining):
                if v is not None:
                    for url in v.engines:
                        out.setdefault(url, []).append(v.served)
        return {u: sorted(names) for u, names in sorted(out.items())}

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": self.plan.model_dump(),
            "adapters": {
                n: {**a.to_json(), "owner": self.owner_of(n)} for n, a in sorted(self.adapters.items())
            },
            "reserved": dict(sorted(self._reserved().items())),
            "rebuilt": self.rebuilt,
            "engines": self.served_on(),
        }


def new_version(name: str, version: str, path: str, rank: int) -> AdapterVersion:
    return AdapterVersion(version, served_name(name, version), path, rank)
