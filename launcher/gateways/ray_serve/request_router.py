"""Our routing policies inside Ray Serve's request routing (``ray.serve.request_router``, Ray >= 2.46).

Serve's default router picks two random replicas and takes the shorter queue: a multi-turn session's
next turn lands on an arbitrary replica and recomputes its whole context. ``PolicyRequestRouter`` puts
the same pure policy object our router uses (``router.policies``, ``cache_aware`` by default) in Serve's
place: the backends it sees are replica ids, the load view (in flight, body bytes in flight) is kept
from Serve's own routed/completed callbacks, and the request it scores is the raw body the ingress
forwards (``EngineReplica.forward``'s arguments).

It runs where the handle is used, i.e. in the ingress replica (one: a second ingress would keep a second
prefix index, like two routers). The chosen replica is ranked first and the others after it, least loaded
first, so a replica that refuses (its ``max_ongoing_requests`` full) costs a fallback, not a stall.

``RETRY_EXCLUDE`` (a keyword argument of the call) names replicas that must not get this request: those
that already failed it (the retry lands elsewhere, as in our router) and those the refit window holds out
(``fleet_state``). ``ROUTED`` records, per route key, the replica chosen, so the ingress can tell which
replica failed before it answered a byte.

Serve's own power-of-two router (``router.serve_routing: power_of_two``) never reads the call's keyword
arguments: a retry could land on the replica that just failed, and a held-out replica would get requests.
``ExcludingPowerOfTwoRouter`` is that router with the exclusion applied to its candidates. It keeps Serve's
FIFO matching, under which the replica chosen for one pending request may be handed to an earlier one, so
a retry's own exclusion is best effort there; the held-out replicas are excluded from every request alike,
and a held-out replica refuses anything that reaches it (``replica.HELD_OUT_HEADER``).

When every candidate is excluded both routers return no replica and ask Serve to back off before it asks
again. Without that (read in Ray 2.60's ``_choose_replicas_with_backoff``, not measured) Serve asks again at
once unless the request's routing context says back off, and a ``choose_replicas`` that never suspends
makes that a loop that does not yield to the ingress's event loop. The ingress also stops retrying once
its exclusions cover every running replica, so this is the last guard, not the usual path.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from router.policies import LoadTracker, NoBackendAvailable, RouteRequest, make_policy

ROUTE_KEY = "route_key"
RETRY_EXCLUDE = "exclude"
# route key -> replica unique id, filled by the router in this (ingress) process, read by the ingress.
ROUTED: dict[str, str] = {}
_ROUTED_MAX = 100_000
_FLUSHES = 0
"""How many times this process's prefix indexes were to be forgotten (``flush_prefix_indexes``)."""


def flush_prefix_indexes() -> None:
    """The fleet moved to new weights, and the refit reset the engines' prefix caches: every
    ``PolicyRequestRouter`` in this (the ingress's) process forgets its prefix index before its next
    choice, as the builtin router's policy does in the refit itself (an index pointing at flushed caches
    costs hit rate, not correctness, so the ingress calls this when it sees the version change)."""
    global _FLUSHES
    _FLUSHES += 1


def _back_off(pending: PendingRequest | None) -> list[list[RunningReplica]]:
    """No replica for this request this round: Serve sleeps before it asks again (see the module)."""
    if pending is not None:
        pending.routing_context.should_backoff = True
    return []


def route_request(pending: PendingRequest | None) -> tuple[RouteRequest | None, frozenset[str]]:
    """The policy's view of a pending ``forward(method, path, query, headers, body)`` call."""
    if pending is None or len(pending.args) < 5:
        return None, frozenset()
    _method, path, _query, headers, body = pending.args[:5]
    exclude = frozenset(pending.kwargs.get(RETRY_EXCLUDE) or ())
    return RouteRequest(str(path), bytes(body), dict(headers)), exclude


