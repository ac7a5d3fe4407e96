"""``router.kind: builtin``: rl-launch's own generation router, as a Ray actor restarted in place.

The actor (``router.actor.GenerationRouterActor``, ``max_restarts=-1``) is pinned to the driver's node and
built from one ``RouterConfig`` (the spec's router settings plus the reserved port, the job's secrets, and
``health_managed``: the fleet controller owns the serving set, so the router does not probe). A restarted
actor rebinds the same port and converges on the controller's next push.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from launcher.gateways.actors import stop_restartable_actor
from launcher.gateways.base import Gateway, GatewayError, GatewayMember, GatewayView
from launcher.gateways.builtin.kind import BUILTIN
from launcher.jobdir import EngineEntry, EngineListing

if TYPE_CHECKING:
    from router.config import RouterConfig

_CALL_TIMEOUT_S = 5.0


class BuiltinRouterGateway(Gateway):
    kind = BUILTIN.name
    binds_beside_port_hold = True  # the actor's restarts rebind a port no other user can take
    guards_weight_version = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.actor: Any = None
        self._url = ""
        self._registered: list[str] = []
        """Engines the trainer registered, as last read (``generation.owner: trainer``)."""
        self._actor_pid: int | None = None
        self._listed: dict[str, list[str]] = {}
        """Registered engines by host, append-only (``engine_listings``)."""
        self._config: RouterConfig | None = None
        """What the router actor was made with (its probing thresholds name a held-out engine's reason)."""

    def start(self, engine_urls: Sequence[str]) -> str:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from router.actor import ROUTER_ACTOR_NAME, remote_router_actor
        from router.config import RouterConfig

        ctx = self.context
        # The engines take the job's engine key: a client's key (the owner's, a consumer's) is replaced,
        # never passed on (the engines refuse it, and it is not theirs to see).
        sharing: dict[str, Any] = {"backend_api_key": ctx.engines_key}
        managed = True  # the fleet-health loop owns the serving set; no probing in the router
        if ctx.registration_capability:
            # Engines the trainer owns (generation.owner: trainer) take no key of ours (the engine key is
            # not sent to processes rl-launch did not start), the router probes them itself, and the
            # trainer registers them under the capability.
            sharing = {"registration_capability": ctx.registration_capability}
            managed = False
        if ctx.spec.fleet is not None:
            # A standing fleet: the consumers' keys (hashes) from the file their jobs register in, and
            # the fair share of the fleet's in-flight capacity between them (launcher.fleet.standing).
            from launcher.jobdir.paths import consumers_file

            sharing |= {
                "consumers_file": str(consumers_file(ctx.job.path)),
                "fair_share_capacity": ctx.spec.fleet.capacity,
            }
        config = RouterConfig.from_settings(
            ctx.spec.router,
            host=ctx.host,
            port=ctx.port,
            port_held=True,
            health_managed=managed,
            api_key=ctx.api_key,
            admin_token=ctx.admin_token,
            lora=ctx.spec.generation.lora,  # the adapter table checks each load against the engines' plan
            **sharing,
            **self.record_settings(),
        )
        actor_cls = remote_router_actor(
            num_cpus=0,
            name=ROUTER_ACTOR_NAME,
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_id=ray.get_runtime_context().get_node_id(), soft=False
            ),
        )
        self._config = config
        self.actor = actor_cls.remote(config, list(engine_urls))
        try:
            self._url = ray.get(self.actor.base_url.remote(), timeout=120)
        except Exception as exc:
            raise GatewayError(f"the router actor did not start on {ctx.host}:{ctx.port}: {exc}") from exc
        return self._url

    def base_url(self) -> str:
        return self._url

    def _get(self, ref: Any) -> Any:
        import ray

        return ray.get(ref, timeout=_CALL_TIMEOUT_S)

    def set_serving(self, urls: Sequence[str]) -> None:
        self._get(self.actor.set_serving_backends.remote(list(urls)))

    def move_off(self, urls: Sequence[str], reason: str) -> int:
        return int(self._get(self.actor.move_off.remote(list(urls), reason)))

    def drain_outcomes(self) -> dict[str, tuple[int, int]]:
        return dict(self._get(self.actor.drain_backend_outcomes.remote()))

    def weight_version(self) -> str | None:
        version = self._get(self.actor.current_weight_version.remote())
        return str(version) if version is not None else None

    def restore_weight_version(self, version: str) -> None:
        self._get(self.actor.restore_weight_version.remote(version))

    def stale_engines(self) -> dict[str, str]:
        return dict(self._get(self.actor.stale_backends.remote()))

    def restore_pause(self) -> bool:
        return bool(self._get(self.actor.restore_pause.remote("keep")))

    def fleet_url(self) -> str | None:
        return self._url or None

    def instance(self) -> str | None:
        return str(self._get(self.actor.pid.remote()))

    def view(self) -> GatewayView:
        try:
            if self.context.registration_capability:
                members = self._get(self.actor.member_backends.remote())
                why = self._held_out_why()
                judged = tuple(GatewayMember(u, bool(ok), "" if ok else why) for u, ok in members)
                return GatewayView(self.kind, self._url, True, judged)
            serving = self._get(self.actor.serving_backends.remote())
        except Exception as exc:
            return GatewayView(self.kind, self._url, False, detail=f"router actor unreachable: {exc!r}")
        return GatewayView(self.kind, self._url, True, tuple(GatewayMember(u, True) for u in serving))

    def _held_out_why(self) -> str:
        """Why the router holds a registered engine out, with the thresholds it judges by, for the
        dashboard's row (``launcher.fleet.registered``): nothing of ours restarts the trainer's engines."""
        c = self._config
        if c is None:
            return ""
        return (
            f"held out by the router: {c.probe_failures_to_eject} failed health probes or requests in a row; "
            f"probed on, readmitted after {c.probe_successes_to_readmit} passing probes. rl-launch does not "
            "restart it: the trainer owns the process"
        )

    def sync_owned_engines(self) -> None:
        """Engines the trainer registered survive a restart of the router actor: Ray restarts it with
        the engines it was made with (none), and NeMo-RL registers each replica once, so without this
        a router restart would leave the trainer's engines unreachable for the rest of the run. Each
        tick the members are read; an actor that came back (a new pid) is given the last ones seen,
        which its prober then judges like any member."""
        if not self.context.registration_capability:
            return
        pid = int(self._get(self.actor.pid.remote()))
        members = [u for u, _ in self._get(self.actor.member_backends.remote())]
        if self._actor_pid is not None and pid != self._actor_pid and self._registered:
            missing = [u for u in self._registered if u not in members]
            if missing:
                self._get(self.actor.set_serving_backends.remote([*members, *missing]))
                self.context.say(f"router restarted: {len(missing)} registered engine(s) given back to it")
                members = [*members, *missing]
        self._actor_pid = pid
        self._registered = members

    def engine_listings(self) -> list[EngineListing]:
        """The engines the trainer registered, one listing per host (in the order hosts first
        registered, each host's engines in registration order, so an engine keeps its id), for the
        dashboard's rows; ``[]`` when rl-launch's own engine hosts list the engines."""
        if not self.context.registration_capability:
            return []
        for url in self._registered:
            host = urlsplit(url).hostname or url
            listed = self._listed.setdefault(host, [])
            if url not in listed:
                listed.append(url)
        return [
            EngineListing(host, i, [EngineEntry(j, u, u + "/v1", host, i) for j, u in enumerate(urls)])
            for i, (host, urls) in enumerate(self._listed.items())
        ]

    def stop(self) -> None:
        if self.actor is None:
            return
        stop_restartable_actor(self.actor)
        self.actor = None
