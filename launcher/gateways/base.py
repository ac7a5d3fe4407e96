"""One interface for every front a fleet can sit behind (our router, vllm-router, Ray Serve, Dynamo).

The driver and the fleet controller talk to "the gateway", never to one kind of front, the way submitit's
executors sit behind one ``Executor``: the driver starts it (or attaches to one that runs already), hands
its one stable base URL to Gym and the training command, and stops it at teardown; the fleet controller
pushes the whole serving set every tick (a kind that only knows add/remove turns that into deltas),
drains per-backend outcomes where the kind reports them, and notices when the gateway process itself
restarted. ``view`` is the gateway's *own* view of the fleet, shown by ``rl-launch status`` beside ours,
because a front that disagrees with the controller (a worker it still routes to, one it never admitted)
is exactly what an operator needs to see.

Why whole sets and not deltas at the interface: a gateway that restarts (our router actor, a managed
vllm-router) comes back empty or stale; pushing the whole set every tick converges it on the next tick
without the controller having to know that it restarted.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from launcher.gateways.kinds import UnknownFront, front_kind
from launcher.jobdir.paths import record_dir

if TYPE_CHECKING:
    from launcher.jobdir import EngineListing, JobDir
    from launcher.spec import ResolvedSpec


class GatewayError(RuntimeError):
    """The gateway could not start, attach or apply a change; the message says which and why."""


@dataclass(frozen=True)
class GatewayMember:
    """One backend as the gateway sees it."""

    url: str
    healthy: bool | None = None
    """``None`` when the gateway does not report health per backend."""
    detail: str = ""


@dataclass(frozen=True)
class GatewayView:
    """What the gateway itself reports: reachable or not, and the backends it routes to."""

    kind: str
    base_url: str
    reachable: bool
    members: tuple[GatewayMember, ...] = ()
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "base_url": self.base_url,
            "reachable": self.reachable,
            "detail": self.detail,
            "members": [{"url": m.url, "healthy": m.healthy, "detail": m.detail} for m in self.members],
        }


@dataclass
class GatewayContext:
    """What a gateway kind may use to start: the job, where to listen, the job's secrets."""

    spec: ResolvedSpec
    job: JobDir
    host: str
    """The driver node's address (loopback in local mode): where a launcher-owned front listens."""
    port: int
    """Reserved once from the spec's port range: a restarted front rebinds the same URL."""
    api_key: str
    """What clients (Gym) send."""
    admin_token: str
    """The front's admin surface (``/workers``): the driver and the fleet controller only."""
    engine_key: str = ""
    """What the engines take (``secrets/engine_key``): presented by the front in place of the client's
    key and by every fleet call to the engines; the API key itself where
    ``FrontKind.engines_take_client_key``. Empty: the API key (a context made without one, in tests)."""

    @property
    def engines_key(self) -> str:
        return self.engine_key or self.api_key

    say: Callable[[str], None] = field(default=lambda message: None)
    generation_nodes: tuple[str, ...] = ()
    """Hostnames of the generation nodes (where a gateway that owns its engines places them)."""
    registration_capability: str = ""
    """The job's registration capability (``generation.owner: trainer``): the router serves it and owns
    its serving set (probing, holding out, readmitting) instead of a fleet controller. Empty: off."""
    reserve_port: Callable[[], int] | None = None
    """Another free port from the spec's range on ``host``, for a listener of the launcher's own beside
    the front (the fleet endpoint); call it only once the front is bound, or it may return ``port``."""


