"""``router.kind: builtin`` (the default): rl-launch's own router, its ``router:`` section (the router's
own ``RouterSettings``, validated there, once) and what it declares."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from launcher.gateways.front import FrontKind, FrontSection
from router.config import RouterSettings


class BuiltinRouterSection(FrontSection, RouterSettings):
    """``RouterSettings`` for our own router, plus where the driver reserves its port. The driver hands
    these settings whole to ``RouterConfig.from_settings``; nothing is copied field by field."""

    kind: Literal["builtin"] = Field(default="builtin", description="the front in front of the fleet")


class BuiltinFront(FrontKind[BuiltinRouterSection]):
    name = "builtin"
    section = BuiltinRouterSection
    gateway = "launcher.gateways.builtin.gateway:BuiltinRouterGateway"
    has_fleet_routes = True
    serves_consumers = True  # router.consumers: per-job keys, revocation, fair share
    serves_adapters = True  # router.adapters: the adapter table, in its one routing process
    serves_registrations = True  # router.http.capability: NeMo-RL's /workers flow, probed by the router
    resets_through_fleet_route = True  # its route also clears the router's prefix index
    dies_with_ray = True  # a Ray actor on the driver's node: it goes with the Ray head

    def label(self, router: BuiltinRouterSection) -> str:
        return f"builtin router: {router.policy}"

    def policy(self, router: BuiltinRouterSection) -> str:
        return router.policy


BUILTIN = BuiltinFront()