class PolicyRequestRouter(RequestRouter):
    """A Serve request router that asks one of our policies (``policy``, ``policy_options``)."""

    def initialize_state(
        self, policy: str = "cache_aware", policy_options: dict[str, Any] | None = None
    ) -> None:
        self.policy = make_policy(policy, **dict(policy_options or {}))
        self.load = LoadTracker()
        self._members: tuple[str, ...] = ()
        self._weights: dict[str, tuple[str, int]] = {}
        # The prepared request of each pending one, until Serve says which replica got it: the policy
        # learns affinity from the dispatch (``Policy.commit``), not from its own choice, which Serve may
        # not follow (the replica it named can be full).
        self._prepared: dict[str, RouteRequest] = {}
        self._flushes = _FLUSHES

    def _sync(self, ids: list[str]) -> None:
        members = tuple(sorted(ids))
        if members != self._members:
            self._members = members
            self.load.set_backends(members)
            self.policy.on_backends_changed(members)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return _back_off(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        self._sync(list(self.curr_replicas_ids()) or list(by_id))
        if self._flushes != _FLUSHES:
            self._flushes = _FLUSHES
            self.policy.reset_cache_state()
        request, exclude = route_request(pending_request)
        chosen: str | None = None
        if request is not None:
            prepared = self.policy.prepare(request)
            try:
                chosen = self.policy.choose(prepared, self.load, exclude)
            except NoBackendAvailable:
                chosen = None
            if pending_request is not None:
                if len(self._prepared) > _ROUTED_MAX:
                    self._prepared.clear()
                self._prepared[pending_request.metadata.internal_request_id] = prepared
        rest = sorted(
            (r for rid, r in by_id.items() if rid != chosen and rid not in exclude),
            key=lambda r: self.load.in_flight(r.replica_id.unique_id),
        )
        first = [by_id[chosen]] if chosen in by_id else []
        ranks = [first, rest] if first else [rest]
        if pending_request is not None and chosen is not None:
            key = pending_request.kwargs.get(ROUTE_KEY)
            if key:
                if len(ROUTED) > _ROUTED_MAX:
                    ROUTED.clear()
                ROUTED[str(key)] = chosen
        return [rank for rank in ranks if rank] or _back_off(pending_request)

    def curr_replicas_ids(self) -> list[str]:
        return [rid.unique_id for rid in self.curr_replicas]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        rid = replica_id.unique_id
        prepared = self._prepared.pop(pending_request.metadata.internal_request_id, None)
        if prepared is not None:
            self.policy.commit(prepared, rid)
        weight = len(pending_request.args[4]) if len(pending_request.args) >= 5 else 0
        self.load.acquire(rid, weight)
        self._weights[pending_request.metadata.internal_request_id] = (rid, weight)
        key = pending_request.kwargs.get(ROUTE_KEY)
        if key:
            ROUTED[str(key)] = rid

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid, weight = self._weights.pop(internal_request_id, (replica_id.unique_id, 0))
        self.load.release(rid, weight)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._sync([r for r in self.curr_replicas_ids() if r != replica_id.unique_id])


class ExcludingPowerOfTwoRouter(PowerOfTwoChoicesRequestRouter):
    """Serve's power-of-two choices among the replicas the call does not exclude (see the module)."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        _request, exclude = route_request(pending_request)
        if not exclude:
            return await super().choose_replicas(candidate_replicas, pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        # Serve's locality order (this node first, then everywhere), then two random ones of what is left
        # (the queue-length probe of the base class picks the shorter).
        ids = [rid for rid in self.apply_locality_routing(pending_request) if rid.unique_id not in exclude]
        allowed = [by_id[rid] for rid in ids if rid in by_id]
        if not allowed:
            if pending_request is not None and not pending_request.routing_context.should_backoff:
                return []  # only this node's were asked: Serve widens to every node at once
            return _back_off(pending_request)
        return [random.sample(allowed, min(2, len(allowed)))]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        # Which replica got it, as with our policy's router: a replica that fails before its first byte
        # is then excluded from the retry.
        key = pending_request.kwargs.get(ROUTE_KEY)
        if key:
            if len(ROUTED) > _ROUTED_MAX:
                ROUTED.clear()
            ROUTED[str(key)] = replica_id.unique_id