class Gateway(ABC):
    """The front in front of the fleet. Methods are called from the driver's and the fleet controller's
    threads; an implementation must be safe for that (the kinds here hold no state a race could tear)."""

    kind: ClassVar[str]
    ray_env: ClassVar[dict[str, str]] = {}
    """Environment the Ray cluster is started with for this kind (read by Ray's own processes at start,
    e.g. Serve's controller's proxy health-check period)."""
    binds_beside_port_hold: ClassVar[bool] = False
    """Whether the front binds ``port`` with ``SO_REUSEPORT`` beside the driver's placeholder
    (``router.ports.PortHold``, ``RouterConfig.port_held``), so the port stays the job's for its
    whole life; else the driver releases the port just before ``start``."""
    guards_weight_version: ClassVar[bool] = False
    """True when the front itself holds out engines on another weight version (``router.fleet.api``'s
    ``FleetApi``, the fleet's one judge of staleness): the controller reads its verdict
    (``stale_engines``) into the STALE state and also hands it the STALE engines, so the trainer can list
    and stamp them through the front. Otherwise no engine is ever STALE."""

    def __init__(self, context: GatewayContext) -> None:
        self.context = context

    @abstractmethod
    def start(self, engine_urls: Sequence[str]) -> str:
        """Start (or attach to) the front with these engines serving; return its base URL (no ``/v1``)
        once it answers. Raises ``GatewayError`` naming what failed."""

    def prepare_engines(self) -> dict[str, Any]:
        """Start what the engines need before they start (Dynamo's discovery and event runtime) and
        return what the engine hosts must know of it (kind-specific, JSON-able); ``{}``: nothing."""
        return {}

    def failed(self) -> str | None:
        """Why the front can no longer serve (a launcher-owned process died), else ``None``; the driver
        fails the job with this reason instead of leaving the trainer on a dead URL."""
        return None

    @abstractmethod
    def base_url(self) -> str:
        """The stable URL for the life of the run (clients use ``base_url() + "/v1"``)."""

    @abstractmethod
    def set_serving(self, urls: Sequence[str]) -> None:
        """Make exactly ``urls`` (engine API URLs, with or without ``/v1``) the backends that serve."""

    def drain_outcomes(self) -> dict[str, tuple[int, int]]:
        """``{url: (successes, failures)}`` since the last drain, where the kind reports them; ``{}``
        otherwise (the controller then judges on its own probes alone)."""
        return {}

    def weight_version(self) -> str | None:
        """The fleet's current weight version as the front knows it (the trainer stamps through it);
        ``None``: nothing stamped yet, or a kind without fleet versions (then no engine is STALE)."""
        return None

    def restore_weight_version(self, version: str) -> None:
        """Tell a front that restarted and forgot it the fleet's version (no-op for kinds without one)."""
        return None

    def stale_engines(self) -> dict[str, str]:
        """``{engine url: why}`` for the engines the front holds out because their weights are not the
        fleet's version (kinds that ``guards_weight_version``); ``{}`` for the others. Raises when the
        front cannot be asked (the controller then keeps its STALE engines as they are)."""
        return {}

    def restore_pause(self) -> bool:
        """Hold requests again in a front that restarted while the engines were paused (kinds whose front
        holds requests during a pause); True if it was not holding. No-op (False) for other kinds."""
        return False

    def move_off(self, urls: Sequence[str], reason: str) -> int | None:
        """Move the requests in flight on ``urls`` to other engines now, where the front continues
        requests (rl-launch's router: ``router.continuation``): a drain ("drained") or restart
        ("restarted") then need not wait for them. How many it moved (a front's own process; its worker
        processes count their own); None for kinds that cannot, whose requests go on where they are."""
        return None

    def record_settings(self) -> dict[str, Any]:
        """``RouterConfig`` fields for the request record (``router.record``) of a front that is rl-launch's
        own router: ``<job>/record`` with the spec's cap and text setting; {} when the spec turns it off."""
        rec = self.context.spec.record
        if not rec.enabled:
            return {}
        return {
            "record_dir": str(record_dir(self.context.job.path)),
            "record_max_bytes": rec.max_bytes,
            "record_keep_files": rec.keep_files,
            "record_text": rec.text,
        }

    def fleet_url(self) -> str | None:
        """Where the ``/fleet/*`` routes of the refit window are served for this front (the admin token
        guards them), ``None`` when the kind has none; ``launcher.fleet.client`` and ``rl-launch fleet``
        use it (the driver records it in the job state)."""
        return None

    def instance(self) -> str | None:
        """An identity of the front's process that changes when it restarts (``None``: unknown)."""
        return None

    @abstractmethod
    def view(self) -> GatewayView:
        """The front's own view of the fleet (``rl-launch status`` shows it next to the controller's)."""

    def sync_owned_engines(self) -> None:
        """For a front that owns its engines (``FrontKind.owns_engines``): bring what the launcher keeps
        beside the front up to date with the engines it runs now (ray-serve: the fleet endpoint's members,
        so a replacement replica's engine is judged against the fleet's weight version, and the state
        Serve's routing reads). No fleet controller runs for such a front, so nothing else pushes it the
        engines; ``launcher.driver.gateway_watcher`` calls this every tick, before ``view``. No-op for the
        others (their serving set arrives through ``set_serving``). Raises when the front cannot be asked
        (the watcher tries again on its next tick)."""
        return None

    def engine_listings(self) -> list[EngineListing]:
        """The engines a front that owns them (``FrontKind.owns_engines``) runs, one listing per node, for
        the dashboard (the driver writes them where engine hosts would); ``[]`` for the others."""
        return []

    @abstractmethod
    def stop(self) -> None:
        """Stop what the launcher started (and deregister from a front it only attached to); idempotent,
        bounded in time."""


def gateway_class(kind: str) -> type[Gateway]:
    """The running class of front kind ``kind`` (``FrontKind.gateway``), imported now: a kind's heavy
    dependencies (Ray Serve, Dynamo) load only when a job asks for that kind."""
    try:
        module, _, name = front_kind(kind).gateway.partition(":")
    except UnknownFront as exc:
        raise GatewayError(str(exc)) from None
    cls: type[Gateway] = getattr(importlib.import_module(module), name)
    return cls


def make_gateway(kind: str, context: GatewayContext) -> Gateway:
    gateway = gateway_class(kind)(context)
    assert isinstance(gateway, Gateway)
    return gateway
