"""Moved to ``launcher.gateways.fleet_endpoint`` (more than one front kind starts it); this name is kept
only so that imports of the old path keep working until they move, and adds nothing."""

from launcher.gateways.fleet_endpoint import FleetEndpoint

__all__ = ["FleetEndpoint"]
