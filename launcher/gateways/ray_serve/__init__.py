"""``router.kind: ray-serve`` (see ``gateway``): a Ray Serve application whose replicas own the engines."""

from launcher.gateways.ray_serve.gateway import RayServeGateway

__all__ = ["RayServeGateway"]
