"""What a front kind declares (``FrontKind``) and the part of the spec's ``router:`` section every front has
(``FrontSection``): the base of each ``launcher/gateways/<kind>/kind.py``.

Why a declaration apart from the running ``Gateway`` (``base``): ``rl-launch validate``, ``status``,
``fleet reset-cache`` and the spec's rules need to know what a kind is (its settings, label, routes,
how its caches are reset) without starting it or importing Ray, Serve or Dynamo; and the spec is built
from these declarations while a ``Gateway`` runs from a resolved spec, so the two sit on either side of
``launcher.spec``. ``FrontKind.gateway`` names the running class, imported only when a job starts one.

Everything a caller used to switch on a kind's name for is a field or method here; outside a kind's own
package nothing names a kind (the registry, ``launcher.gateways.kinds``, aside).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from pydantic import ConfigDict, Field, field_validator

from launcher.engines.kind import OPENAI_API
from launcher.spec.errors import Issue
from launcher.spec.section import Section

if TYPE_CHECKING:
    from launcher.engines.kind import EngineKind

DEFAULT_ROUTER_PORT_RANGE = (20000, 20999)

# Ports the router's range must avoid: Ray's defaults, the fixed ports of NeMo-RL's ray.sub (a job may
# start Ray that way on the same nodes), and the Linux ephemeral range (engine ports from
# ``free_port`` and every outgoing connection come from there, so a router restart could find its
# port taken).
RESERVED_PORTS: tuple[tuple[int, int, str], ...] = (
    (6379, 6379, "Ray GCS"),
    (8076, 8077, "Ray object/node manager"),
    (8265, 8265, "Ray dashboard"),
    (10001, 10001, "Ray client server"),
    (10002, 19999, "Ray worker ports"),
    (52365, 52367, "Ray dashboard agent (ray.sub)"),
    (53001, 53010, "ray.sub node/object manager, runtime env, metrics"),
    (54001, 54514, "ray.sub worker ports and GCS"),
    (32768, 60999, "Linux ephemeral ports"),
)


class FrontSection(Section):
    """The spec's ``router:`` section of one front kind: ``kind`` and where the driver reserves the front's
    port (and the job's other listeners: status endpoint, fleet endpoint), plus the kind's own fields. A
    field of another kind is refused as an unknown field of this one, naming the kinds it belongs to."""

    # Frozen: the driver hands it whole to the front; a snapshot read back is checked by the same rules.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, validate_default=False)

    kind: str
    port_range: tuple[int, int] = Field(
        default=DEFAULT_ROUTER_PORT_RANGE, description="where the front's port is reserved"
    )

    field_hints: ClassVar[dict[str, str]] = {}
    """What to set instead, for a field of another kind that a user may carry over to this one
    (``policy`` on vllm-router: ``set router.vllm_router.policy``)."""

    @field_validator("port_range", mode="before")
    @classmethod
    def _port_range(cls, v: Any) -> Any:
        if isinstance(v, str):
            m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", v)
            if not m:
                raise ValueError(
                    f"{v!r} is not a port range; use 'LOW-HIGH' or [LOW, HIGH], e.g. 20000-20999"
                )
            v = (int(m.group(1)), int(m.group(2)))
        elif isinstance(v, list | tuple):
            if len(v) != 2 or not all(isinstance(p, int) and not isinstance(p, bool) for p in v):
                raise ValueError(f"must be two integers [LOW, HIGH], got {v!r}")
            v = (v[0], v[1])
        else:
            raise ValueError(f"must be 'LOW-HIGH' or [LOW, HIGH], got {v!r}")
        lo, hi = v
        if not 1024 <= lo <= hi <= 65535:
            raise ValueError(f"{lo}-{hi} must satisfy 1024 <= LOW <= HIGH <= 65535")
        clashes = [
            f"{a}-{b} ({what})" if a != b else f"{a} ({what})"
            for a, b, what in RESERVED_PORTS
            if lo <= b and a <= hi
        ]
        if clashes:
            raise ValueError(
                f"{lo}-{hi} overlaps ports used by others: {'; '.join(clashes)}; "
                "pick a range outside them, e.g. {}-{}".format(*DEFAULT_ROUTER_PORT_RANGE)
            )
        return v


@dataclass(frozen=True)
class CacheResetRoute:
    """How ``rl-launch fleet reset-cache`` reaches a job's engines: through the front's own route when
    ``via_fleet_route`` and the job records a ``fleet_url`` (``POST <fleet_url>/fleet/reset_prefix_cache``,
    which also clears the front's prefix index), else straight at every engine the job directory lists,
    ``POST <engine><engine_path>``, with the job's API key when ``with_api_key``."""

    via_fleet_route: bool
    engine_path: str
    with_api_key: bool


S = TypeVar("S", bound=FrontSection)


class FrontKind(Generic[S]):
    """One front kind: a class per kind, one instance in the registry. The ``ClassVar`` flags answer what
    callers used to ask of the kind's name; the methods take the kind's own section."""

    name: ClassVar[str]
    section: ClassVar[type[FrontSection]]
    """The pydantic model of ``router:`` for this kind (its ``kind`` a ``Literal`` of ``name``)."""
    gateway: ClassVar[str]
    """``module:Class`` of the running ``Gateway``, imported only when a job starts this front."""
    engine_api: ClassVar[str] = OPENAI_API
    """What the front routes to; an engine kind with another ``api`` cannot sit behind it."""
    routes_to: ClassVar[str] = "engines serving the OpenAI API over HTTP"
    """``engine_api`` in words, for the spec's error when the engine kind does not match."""
    has_fleet_routes: ClassVar[bool] = False
    """Whether the job serves the refit window's ``/fleet/*`` routes for this front (``fleet_url``)."""
    resets_through_fleet_route: ClassVar[bool] = False
    """Whether ``fleet reset-cache`` goes through the front's ``/fleet/reset_prefix_cache`` (which also
    clears the front's own prefix index) rather than straight at the engines."""
    dies_with_ray: ClassVar[bool] = False
    """Whether the front lives only as a Ray actor that the Ray head takes down with it: a hurried
    teardown (a stop signal) then skips its orderly stop instead of waiting on a dying head."""
    owns_engines: ClassVar[bool] = False
    """Whether the front starts, checks and replaces the engines itself (no engine hosts, no fleet
    controller; its ``view`` is the fleet view ``status`` shows)."""
    no_fleet_routes_why: ClassVar[str] = ""
    """For a kind without ``has_fleet_routes``: what its engines offer instead and why rl-launch does not
    run the refit window through them (the refusal ``rl-launch fleet`` and the client give)."""
    no_elastic_why: ClassVar[str] = ""
    """Why ``rl-launch fleet grow/shrink`` cannot resize a fleet behind this front (empty: it can, through
    the serving set the fleet controller pushes: a drained engine leaves it, a grown one joins it)."""
    serves_consumers: ClassVar[bool] = False
    """Whether the front can be a standing fleet's (``fleet:``): it checks the consumers' own keys, revokes
    them when their jobs end and shares its in-flight capacity fairly between them."""
    serves_adapters: ClassVar[bool] = False
    """Whether the front can serve LoRA adapters (``generation.lora``): it keeps the adapter table (which
    adapter is loaded on which engine, whose it is) and loads them through the engines' runtime routes."""
    serves_registrations: ClassVar[bool] = False
    """Whether the front can serve engines the trainer owns (``generation.owner: trainer``): a
    registration URL that takes no header (``router.http.capability``) and probing of its own."""
    forwards_client_key: ClassVar[bool] = False
    """Whether the front passes the client's ``Authorization`` on to the workers it routes to: a worker
    the job does not own then receives the job's API key (``status`` flags that)."""
    engines_take_client_key: ClassVar[bool] = False
    """Whether the engines behind this front must take the client's key because the front passes it on
    to them as it came (vllm-router; Ray Serve's replicas forward the client's headers to their engine).
    Then the job's ``secrets/engine_key`` is a copy of its API key. Otherwise it is a key of its own that
    the front presents in place of the client's (the builtin router's ``backend_api_key``), and no
    client, owner or consumer, can call an engine's routes directly."""
    bench_arm: ClassVar[str | None] = None
    """``module:function`` of the bench's ``<kind>[:OPTION]`` arm (``launcher.bench.arms``), if any."""

    def label(self, router: S) -> str:
        """The front in a few words (``validate``, the driver's log, ``status``, ``list``)."""
        raise NotImplementedError

    def summary(self, router: S) -> str:
        """``validate``'s router line: the label and where the port is reserved."""
        lo, hi = router.port_range
        return f"{self.label(router)}, port in {lo}-{hi}"

    def policy(self, router: S) -> str:
        """The routing policy as the front applies it (recorded in the job state for ``status``)."""
        raise NotImplementedError

    def rules(self, router: S, cluster: str) -> list[Issue]:
        """Rules across this kind's own fields (and the cluster), each issue naming the field to change."""
        return []

    def engine_host_fields(self, router: S, runtime: dict[str, Any]) -> dict[str, Any]:
        """What every engine host of the job must know of the front (``EngineHostConfig`` fields): e.g.
        the runtime the engines register with (``Gateway.prepare_engines``) and arguments for them."""
        return {}

    def cache_reset(self, engine: EngineKind) -> CacheResetRoute:
        """How a cache reset reaches this front's engines (``engine``: the job's engine kind)."""
        return CacheResetRoute(self.resets_through_fleet_route, *engine.cache_reset())
