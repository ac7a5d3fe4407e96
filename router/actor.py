"""``GenerationRouterActor``: the router inside a Ray actor, meant for ``max_restarts=-1``.

Everything is built in ``__init__`` (policy, socket, serving thread) from constructor arguments only, so
when Ray restarts a dead actor it rebinds the very same host:port: the URL Gym was given stays valid.
The arguments are one ``RouterConfig`` (pickled by Ray, secrets included: they travel inside Ray's object
store, never in argv or a log) and the initial backend URLs. The port must be chosen once by the caller
(``router.ports.free_port``), never left to ``port=0``: a restarted actor would then come back elsewhere.
With ``config.workers > 1`` the actor is the parent of the worker processes (router.multiprocess.workers):
they inherit its socket, and when the actor dies they lose their channel to it and exit, so the restarted
actor can bind the port again (within ``ACTOR_MIN_BIND_RETRY_S``).
The serving set is not persisted: the fleet controller pushes the whole set every tick, so a restarted
router converges on the next tick.
"""

from __future__ import annotations

import os
from typing import Any

from router.config import RouterConfig
from router.server import GenerationRouter

ROUTER_ACTOR_NAME = "router"
"""The name of the router's Ray actor in the job's namespace: a training script or an operator attached to
the job's cluster finds it with ``ray.get_actor(ROUTER_ACTOR_NAME, namespace=...)``."""

# A restarted actor may start while the dead one's socket is still being torn down.
ACTOR_MIN_BIND_RETRY_S = 10.0


class GenerationRouterActor:
    def __init__(self, config: RouterConfig, backend_urls: list[str]) -> None:
        if config.port == 0:
            raise ValueError("GenerationRouterActor needs a fixed port (a restart must rebind the same URL)")
        if config.bind_retry_s < ACTOR_MIN_BIND_RETRY_S:
            config = config.model_copy(update={"bind_retry_s": ACTOR_MIN_BIND_RETRY_S})
        self._router = GenerationRouter(config, backend_urls)
        self._router.serve_in_background()

    def base_url(self) -> str:
        return self._router.base_url()

    def is_serving(self) -> bool:
        return self._router.is_serving()

    def set_serving_backends(self, urls: list[str]) -> list[str]:
        return self._router.set_serving_backends(urls)

    def serving_backends(self) -> list[str]:
        return self._router.serving_backends()

    def move_off(self, urls: list[str], reason: str) -> int:
        return self._router.move_off(urls, reason)

    def member_backends(self) -> list[tuple[str, bool]]:
        return self._router.member_backends()

    def drain_backend_outcomes(self) -> dict[str, tuple[int, int]]:
        return self._router.drain_backend_outcomes()

    def in_flight(self) -> dict[str, int]:
        return self._router.in_flight()

    def current_weight_version(self) -> str | None:
        return self._router.current_weight_version()

    def restore_weight_version(self, version: str) -> None:
        self._router.restore_weight_version(version)

    def stale_backends(self) -> dict[str, str]:
        return self._router.stale_backends()

    def restore_pause(self, mode: str = "keep") -> bool:
        return self._router.restore_pause(mode)

    def pid(self) -> int:
        return os.getpid()

    def worker_pids(self) -> list[int]:
        """The router's worker processes (``RouterConfig.workers > 1``); they exit when this actor dies."""
        return self._router.worker_pids()

    def stop(self) -> None:
        self._router.stop()


def remote_router_actor(num_cpus: float = 1.0, **options: Any) -> Any:
    """The Ray actor class with restart-forever options (import Ray lazily: the router runs without it)."""
    import ray

    return ray.remote(num_cpus=num_cpus, max_restarts=-1, max_task_retries=-1, **options)(
        GenerationRouterActor
    )
