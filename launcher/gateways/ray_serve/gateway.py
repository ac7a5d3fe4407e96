"""``router.kind: ray-serve``: the fleet is one Ray Serve application that owns its engines.

* ``engines``: one replica per engine instance (``replica.EngineReplica``), each starting its own engine
  and proxying to it with streaming; ``max_replicas_per_node`` from the node's GPUs and the instance's
  TP x PP; ``max_ongoing_requests`` from the engine's ``max_num_seqs`` (Serve's default of 5 would cap
  every vLLM instance at 5 concurrent requests); request routing by our policy
  (``request_router.PolicyRequestRouter``) or Serve's power-of-two (``router.serve_routing``).
* ``ingress``: one replica behind Serve's HTTP proxy on the reserved port (``ingress.GatewayIngress``),
  keeping the 500 / no-healthy status contract.

Because the gateway owns the engines (``kind.RayServeFront.owns_engines``), the driver starts no engine
hosts and no fleet controller: Serve's controller health-checks replicas and replaces a failed one (its
engine with it); our controller's engine restarts do not apply. ``set_serving`` is therefore a no-op, and
``view`` is the source of the fleet view ``rl-launch status`` shows. Serve's proxy and controller are
restarted by Ray in place; the proxy rebinds the same port, so the URL stays.

The refit window: Serve has none, so the driver serves the builtin router's ``/fleet/*`` routes beside it
(``launcher.gateways.fleet_endpoint``, the job's ``fleet_url``), over the replicas' engines. On every
watcher tick (``sync_owned_engines``) the engines the replicas run now become the endpoint's members, so a
replacement replica's engine joins and, after a stamp, is held out as stale until the trainer refits it;
the endpoint's verdict per engine (held out or not, and its weight version) goes to ``fleet_state``'s file
at once whenever it changes, where the ingress and the replicas read it: held-out replicas get no request,
and responses carry the serving engine's weight version. During a pause the engines hold new requests
(the ingress does not), as beside vllm-router.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from launcher.engines.kinds import engine_kind
from launcher.gateways.base import Gateway, GatewayError, GatewayMember, GatewayView
from launcher.gateways.fleet_endpoint import FleetEndpoint, FleetMembers
from launcher.gateways.ray_serve.fleet_state import FleetState, ReplicaState, write_fleet_state
from launcher.gateways.ray_serve.ingress import ENGINES_DEPLOYMENT, INGRESS_DEPLOYMENT, GatewayIngress
from launcher.gateways.ray_serve.kind import RAY_SERVE
from launcher.gateways.ray_serve.plan import (
    ONGOING_PER_SEQ,
    ServePlan,
    executor_args,
    replicas_per_node,
)
from launcher.gateways.ray_serve.replica import EngineReplica, registry_dir
from launcher.jobdir import EngineEntry, EngineListing
from router.state.backends import canonical_backend_url

APP_NAME = "rl-launch"
# Serve's controller declares its HTTP proxy dead after 3 failed health checks 10 s apart: a killed
# proxy left the URL refusing connections for ~30 s. Every 2 s (1 s timeout) it is back within ~10 s.
SERVE_RAY_ENV = {
    "RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S": "2",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "2",
}
POWER_OF_TWO = "power_of_two"
_CALL_TIMEOUT_S = 10.0


def plan_from_spec(
    spec: Any,
    job_dir: str,
    api_key_file: str | None,
    local: bool,
    engine_env: Mapping[str, str] | None,
    generation_nodes: Sequence[str] = (),
) -> ServePlan:
    """The deployment plan of a resolved spec (see ``plan.ServePlan``); ``engine_env``: the environment
    the engine kind reads its interpreter from (the driver's), ``None`` for none."""
    gen = spec.generation
    kind = engine_kind(gen.engine)
    r = spec.router
    gpus = gen.resources.gpus_per_node if gen.resources is not None else 0
    tp, pp = gen.tensor_parallel_size, gen.pipeline_parallel_size
    engine = {
        "kind": gen.engine,
        "count": 1,
        "host": "127.0.0.1",
        "model": gen.model or gen.served_model_name,
        "served_name": gen.served_model_name,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "env": dict(gen.env),
        "startup_timeout_s": gen.startup_timeout_s,
        "log_dir": f"{job_dir}/logs",
        "job_dir": job_dir,
        "api_key_file": api_key_file,
        **kind.host_fields(gen, engine_env or {}),
    }
    return ServePlan(
        num_replicas=gen.num_engines,
        max_replicas_per_node=replicas_per_node(gpus, tp, pp, gen.engines_per_node),
        max_ongoing_requests=ONGOING_PER_SEQ * kind.max_num_seqs(gen.model_dump()),
        engine=engine,
        executor_args=executor_args("cuda" if gpus > 0 else "cpu", tp, pp),
        local=local,
        routing=r.policy if r.serve_routing == "policy" else POWER_OF_TWO,
        policy_options=dict(r.policy_options),
        max_attempts=r.max_attempts,
        backend_timeout_s=r.backend_timeout_s,
        no_healthy_status=r.no_healthy_backend_status,
        max_request_bytes=r.max_request_bytes,
        generation_nodes=tuple(generation_nodes),
    )


def node_selector(hostnames: Sequence[str]) -> dict[str, str] | None:
    """A Ray label selector keeping replicas on these hosts' Ray nodes (None: anywhere)."""
    if not hostnames:
        return None
    import ray

    ids = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("NodeManagerHostname") in hostnames]
    if not ids:
        raise GatewayError(f"no live Ray node on the generation nodes {', '.join(hostnames)}")
    return {"ray.io/node-id": f"in({','.join(ids)})"}


