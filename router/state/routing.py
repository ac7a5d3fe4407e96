"""The routing state a request consults: one object per router, whatever the number of processes.

A request asks the state three things: *where to* (``dispatch``: the policy chooses, learns the choice and
counts the request in flight, in one step so that no other request can decide between the choice and the
count), *done* (``release``) and *how it went* (``succeeded`` / ``failed``). ``LocalRouting`` answers in this
process; ``router.multiprocess.decisions.RemoteRouting`` answers from the router's parent process, so that
every worker process routes with the same prefix index, in-flight and byte counts and serving set: affinity
and the load bound are then exactly those of one process.

A generation request asks *where to* with ``hold``: while the fleet is paused for a weight update the
state holds it at its ``PauseGate`` before choosing, so the one gate bounds every request of the router,
whichever process parsed it, and no generation request is routed to an engine between the pause and the
resume.
"""

from __future__ import annotations

from typing import Protocol

from router.policies.base import Policy, RouteRequest
from router.state.backends import BackendSet
from router.state.metrics import RouterMetrics
from router.state.pause_gate import PauseGate

# Failures of the backend's transport (not of one answer): with ``health_managed`` they take the backend
# out of rotation at once. A 5xx is not among them: one poisoned request answered 500 by every engine
# would otherwise eject the whole fleet; it is reported to the health controller as a failure instead.
TRANSPORT_FAILURES = frozenset({"connect", "reset", "timeout", "headers_too_large", "stream_broken"})


class RoutingState(Protocol):
    async def dispatch(self, request: RouteRequest, exclude: frozenset[str], hold: bool = False) -> str:
        """Choose a backend, record the choice (``Policy.commit``) and count the request in flight with
        ``request.size`` bytes; raises ``NoBackendAvailable``. ``hold``: wait first while the fleet is
        paused; raises ``PauseRefused`` past the gate's bounds."""
        ...

    def release(self, url: str, weight: int) -> None:
        """The request sent to ``url`` by ``dispatch`` is over (whatever its outcome)."""
        ...

    def succeeded(self, url: str) -> None: ...

    def failed(self, request: RouteRequest, url: str, kind: str) -> None:
        """The attempt on ``url`` failed: forget its affinity, count the failure, and take a backend whose
        transport failed out of rotation when a fleet controller owns the serving set."""
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
    ) -> None:
        self.gate = gate if gate is not None else PauseGate()
        self.backends = backends
        self.policy = policy
        self.metrics = metrics
        self.health_managed = health_managed

    def dispatch_now(self, request: RouteRequest, exclude: frozenset[str]) -> str:
        url = self.policy.choose(request, self.backends.load, exclude)
        self.metrics.decisions += 1
        self.policy.commit(request, url)
        self.backends.load.acquire(url, request.size)
        return url

    async def dispatch(self, request: RouteRequest, exclude: frozenset[str], hold: bool = False) -> str:
        if hold and self.gate.paused:  # the one check when not paused
            await self.gate.pass_through()
        return self.dispatch_now(request, exclude)

    def release(self, url: str, weight: int) -> None:
        self.backends.load.release(url, weight)

    def succeeded(self, url: str) -> None:
        self.backends.record(url, True)

    def failed(self, request: RouteRequest, url: str, kind: str) -> None:
        self.policy.retract(request, url)
        self.backends.record(url, ok=False)
        if self.health_managed and kind in TRANSPORT_FAILURES:
            # The controller owns re-admission; taking the backend out now stops the next requests from
            # landing on it before the controller's next tick.
            self.backends.remove(url)
