"""The fronts a fleet can sit behind, chosen by the spec's ``router.kind`` (see ``base.Gateway``)."""

from __future__ import annotations

import importlib

from launcher.gateways.base import Gateway, GatewayContext, GatewayError, GatewayMember, GatewayView

# kind -> (module, class); imported on use, so a kind's heavy dependencies (Ray Serve, Dynamo) load only
# when a job asks for that kind.
GATEWAY_KINDS: dict[str, tuple[str, str]] = {
    "builtin": ("launcher.gateways.builtin.gateway", "BuiltinRouterGateway"),
    "vllm-router": ("launcher.gateways.vllm_router.gateway", "VllmRouterGateway"),
    "dynamo": ("launcher.gateways.dynamo.gateway", "DynamoGateway"),
    "ray-serve": ("launcher.gateways.ray_serve.gateway", "RayServeGateway"),
}


def gateway_class(kind: str) -> type[Gateway]:
    try:
        module, name = GATEWAY_KINDS[kind]
    except KeyError:
        known = ", ".join(GATEWAY_KINDS)
        raise GatewayError(f"unknown router.kind {kind!r}; choose one of: {known}") from None
    cls: type[Gateway] = getattr(importlib.import_module(module), name)
    return cls


def make_gateway(kind: str, context: GatewayContext) -> Gateway:
    gateway = gateway_class(kind)(context)
    assert isinstance(gateway, Gateway)
    return gateway


__all__ = [
    "GATEWAY_KINDS",
    "Gateway",
    "GatewayContext",
    "GatewayError",
    "GatewayMember",
    "GatewayView",
    "gateway_class",
    "make_gateway",
]