def build_app(plan: ServePlan, app_name: str = APP_NAME) -> Any:
    """The Serve application (ingress -> engines) for ``plan``."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    actor_options: dict[str, Any] = {"num_cpus": 0}
    selector = node_selector(plan.generation_nodes)
    if selector:
        actor_options["label_selector"] = selector
    router_class, router_kwargs = (
        ("ExcludingPowerOfTwoRouter", {})
        if plan.routing == POWER_OF_TWO
        else (
            "PolicyRequestRouter",
            {"policy": plan.routing, "policy_options": dict(plan.policy_options)},
        )
    )
    engine_options: dict[str, Any] = {
        "name": ENGINES_DEPLOYMENT,
        "num_replicas": plan.num_replicas,
        "max_replicas_per_node": plan.max_replicas_per_node,
        "max_ongoing_requests": plan.max_ongoing_requests,
        "max_queued_requests": -1,
        "ray_actor_options": actor_options,
        "health_check_period_s": plan.health_check_period_s,
        "health_check_timeout_s": plan.health_check_timeout_s,
        "graceful_shutdown_timeout_s": 10,
        "graceful_shutdown_wait_loop_s": 1,
        # Ours in both cases: Serve's own power-of-two router ignores the call's exclusions (retries, the
        # refit window's held-out replicas); see request_router.
        "request_router_config": RequestRouterConfig(
            request_router_class=f"launcher.gateways.ray_serve.request_router.{router_class}",
            request_router_kwargs=router_kwargs,
        ),
    }
    engines = serve.deployment(EngineReplica).options(**engine_options).bind(plan.to_json())
    ingress = serve.deployment(GatewayIngress).options(
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        max_ongoing_requests=100_000,
        max_queued_requests=-1,
        ray_actor_options={"num_cpus": 0},
        # a dead ingress replica is noticed and replaced within a few seconds, not Serve's 10 s period
        health_check_period_s=plan.health_check_period_s,
        health_check_timeout_s=plan.health_check_timeout_s,
    )
    return ingress.bind(engines, plan.to_json(), app_name)


def start_serve(host: str, port: int) -> None:
    """Serve's controller and its HTTP proxy on this (the head) node only, on the reserved port, with no
    request timeout (the proxy's 408 would break the status contract)."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port, "location": "HeadOnly", "request_timeout_s": None})


def alive_replica_ids() -> set[str]:
    """Unique ids of the engine replicas Ray reports alive (named actors; no dashboard needed)."""
    import ray

    ids = set()
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"] if isinstance(actor, dict) else str(actor)
        if name.startswith(f"SERVE_REPLICA::{APP_NAME}#{ENGINES_DEPLOYMENT}#"):
            ids.add(name.rsplit("#", 1)[1])
    return ids


def engine_replicas(job_dir: str) -> list[dict[str, Any]]:
    """``{replica, node, url, pid, log}`` of every live engine replica, sorted by node then URL."""
    alive = alive_replica_ids()
    out = []
    for path in registry_dir(job_dir).glob("*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if record.get("replica") in alive:
            out.append(record)
    return sorted(out, key=lambda r: (r["node"], r["url"]))


def wait_healthy(url: str, timeout_s: float) -> None:
    """Until the ingress answers /health 200 (every engine replica started), or ``GatewayError``."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.5)
    raise GatewayError(
        f"the Ray Serve gateway at {url} did not answer /health within {timeout_s:g} s: {last}"
    )


class RayServeGateway(Gateway):
    kind = RAY_SERVE.name
    ray_env: ClassVar[dict[str, str]] = SERVE_RAY_ENV
    # The fleet endpoint beside Serve holds stale engines out of Serve's routing (fleet_state). No fleet
    # controller runs for this kind (it owns its engines), so nothing reads the flag today; it says what
    # the front does.
    guards_weight_version = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._url = ""
        self.plan: ServePlan | None = None
        self.fleet: FleetEndpoint | None = None
        # What fleet_state's file is made of: the replicas as the last sync saw them (replica id -> engine
        # URL) and the endpoint's verdict as it last pushed it. Two threads write them (the watcher's
        # sync, the endpoint's watch), so under one lock, and the file is written from both under it.
        self._lock = threading.Lock()
        self._replicas: dict[str, str] = {}
        self._members = FleetMembers(None)
        self._published: FleetState | None = None

    def start(self, engine_urls: Sequence[str]) -> str:
        import os

        from ray import serve

        ctx = self.context
        self.plan = plan_from_spec(
            ctx.spec,
            str(ctx.job.path),
            str(ctx.job.api_key_file),
            ctx.spec.cluster == "local",
            os.environ,
            ctx.generation_nodes,
        )
        plan = self.plan
        ctx.say(
            f"ray-serve: {plan.num_replicas} replica(s), at most {plan.max_replicas_per_node} per node, "
            f"max_ongoing_requests {plan.max_ongoing_requests}, routing {plan.routing}"
        )
        try:
            start_serve(ctx.host, ctx.port)
            serve.run(build_app(self.plan), name=APP_NAME, route_prefix="/", blocking=False)
        except GatewayError:
            raise
        except Exception as exc:
            raise GatewayError(
                f"the Ray Serve gateway did not start on {ctx.host}:{ctx.port}: {exc}"
            ) from exc
        self._url = f"http://{ctx.host}:{ctx.port}"
        wait_healthy(self._url, self.plan.engine["startup_timeout_s"] + 30)
        self._start_fleet_endpoint()  # after Serve's proxy bound the front's port (reserve_port's rule)
        self.sync_owned_engines()
        return self._url

    def _start_fleet_endpoint(self) -> None:
        ctx = self.context
        port = ctx.reserve_port() if ctx.reserve_port is not None else 0  # 0: the OS's choice
        try:
            self.fleet = FleetEndpoint(ctx.host, port, ctx.admin_token, ctx.engines_key).start()
            self.fleet.watch(self._fleet_changed)
        except Exception as exc:
            raise GatewayError(f"ray-serve: the fleet endpoint did not start on {ctx.host}: {exc}") from exc

    def fleet_url(self) -> str | None:
        return self.fleet.url if self.fleet is not None else None

    def weight_version(self) -> str | None:
        return self.fleet.weight_version if self.fleet is not None else None

    def stale_engines(self) -> dict[str, str]:
        return self.fleet.stale() if self.fleet is not None else {}

    def base_url(self) -> str:
        return self._url

    def set_serving(self, urls: Sequence[str]) -> None:
        """Serve's controller owns the serving set (it replaces failed replicas); nothing to push."""

    # -- the refit window ---------------------------------------------------------------------------------
    def sync_owned_engines(self) -> None:
        """The replicas' engines become the fleet endpoint's members (a new one is judged against the
        fleet's version there), and fleet_state's file is brought up to date with the replicas."""
        if self.fleet is None:
            return
        replicas = engine_replicas(str(self.context.job.path))
        self.fleet.serving([r["url"] for r in replicas])  # a change reaches _fleet_changed as well
        with self._lock:
            self._replicas = {str(r["replica"]): str(r["url"]) for r in replicas}
            self._publish()

    def _fleet_changed(self, members: FleetMembers) -> None:
        """The endpoint's verdict changed (a refit quarantined an engine, a stamp moved the fleet): to
        Serve's routing now, not at the next tick (called in a worker thread of the endpoint's loop)."""
        with self._lock:
            self._members = members
            self._publish()

    def _publish(self) -> None:
        """Write fleet_state's file when what it says changed (under ``_lock``). A replica whose engine the
        endpoint has not seen yet is held out once the fleet has a version (it came back on the checkpoint's
        weights), like an unlisted one."""
        version = self._members.version
        judged = {m.url: m for m in self._members.members}
        replicas = {}
        for rid, url in self._replicas.items():
            m = judged.get(canonical_backend_url(url))
            if m is not None:
                replicas[rid] = ReplicaState(url, m.version, m.held_out)
            elif version is None:
                replicas[rid] = ReplicaState(url, None, None)
            else:
                replicas[rid] = ReplicaState(url, None, f"not checked against weight version {version!r} yet")
        state = FleetState(version, replicas)
        if state != self._published:
            write_fleet_state(self.context.job.path, state)
            self._published = state

    # -- the view -------------------------------------------------------------------------------------------
    def view(self) -> GatewayView:
        try:
            records = engine_replicas(str(self.context.job.path))
        except Exception as exc:
            return GatewayView(self.kind, self._url, False, detail=f"Serve unreachable: {exc!r}")
        with self._lock:
            published = self._published
        members = []
        for w in records:
            state = published.replicas.get(w["replica"]) if published is not None else None
            detail = f"replica {w['replica']} on {w['node']}"
            if state is not None and state.version is not None:
                detail += f", weights {state.version!r}"
            if state is not None and state.held_out is not None:
                detail += f", held out: {state.held_out}"
            members.append(GatewayMember(w["url"], state is None or state.held_out is None, detail))
        return GatewayView(
            self.kind,
            self._url,
            True,
            tuple(members),
            detail=f"routing {self.plan.routing if self.plan else '?'}",
        )

    def engine_listings(self) -> list[EngineListing]:
        nodes = list(self.context.generation_nodes)
        by_node: dict[str, list[dict[str, Any]]] = {}
        for record in engine_replicas(str(self.context.job.path)):
            by_node.setdefault(record["node"], []).append(record)
        listings = []
        for node, records in sorted(by_node.items()):
            index = nodes.index(node) if node in nodes else len(nodes) + len(listings)
            entries = [
                EngineEntry(i, r["url"], r["url"] + "/v1", node, index, 0, r.get("log", ""))
                for i, r in enumerate(records)
            ]
            listings.append(EngineListing(node, index, entries))
        return listings

    def stop(self) -> None:
        if self.fleet is not None:
            self.fleet.stop()
            self.fleet = None
        if not self._url:
            return
        from ray import serve

        try:
            serve.shutdown()
        except Exception:
            pass
        self._url = ""
