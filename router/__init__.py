"""The generation router: one stable URL in front of a fleet of vLLM (or vLLM-compatible) engines."""

from router.backends import canonical_backend_url
from router.server import PROXIED_ROUTES, GenerationRouter, RouterBindError

__all__ = ["PROXIED_ROUTES", "GenerationRouter", "RouterBindError", "canonical_backend_url"]
