"""The routing state a request consults: one object per router, whatever the number of processes.

A request asks the state three things: *where to* (``dispatch``: the policy chooses, learns the choice and
counts the request in flight, in one step so that no other request can decide between the choice and the
count), *done* (``release``) and *how it went* (``succeeded`` / ``failed``). ``LocalRouting`` answers in this
process; ``router.multiprocess.remote.RemoteRouting`` answers from the router's parent process, so that
every worker process routes with the same prefix index, in-flight and byte counts and serving set: affinity
and the load bound are then exactly those of one process.

A generation request asks *where to* with ``hold``: while the fleet is paused for a weight update the
state holds it at its ``PauseGate`` before choosing, so the one gate bounds every request of the router,
whichever process parsed it, and no generation request is routed to an engine between the pause and the
resume.

Weight versions (``router.state.versions``): *where to* answers the engine's version as the routing state
knows it at that instant (``Chosen``), which the response carries and *done* gives back, so that a request
whose engine was stamped with another version while it was in flight is counted as a straddler. A
generation request may be gated on a version (``want``): it goes only to a serving engine that satisfies it
(the others are excluded from the policy's choice), and while none does it is held, after the pause gate,
until one does, bounded in count by the gate's ``max_held`` and in time by ``version_max_wait_s`` (shorter
than a pause's by default: a version that is coming comes with a refit, which the pause gate already
held it through). A version the fleet does not know, or will not serve again (no engine it keeps has it,
and it is neither the fleet's current version nor the pending refit's target), is refused at once
(``UnknownVersion``) instead of held for a version that never comes.

Consumers (``router.consumers``): a generation request names the consumer that sent it, and when the router
keeps a consumer ledger (``router.state.fair_share.FairShare``: a consumers file or a fair-share capacity)
*where to* also takes one of the fleet's fair-share slots, after the pause and version holds, waiting for
one while the fleet is at capacity; *finished* (``finish``) gives it back and counts the request and its
completion tokens. A request that would wait for any of them (the pause, a version, a slot) is counted
against its consumer first (``FairShare.hold``) and refused at once past the consumer's bound, so the
holds, like the slots, are shared: one consumer cannot fill what the router holds for all of them.
Here, in the one routing state, so that the capacity, the shares and the holds are exact whatever the
number of worker processes.

What held a request (``router.state.holds``): the pause gate and the fair share add the seconds they held
it to the ``Holds`` that ``dispatch`` gives them, and ``dispatch`` answers them on ``Chosen.held`` (or
leaves them on the exception it raises), for the request's record.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import NamedTuple, Protocol

from router.consumers import Consumer
from router.policies.base import NoBackendAvailable, Policy, RouteRequest
from router.state.backends import BackendSet
from router.state.fair_share import FairShare
from router.state.holds import NO_HOLDS, Holds, leave_on
from router.state.metrics import RouterMetrics
from router.state.pause_gate import PauseGate
from router.state.versions import VersionRefused, VersionWant

# Failures of the backend's transport (not of one answer): with ``health_managed`` they take the backend
# out of rotation at once. A 5xx is not among them: one poisoned request answered 500 by every engine
# would otherwise eject the whole fleet. What is reported at all is the forwarder's call
# (``router.http.attribution``): a 5xx or a timeout only once another engine served the same request, so
# a request that fails everywhere is charged to no engine.
TRANSPORT_FAILURES = frozenset({"connect", "reset", "timeout", "headers_too_large", "stream_broken"})


class Chosen(NamedTuple):
    """Where ``dispatch`` sent a request, that engine's weight version then (None: unknown), and what
    held the request before (``router.state.holds``: ``{"pause": s, "share": s}``, empty when nothing)."""

    url: str
    version: str | None
    held: Mapping[str, float] = NO_HOLDS


class RoutingState(Protocol):
    async def dispatch(
        self,
        request: RouteRequest,
        exclude: frozenset[str],
        hold: bool = False,
        want: VersionWant | None = None,
        consumer: Consumer | None = None,
    ) -> Chosen:
        """Choose a backend, record the choice (``Policy.commit``) and count the request in flight with
        ``request.size`` bytes; raises ``NoBackendAvailable``. ``hold``: wait first while the fleet is
        paused; raises ``PauseRefused`` past the gate's bounds. ``want``: only a serving engine whose
        version satisfies it; raises ``UnknownVersion`` at once for a version the fleet does not know,
        and with ``hold`` waits while no serving engine satisfies it (``VersionRefused`` past the gate's
        bounds; without ``hold``, ``NoBackendAvailable`` at once). ``consumer`` (with ``hold``, where the
        state keeps a consumer ledger): then take one of the consumer's fair-share slots, waiting while
        the fleet is at capacity (``FairShareRefused`` past the bound); a normal return holds the slot,
        which ``finish`` gives back. What held the request is on the answer (``Chosen.held``), or on
        the exception raised after a hold (``router.state.holds.holds_of``)."""
        ...

    def finish(self, consumer: str, completion_tokens: int = 0, counted: bool = True) -> None:
        """The request of ``consumer`` that ``dispatch`` gave a slot is over: give the slot back, and with
        ``counted`` (it reached an engine) count it with the engine's ``completion_tokens``."""
        ...

    def release(
        self, url: str, weight: int, dispatched_on: str | None = None, request_id: str | None = None
    ) -> None:
        """The request sent to ``url`` by ``dispatch`` is over (whatever its outcome). ``dispatched_on``:
        the version ``dispatch`` answered (``Chosen.version``), ``request_id`` the id a straddler is
        listed by."""
        ...

    def succeeded(self, url: str) -> None: ...

    def failed(self, request: RouteRequest, url: str, kind: str) -> None:
        """The attempt on ``url`` failed: forget its affinity, count the failure, and take a backend whose
        transport failed out of rotation when a fleet controller owns the serving set. An empty ``kind``:
        forget the affinity only (a failure not charged to the engine, ``router.http.attribution``)."""
        ...


