"""``router.kind: vllm-router``: its ``router:`` section (``mode``, ``url``, ``vllm_router``), the rules
across those fields and what it declares."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field

from launcher.gateways.front import FrontKind, FrontSection
from launcher.gateways.vllm_router.command import DEFAULT_VLLM_ROUTER_POLICY, VllmRouterSection, check_section
from launcher.spec.errors import Issue


class VllmRouterFrontSection(FrontSection):
    kind: Literal["vllm-router"] = "vllm-router"
    mode: Literal["managed", "external"] = Field(
        default="managed", description="vllm-router: start it (managed) or attach to a running one"
    )
    url: str | None = Field(default=None, description="external vllm-router's base URL (no /v1)")
    vllm_router: VllmRouterSection | None = None

    field_hints = {
        "policy": "set router.vllm_router.policy",
        "policy_options": "set router.vllm_router.policy",
    }


class VllmRouterFront(FrontKind[VllmRouterFrontSection]):
    name = "vllm-router"
    section = VllmRouterFrontSection
    gateway = "launcher.gateways.vllm_router.gateway:VllmRouterGateway"
    has_fleet_routes = True  # served by the driver beside it (fleet_endpoint)
    forwards_client_key = True  # vllm-router passes each client's Authorization on to the worker it picks
    engines_take_client_key = True  # so its engines take the client's key
    bench_arm = "launcher.gateways.vllm_router.bench_arm:vllm_router_arm"

    def rules(self, router: VllmRouterFrontSection, cluster: str) -> list[Issue]:
        r, issues = router, []
        if r.mode == "external":
            if not r.url:
                issues.append(
                    Issue(
                        "router.url",
                        "required with router.mode: external: the running "
                        "vllm-router's base URL, e.g. http://router-host:30000",
                    )
                )
            elif not re.fullmatch(r"https?://[^/\s]+/?", r.url):
                issues.append(
                    Issue(
                        "router.url",
                        f"{r.url!r} is not a base URL; give http://HOST:PORT "
                        "(no path: the engines and Gym's /v1 are added by rl-launch)",
                    )
                )
            if r.vllm_router is not None:
                issues.append(
                    Issue(
                        "router.vllm_router",
                        "an external vllm-router's policy and options are "
                        "its owner's; remove it (or use router.mode: managed)",
                    )
                )
        else:
            if r.url is not None:
                issues.append(
                    Issue(
                        "router.url",
                        "only for router.mode: external (a managed vllm-router "
                        "listens on the port rl-launch reserves); remove it",
                    )
                )
            issues += [Issue(path, message) for path, message in check_section(r.vllm_router)]
        return issues

    def label(self, router: VllmRouterFrontSection) -> str:
        if router.mode == "external":
            return f"vllm-router (external) at {router.url}"
        return f"vllm-router (managed): {self.policy(router)}"

    def summary(self, router: VllmRouterFrontSection) -> str:
        return self.label(router) if router.mode == "external" else super().summary(router)

    def policy(self, router: VllmRouterFrontSection) -> str:
        if router.mode == "external":
            return "external (its owner's policy)"
        return router.vllm_router.policy if router.vllm_router else DEFAULT_VLLM_ROUTER_POLICY


VLLM_ROUTER = VllmRouterFront()
