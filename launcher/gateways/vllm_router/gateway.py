"""``router.kind: vllm-router``: the fleet behind vLLM Router (PyPI ``vllm-router`` 0.1.17), managed or
external.

* ``router.mode: external`` attaches to a vllm-router its owner runs (``router.url``, perhaps shared by
  several jobs): every engine is registered with ``POST /workers``, a dead engine is deregistered and its
  restarted successor registered on its new URL, and at the end only this job's engines are removed.
  The router itself is never stopped.
* ``router.mode: managed`` (the default) starts ``vllm-router`` on the port reserved from
  ``router.port_range``, inside a Ray actor restarted in place (``vllm_router_process``), and stops it at
  teardown.

Both converge the router's worker set from its own ``GET /workers`` on every fleet tick
(``vllm_router_admin.Registrar``), so a vllm-router that restarted empty is refilled on the next tick.
vllm-router reports no per-backend request outcomes the way our router does, so ``drain_outcomes`` is
``{}`` and the fleet controller judges engines on its own probes alone.

vllm-router has no refit window (pause, weight versions, per-step metrics): the driver serves the builtin
router's ``/fleet/*`` routes beside it (``launcher.gateways.fleet_endpoint``), and only the engines that
endpoint serves (not held out as stale) are registered, so the weight-version rule is the builtin router's.

vllm-router 0.1.17 has no authentication of its own for clients or for ``/workers``; the client's
``Authorization`` header is passed through to the engines, which check the job's API key. The managed
router listens on the driver node's address only (loopback in local mode), and no secret is ever put on
its command line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from launcher.gateways.actors import stop_restartable_actor
from launcher.gateways.base import Gateway, GatewayError, GatewayMember, GatewayView
from launcher.gateways.fleet_endpoint import FleetEndpoint
from launcher.gateways.vllm_router.admin import AdminError, Registrar, VllmRouterAdmin
from launcher.gateways.vllm_router.command import VllmRouterSection, root_url, router_command
from launcher.gateways.vllm_router.kind import VLLM_ROUTER

_CALL_TIMEOUT_S = 5.0
_START_TIMEOUT_S = 120.0
_READY_TIMEOUT_S = 30.0


def _metrics_port(port_range: tuple[int, int], taken: int) -> int:
    """A port for vllm-router's Prometheus listener on 127.0.0.1, from the router's range (not the
    ephemeral range: a restart must find it free again) and not the router's own port, which is reserved
    but not yet bound: from the top, away from where the driver reserves."""
    from router.ports import NoFreePort, free_port_in

    try:
        return free_port_in(
            "127.0.0.1", port_range, order="top", exclude=(taken,), what="vllm-router's metrics"
        )
    except NoFreePort as exc:
        raise GatewayError(f"router.port_range: {exc}") from None


class VllmRouterGateway(Gateway):
    kind = VLLM_ROUTER.name
    guards_weight_version = True  # the fleet endpoint holds stale engines out of the registration

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        r = self.context.spec.router
        self.mode: str = r.mode
        self.section: VllmRouterSection = r.vllm_router or VllmRouterSection()
        self.actor: Any = None
        self._url = ""
        self.registrar: Registrar | None = None
        self.fleet: FleetEndpoint | None = None

    # -- start ------------------------------------------------------------------------------------------
    def start(self, engine_urls: Sequence[str]) -> str:
        if self.mode == "external":
            url = root_url(self.context.spec.router.url or "")
            if not VllmRouterAdmin(url).live():
                raise GatewayError(f"router.url {url}: vllm-router does not answer {url}/liveness")
        else:
            url = self._start_managed()
        self._url = url
        self._start_fleet_endpoint()
        assert self.fleet is not None
        self.registrar = Registrar(
            VllmRouterAdmin(url), say=self.context.say, note=self._note, owns_router=self.mode == "managed"
        )
        try:
            self.registrar.register_all(self.fleet.serving(engine_urls), timeout_s=_START_TIMEOUT_S)
        except Exception as exc:
            raise GatewayError(f"vllm-router at {url} refused the engines: {exc}") from exc
        self._wait_ready(url)
        return url

    def _start_fleet_endpoint(self) -> None:
        ctx = self.context
        port = ctx.reserve_port() if ctx.reserve_port is not None else 0  # 0: the OS's choice
        try:
            self.fleet = FleetEndpoint(ctx.host, port, ctx.admin_token, ctx.engines_key).start()
        except Exception as exc:
            raise GatewayError(f"vllm-router: the fleet endpoint did not start on {ctx.host}: {exc}") from exc

    def fleet_url(self) -> str | None:
        return self.fleet.url if self.fleet is not None else None

    def weight_version(self) -> str | None:
        return self.fleet.weight_version if self.fleet is not None else None

    def stale_engines(self) -> dict[str, str]:
        return self.fleet.stale() if self.fleet is not None else {}

    def _note(self, action: str, url: str, why: str) -> None:
        level = "warning" if action in ("removed", "foreign") else "info"
        detail = f"vllm-router: {url} {action}: {why}"
        self.context.job.log_event("gateway_member", detail, action=action, url=url, why=why, level=level)

    def _start_managed(self) -> str:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from launcher.gateways.vllm_router.process import remote_vllm_router_actor
        from router.actor import ROUTER_ACTOR_NAME

        ctx = self.context
        url = f"http://{ctx.host}:{ctx.port}"
        try:
            command = router_command(
                host=ctx.host,
                port=ctx.port,
                metrics_port=_metrics_port(ctx.spec.router.port_range, ctx.port),
                policy=self.section.policy,
                options=self.section.options,
            )
        except FileNotFoundError as exc:
            raise GatewayError(f"router.kind vllm-router (managed): {exc}") from None
        actor_cls = remote_vllm_router_actor(
            name=ROUTER_ACTOR_NAME,
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_id=ray.get_runtime_context().get_node_id(), soft=False
            ),
        )
        self.actor = actor_cls.remote(command, url, str(ctx.job.logs / "vllm-router.log"))
        try:
            ray.get(self.actor.base_url.remote(), timeout=_START_TIMEOUT_S)
        except Exception as exc:
            raise GatewayError(f"vllm-router did not start on {ctx.host}:{ctx.port}: {exc}") from exc
        return url

    def _wait_ready(self, url: str) -> None:
        import time

        admin = VllmRouterAdmin(url)
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not admin.ready():
            if time.monotonic() > deadline:
                raise GatewayError(
                    f"vllm-router at {url} has no healthy worker after registering the engines"
                )
            time.sleep(0.2)

    # -- the run ----------------------------------------------------------------------------------------
    def base_url(self) -> str:
        return self._url

    def set_serving(self, urls: Sequence[str]) -> None:
        assert self.registrar is not None and self.fleet is not None, "start() first"
        self.registrar.converge(self.fleet.serving(urls))

    def instance(self) -> str | None:
        if self.actor is None:  # external: its owner's restarts show as an empty GET /workers instead
            return None
        import ray

        return str(ray.get(self.actor.pid.remote(), timeout=_CALL_TIMEOUT_S))

    def view(self) -> GatewayView:
        admin = VllmRouterAdmin(self._url)
        label = f"{self.mode}, policy {self.section.policy}" if self.mode == "managed" else "external"
        try:
            workers = admin.workers()
        except (OSError, AdminError) as exc:
            return GatewayView(self.kind, self._url, False, detail=f"{label}: unreachable: {exc}")
        ours = self.registrar.ours if self.registrar is not None else set()
        members = tuple(
            GatewayMember(
                w["url"],  # as the router lists it: a foreign http://e:1/v1 is not this job's http://e:1
                bool(w.get("is_healthy")) if "is_healthy" in w else None,
                "" if w["url"] in ours else "not this job's",
            )
            for w in workers
        )
        return GatewayView(self.kind, self._url, True, members, detail=label)

    # -- stop -------------------------------------------------------------------------------------------
    def stop(self) -> None:
        if self.fleet is not None:
            self.fleet.stop()
        if self.registrar is not None and self.mode == "managed":
            self.registrar.close()  # the router goes away with the actor: nothing to deregister
        if self.registrar is not None and self.mode == "external":
            failed = self.registrar.deregister_ours()
            if failed:
                self.context.say(f"vllm-router: could not deregister {len(failed)}: {'; '.join(failed)}")
        if self.actor is None:
            return
        stop_restartable_actor(self.actor)
        self.actor = None
