"""``ForwardingConfig``: the forwarding part of a router's config, the same in every process of the router.

Apart from ``router.http.forwarding`` (which re-exports it) so that module stays about the proxy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.config import RouterConfig


@dataclass
class ForwardingConfig:
    backend_timeout_s: float
    connect_timeout_s: float
    no_healthy_backend_status: int
    max_attempts: int = 2
    retry_on_timeout: bool = True
    health_managed: bool = False
    backend_api_key: str | None = None
    max_request_bytes: int = 64 * 1024 * 1024
    consumer_accounting: bool = False
    drop_client_auth: bool = False
    record_text: bool = False
    continuation_max_moves: int = 3

    @classmethod
    def of(cls, config: RouterConfig) -> ForwardingConfig:
        """The forwarding part of a router's config: one mapping for every process of the router, so a
        new setting cannot reach one and miss another. With a consumers file the engines get the owner's
        key in place of the client's (module doc); under a capability no key, the client's dropped."""
        consumers_engine_key = config.secret("api_key") if config.consumers_file is not None else None
        registered = config.registration_capability is not None  # engines: any URL its holder named
        return cls(
            backend_timeout_s=config.backend_timeout_s,
            connect_timeout_s=config.connect_timeout_s,
            no_healthy_backend_status=config.no_healthy_backend_status,
            max_attempts=config.max_attempts,
            retry_on_timeout=config.retry_on_timeout,
            health_managed=config.health_managed,
            backend_api_key=None if registered else config.secret("backend_api_key") or consumers_engine_key,
            max_request_bytes=config.max_request_bytes,
            consumer_accounting=config.consumer_accounting,
            drop_client_auth=config.consumers_file is not None or registered,
            record_text=config.record_text,
            continuation_max_moves=config.continuation_max_moves,
        )