class LocalRouting:
    """The state in this process: the policy, the serving set and the load counts, all on one loop."""

    def __init__(
        self,
        backends: BackendSet,
        policy: Policy,
        metrics: RouterMetrics,
        health_managed: bool,
        gate: PauseGate | None = None,
        fair: FairShare | None = None,
        version_max_wait_s: float | None = None,
    ) -> None:
        """``fair``: the consumer ledger and fair-share admission (None: consumers are not told apart,
        and a request's ``consumer`` is ignored). ``version_max_wait_s``: the longest a request waits
        for an engine with its version once the fleet is not paused (None: the gate's ``max_wait_s``)."""
        self.gate = gate if gate is not None else PauseGate()
        self.fair = fair
        self.version_max_wait_s = (
            version_max_wait_s if version_max_wait_s is not None else self.gate.max_wait_s
        )
        self.backends = backends
        self.policy = policy
        self.metrics = metrics
        self.health_managed = health_managed
        self.versions = backends.versions

    def dispatch_now(self, request: RouteRequest, exclude: frozenset[str]) -> str:
        url = self.policy.choose(request, self.backends.load, exclude)
        self.metrics.decisions += 1
        self.policy.commit(request, url)
        self.backends.load.acquire(url, request.size)
        return url

    async def dispatch(
        self,
        request: RouteRequest,
        exclude: frozenset[str],
        hold: bool = False,
        want: VersionWant | None = None,
        consumer: Consumer | None = None,
    ) -> Chosen:
        fair = self.fair
        if hold and consumer is not None and fair is not None:
            held = Holds()
            try:
                exclude = await self.enter(exclude, want, consumer, held)
                try:
                    url = self.dispatch_now(request, exclude)
                except BaseException:
                    fair.leave(consumer.name)
                    raise
            except BaseException as exc:
                leave_on(exc, held)
                raise
            return Chosen(url, self.versions.of.get(url) or None, held or NO_HOLDS)
        if want is not None or (hold and self.gate.paused):  # the one check when neither
            held = Holds()
            try:
                exclude = await self.admit(exclude, hold, want, held)
                url = self.dispatch_now(request, exclude)
            except BaseException as exc:
                leave_on(exc, held)
                raise
            return Chosen(url, self.versions.of.get(url) or None, held or NO_HOLDS)
        url = self.dispatch_now(request, exclude)
        return Chosen(url, self.versions.of.get(url) or None)

    # -- a consumer's fair-share slot, after the holds ---------------------------------------------------
    def enter_now(
        self, exclude: frozenset[str], want: VersionWant | None, consumer: Consumer
    ) -> frozenset[str] | None:
        """``admit_now`` for a generation request of ``consumer``, then its fair-share slot if one is free
        (then held); None when it would wait for either. Raises as ``admit_now`` does."""
        assert self.fair is not None
        admitted = self.admit_now(exclude, True, want)
        if admitted is None or not self.fair.try_enter(consumer.name, consumer.weight):
            return None
        return admitted

    async def enter(
        self,
        exclude: frozenset[str],
        want: VersionWant | None,
        consumer: Consumer,
        held: Holds | None = None,
    ) -> frozenset[str]:
        """The pause gate and the version gate (``admit``), then a fair-share slot (held on return). A
        request that got its slot after the fleet paused, or lost its version, gives the slot back and
        goes through the holds again: no request reaches an engine between a pause and its resume, and
        none sits on a slot while it waits for a version. A request that has to wait for any of them is
        one of its consumer's held requests until it has its slot (``FairShareRefused`` at once past the
        consumer's bound). ``held``: where the gate and the fair share add the seconds they held it."""
        fair = self.fair
        assert fair is not None
        admitted = self.enter_now(exclude, want, consumer)
        if admitted is not None:
            return admitted
        fair.hold(consumer.name, consumer.weight)
        try:
            while True:
                if want is not None or self.gate.paused:
                    await self.admit(exclude, True, want, held)
                await fair.enter(consumer.name, consumer.weight, held)
                try:
                    admitted = self.admit_now(exclude, True, want)
                except BaseException:
                    fair.leave(consumer.name)
                    raise
                if admitted is not None:
                    return admitted
                fair.leave(consumer.name)
        finally:
            fair.unhold(consumer.name)

    def finish(self, consumer: str, completion_tokens: int = 0, counted: bool = True) -> None:
        if self.fair is not None:
            self.fair.finish(consumer, completion_tokens, counted)

    # -- holding: the pause gate, then the version a request is gated on ---------------------------------
    def admit_now(
        self, exclude: frozenset[str], hold: bool, want: VersionWant | None
    ) -> frozenset[str] | None:
        """What ``admit`` answers when it need not wait; None when it would (paused, or no serving engine
        satisfies ``want`` and ``hold``). Raises ``UnknownVersion``, or ``NoBackendAvailable`` when no
        serving engine satisfies ``want`` and the request may not wait."""
        if hold and self.gate.paused:
            if want is not None:
                self.versions.check(want, self._kept())  # refused at once, not after the pause
            return None
        if want is None:
            return exclude
        return self._gated(exclude, hold, want)

    def _gated(self, exclude: frozenset[str], hold: bool, want: VersionWant) -> frozenset[str] | None:
        versions = self.versions
        serving = self.backends.serving
        unfit = versions.excluded_for(want, serving)
        if len(unfit) < len(serving):
            return exclude | unfit if unfit else exclude
        if hold:
            versions.check(want, self._kept())  # held only for a version that may still come
            return None
        versions.check(want)
        raise NoBackendAvailable(versions.unsatisfied(want, serving))

    def _kept(self) -> tuple[str, ...]:
        """The engines whose versions a held request may still get: the serving ones and those ejected
        for the moment (the prober re-admits them), not those held out as stale (they come back only on
        the fleet's current version, which ``WeightVersions.check`` counts by itself)."""
        backends = self.backends
        ejected = backends.ejected
        if not ejected:
            return backends.serving
        stale = backends.stale
        return (*backends.serving, *(u for u in ejected if u not in stale))

    async def admit(
        self,
        exclude: frozenset[str],
        hold: bool,
        want: VersionWant | None,
        held: Holds | None = None,
    ) -> frozenset[str]:
        """Wait while the fleet is paused (``hold``), then while no serving engine satisfies ``want``;
        answer ``exclude`` plus the serving engines that do not satisfy ``want``. A request held for a
        version goes through the pause gate again if the fleet paused meanwhile: no request reaches an
        engine between a pause and its resume. ``held``: where the pause gate adds the seconds it held
        the request (the version gate's share is timed by the caller, ``router.state.holds.GATE``)."""
        versions = self.versions
        gate = self.gate
        max_wait_s = self.version_max_wait_s
        loop = asyncio.get_running_loop()
        since: float | None = None
        try:
            while True:
                if hold and gate.paused:
                    if want is not None:
                        versions.check(want, self._kept())  # at once, before the pause holds it
                    await gate.pass_through(held)
                if want is None:
                    return exclude
                admitted = self._gated(exclude, hold, want)
                if admitted is not None:
                    return admitted
                now = loop.time()
                if since is None:
                    if versions.held >= gate.max_held:
                        raise self._refused(want, f"at most {gate.max_held} held for a version")
                    versions.held += 1
                    since = now
                remaining = since + max_wait_s - now
                if remaining <= 0:
                    raise self._refused(want, f"waited {now - since:.3g} s")
                try:
                    await asyncio.wait_for(versions.wait_change(), remaining)
                except TimeoutError:
                    raise self._refused(want, f"waited {max_wait_s:g} s") from None
        finally:
            if since is not None:
                versions.held -= 1

    def _refused(self, want: VersionWant, bound: str) -> VersionRefused:
        self.versions.refused_total += 1
        reason = self.versions.unsatisfied(want, self.backends.serving)
        return VersionRefused(f"{reason}; request not held longer ({bound})")

    def release(
        self, url: str, weight: int, dispatched_on: str | None = None, request_id: str | None = None
    ) -> None:
        self.backends.load.release(url, weight)
        if dispatched_on is not None:
            self.versions.ended(url, dispatched_on, request_id)

    def succeeded(self, url: str) -> None:
        self.backends.record(url, True)

    def failed(self, request: RouteRequest, url: str, kind: str) -> None:
        self.policy.retract(request, url)
        if not kind:
            return
        self.backends.record(url, ok=False)
        if self.health_managed and kind in TRANSPORT_FAILURES:
            # The controller owns re-admission; taking the backend out now stops the next requests from
            # landing on it before the controller's next tick.
            self.backends.remove(url, move=False)
