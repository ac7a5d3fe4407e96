"""``router.kind: dynamo``: its ``router:`` section (``router.dynamo``: ``DynamoOptions``), its rule and
what it declares. It routes only to Dynamo workers (``engine_api``), which only it can reach."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from launcher.engines.dynamo.kind import DYNAMO_API
from launcher.gateways.front import FrontKind, FrontSection
from launcher.spec.errors import Issue
from launcher.spec.section import Section, str_args


class DynamoOptions(Section):
    """``router.dynamo``: how the launcher-owned Dynamo fleet runs.

    Why ``etcd`` is the default discovery: it is what a multi-node production fleet uses (NATS carries the
    KV events then); ``file`` needs only the shared job directory and is the lighter choice for one node."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, validate_default=False)

    router_mode: Literal["round-robin", "kv", "random", "least-loaded"] = "kv"
    discovery: Literal["etcd", "file"] = "etcd"
    request_plane: Literal["tcp", "nats"] = "tcp"
    migration_limit: int = Field(default=3, ge=0, description="re-routes of a request whose worker died")
    frontend_args: list[str] = Field(default_factory=list)
    worker_args: list[str] = Field(default_factory=list)
    """Appended to every ``dynamo.vllm`` / ``dynamo.mocker`` command line (e.g. ``--speedup-ratio 10``)."""
    ready_timeout_s: float = Field(default=300.0, gt=0)
    lease_ttl_s: int = Field(default=5, ge=1, description="etcd lease of a worker's registration")
    allow_insecure_network: bool = False
    """``cluster: slurm`` refuses a Dynamo job without it: Dynamo 1.6 authenticates nothing the workers
    listen on (request plane, system status server with its ``/engine/*`` routes), and on a cluster they
    listen on the nodes' addresses. ``true`` accepts that on a network you trust (docs/fronts.md,
    "Behind Dynamo"); etcd, NATS and the front URL check the job's secrets either way. No effect with
    ``cluster: local``, where everything listens on loopback."""

    @field_validator("frontend_args", "worker_args", mode="before")
    @classmethod
    def _args_before(cls, v: Any) -> Any:
        return str_args(v)


class DynamoRouterSection(FrontSection):
    kind: Literal["dynamo"] = "dynamo"
    dynamo: DynamoOptions = Field(default_factory=DynamoOptions)

    field_hints = {
        "policy": "set router.dynamo.router_mode",
        "policy_options": "set router.dynamo.router_mode",
    }


class DynamoFront(FrontKind[DynamoRouterSection]):
    name = "dynamo"
    section = DynamoRouterSection
    gateway = "launcher.gateways.dynamo.gateway:DynamoGateway"
    no_elastic_why = (
        "router.kind dynamo: Dynamo's frontend routes to every worker registered in its discovery, so "
        "rl-launch cannot hold a worker out of new requests while its requests in flight finish (a drain); "
        "stopping one deregisters it and aborts what it runs. A grown node's workers would register and "
        "serve, but a fleet that can grow and never drain is not offered: fleet grow and shrink are "
        "refused. Use router.kind builtin or vllm-router for an elastic fleet"
    )
    no_fleet_routes_why = (
        "Dynamo 1.6's dynamo.vllm workers serve their own /engine/pause_generation, "
        "/engine/update_weights_from_disk, /engine/set_weight_version and /engine/resume_generation (on each "
        "worker's unauthenticated status server), but no checksum to verify a load by, and Dynamo's "
        "frontend routes to every registered worker, so a worker whose load failed cannot be held out of "
        "routing; dynamo.mocker serves none of these routes. Drive those routes yourself, or use "
        "router.kind builtin, vllm-router or ray-serve for the refit window"
    )
    engine_api = DYNAMO_API
    routes_to = "Dynamo workers"

    def rules(self, router: DynamoRouterSection, cluster: str) -> list[Issue]:
        """On a cluster what Dynamo cannot authenticate runs only with the explicit opt-in (see
        ``launcher.gateways.dynamo.gateway``)."""
        if cluster == "slurm" and not router.dynamo.allow_insecure_network:
            return [
                Issue(
                    "router.dynamo.allow_insecure_network",
                    "required with router.kind: dynamo on cluster: slurm: Dynamo's workers take requests "
                    "(TCP request plane) and /engine/* calls (system status server) from anyone on the "
                    "cluster network, with no authentication; set it to true on a network you trust "
                    '(docs/fronts.md, "Behind Dynamo"), or use another router.kind',
                )
            ]
        return []

    def label(self, router: DynamoRouterSection) -> str:
        return f"dynamo: --router-mode {router.dynamo.router_mode}"

    def policy(self, router: DynamoRouterSection) -> str:
        return router.dynamo.router_mode

    def engine_host_fields(self, router: DynamoRouterSection, runtime: dict[str, Any]) -> dict[str, Any]:
        """The workers' ``DynamoPlanes`` (from ``prepare_engines``) and ``router.dynamo.worker_args``."""
        return {"dynamo": dict(runtime), "dynamo_worker_args": list(router.dynamo.worker_args)}


DYNAMO = DynamoFront()
