"""The fronts a fleet can sit behind, chosen by the spec's ``router.kind``: one package per kind, each
declaring itself (``front.FrontKind``) in the registry (``kinds.GATEWAY_KINDS``) and running behind one
interface (``base.Gateway``)."""

from __future__ import annotations

from launcher.gateways.base import (
    Gateway,
    GatewayContext,
    GatewayError,
    GatewayMember,
    GatewayView,
    gateway_class,
    make_gateway,
)
from launcher.gateways.kinds import GATEWAY_KINDS

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
