"""``router.kind: ray-serve``: its ``router:`` section (our router's ``RouterSettings``: Serve routes with
our policy and keeps our status contract, plus ``serve_routing``) and what it declares."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from launcher.gateways.front import FrontKind, FrontSection
from launcher.spec.errors import Issue
from router.config import RouterSettings


class RayServeRouterSection(FrontSection, RouterSettings):
    kind: Literal["ray-serve"] = "ray-serve"
    serve_routing: Literal["policy", "power_of_two"] = Field(
        default="policy",
        description="route by our policy inside Serve (policy) or by Serve's default (power_of_two)",
    )


class RayServeFront(FrontKind[RayServeRouterSection]):
    name = "ray-serve"
    section = RayServeRouterSection
    gateway = "launcher.gateways.ray_serve.gateway:RayServeGateway"
    has_fleet_routes = True  # served by the driver beside Serve (launcher.gateways.fleet_endpoint)
    owns_engines = True
    engines_take_client_key = True  # each replica forwards the client's headers to its engine
    no_elastic_why = (
        "router.kind ray-serve places its replicas itself inside the job's Ray cluster (Serve's own "
        "num_replicas and autoscaling move them between the nodes that cluster has); rl-launch adds no Slurm "
        "node under it and takes none away, so fleet grow and shrink are refused. Size the allocation "
        "(generation.nodes), or use router.kind builtin or vllm-router for an elastic fleet"
    )
    bench_arm = "launcher.gateways.ray_serve.bench_arm:ray_serve_arm"

    def rules(self, router: RayServeRouterSection, cluster: str) -> list[Issue]:
        if "workers" in router.model_fields_set:
            # Serve's ingress replica proxies, not our router's process: the count would be silently ignored.
            return [
                Issue(
                    "router.workers",
                    "only for router.kind: builtin (the builtin router's worker processes); remove it",
                )
            ]
        return []

    def label(self, router: RayServeRouterSection) -> str:
        if router.serve_routing == "policy":
            return f"ray-serve: {router.policy} over Serve"
        return f"ray-serve: Serve's {router.serve_routing}"

    def policy(self, router: RayServeRouterSection) -> str:
        return router.policy if router.serve_routing == "policy" else router.serve_routing


RAY_SERVE = RayServeFront()
