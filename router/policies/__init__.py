"""Routing policies: pure objects behind one interface (``Policy.choose``), shared by router, bench, tests."""

from __future__ import annotations

from typing import Any

from router.policies.base import LoadTracker, NoBackendAvailable, Policy, RouteRequest
from router.policies.cache_aware import CacheAware
from router.policies.consistent_hash import DEFAULT_SESSION_HEADER, ConsistentHash
from router.policies.simple import LeastOutstanding, RoundRobin

POLICIES: dict[str, type[Policy]] = {
    "round_robin": RoundRobin,
    "least_outstanding": LeastOutstanding,
    "consistent_hash": ConsistentHash,
    "cache_aware": CacheAware,
}
DEFAULT_POLICY = "cache_aware"


def make_policy(name: str, **options: Any) -> Policy:
    """Build a policy by name; an unknown name raises ``ValueError`` listing the known ones."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of: {', '.join(POLICIES)}") from None
    return cls(**options)


__all__ = [
    "DEFAULT_POLICY",
    "DEFAULT_SESSION_HEADER",
    "POLICIES",
    "CacheAware",
    "ConsistentHash",
    "LeastOutstanding",
    "LoadTracker",
    "NoBackendAvailable",
    "Policy",
    "RoundRobin",
    "RouteRequest",
    "make_policy",
]
