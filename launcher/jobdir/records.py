"""The typed records that processes exchange through the job directory.

One module owns each shape: the engine host writes ``EngineListing``, the fleet controller writes
``ControlRequests`` and, in the job state, ``FleetSnapshot`` and ``GatewaySnapshot`` (the driver's
gateway watcher writes the latter too, for a front that owns its engines), the driver writes
``JobResult`` and the job state, ``rl-launch submit`` writes ``SubmittedJob``. Readers parse with
``from_dict`` (``from_state`` for the parts of the job state), which tolerates missing keys (a file
written by an older launcher) instead of raising in a dashboard.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Phases a job's state passes through, in order; the last three are final.
PHASES = (
    "submitted",
    "queued",
    "starting",
    "ray_up",
    "engines_ready",
    "router_serving",
    "training",
    "stopping",
    "finished",
    "failed",
    "cancelled",
)
FINAL_PHASES = frozenset({"finished", "failed", "cancelled"})
LOST = "lost"
"""What ``list`` and ``status`` show, instead of the phase its state still names, for a job whose driver
is gone without recording a result (SIGKILLed, the OOM killer, its node or allocation lost): the state
said ``training`` for good, and nothing of the job serves any more."""


def lost_detail(name: str, why: str, last_phase: str) -> str:
    """The one sentence ``list`` and ``status`` give a lost job (``why``: what says so)."""
    return (
        f"{why}: the job ended without a result (last phase {last_phase}); rl-launch cancel {name} ends "
        f"what it left, rl-launch logs {name} shows how far it got"
    )


# Engine state written for every engine once the job is over: no finished job shows HEALTHY engines.
STOPPED = "STOPPED"


def engine_id(node_index: int, index: int) -> str:
    """The one name of an engine: in the fleet state, the dashboard, events and ``logs --engine``."""
    return f"node{node_index}-{index}"


@dataclass
class EngineEntry:
    index: int
    url: str = ""
    api_url: str = ""
    node: str = ""
    node_index: int = 0
    generation: int = 0
    log: str = ""
    error: str | None = None

    @property
    def id(self) -> str:
        return engine_id(self.node_index, self.index)

    @classmethod
    def from_dict(cls, d: dict[str, Any], node_index: int = 0) -> EngineEntry:
        return cls(
            index=int(d.get("index", 0)),
            url=str(d.get("url") or ""),
            api_url=str(d.get("api_url") or ""),
            node=str(d.get("node") or ""),
            node_index=int(d.get("node_index", node_index)),
            generation=int(d.get("generation", 0)),
            log=str(d.get("log") or ""),
            error=d.get("error"),
        )


@dataclass
class EngineListing:
    """``engines/node-<i>.urls.json``: what one node's engine host serves (or why it could not)."""

    node: str
    node_index: int
    engines: list[EngineEntry] = field(default_factory=list)
    ready_s: float | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], node_index: int) -> EngineListing:
        idx = int(d.get("node_index", node_index))
        return cls(
            node=str(d.get("node") or ""),
            node_index=idx,
            engines=[EngineEntry.from_dict(e, idx) for e in d.get("engines") or [] if isinstance(e, dict)],
            ready_s=d.get("ready_s"),
            error=d.get("error"),
        )


@dataclass
class ControlRequests:
    """``engines/node-<i>.control.json``: restart requests, ``{engine index: generation}``; a request is
    pending while its generation is newer than the engine's."""

    restart: dict[int, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"restart": {str(k): v for k, v in self.restart.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ControlRequests:
        raw = d.get("restart") or {}
        return cls(restart={int(k): int(v) for k, v in raw.items()})


@dataclass
class JobResult:
    """``result.json``, written once, last, by the driver: how the job ended.

    ``outcome`` is one of ``finished``, ``failed``, ``cancelled``, ``time limit``; ``signal`` names the
    signal that stopped it (``SIGTERM``, ``SIGINT``, ``SIGUSR2``) when one did. A signal's result is
    written twice: at once with ``torn_down`` false (Slurm's SIGKILL may follow before the teardown
    ends), and again with ``torn_down`` true once nothing of the job runs any more."""

    exit_code: int
    reason: str
    outcome: str = ""
    signal: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    t: float | None = None
    torn_down: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobResult:
        code = int(d.get("exit_code", 1))
        return cls(
            exit_code=code,
            reason=str(d.get("reason") or ""),
            outcome=str(d.get("outcome") or ("finished" if code == 0 else "failed")),
            signal=d.get("signal"),
            timings=dict(d.get("timings") or {}),
            t=d.get("t"),
            torn_down=bool(d.get("torn_down", True)),
        )


@dataclass
class SubmittedJob:
    """``submitted.json``, written by ``rl-launch submit`` before it returns: the job exists for ``list``,
    ``status``, ``logs`` and ``cancel`` from that moment, while Slurm still has it queued."""

    job_id: str
    name: str
    cluster: str
    t: float
    spec_snapshot: str = ""
    job_dir: str = ""
    front: str = ""
    """The front and the engines in a few words (the kinds' labels), for ``list`` and ``status`` while
    the job is queued; the driver records the same in ``state.json`` once it runs."""
    engines: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SubmittedJob:
        return cls(
            job_id=str(d.get("job_id") or ""),
            name=str(d.get("name") or ""),
            cluster=str(d.get("cluster") or "slurm"),
            t=float(d.get("t") or 0.0),
            spec_snapshot=str(d.get("spec_snapshot") or ""),
            job_dir=str(d.get("job_dir") or ""),
            front=str(d.get("front") or ""),
            engines=str(d.get("engines") or ""),
        )


@dataclass
class FleetEngineRecord:
    """One engine in the fleet controller's snapshot (``state.json["fleet"]["engines"]``, written from
    ``launcher.fleet.FleetHealth.snapshot``): the fields a reader of the job directory shows."""

    id: str | int
    """As written: the controller writes ``engine_id`` (``node0-1``); a file written by hand or an older
    launcher may hold an index."""
    node: str = ""
    url: str = ""
    """The engine's URL (its ``api_url`` when only that was written)."""
    state: str = ""
    """The controller's ``EngineState`` word; empty when none was written."""
    restarts: int = 0
    last_reason: str = ""

    @classmethod
    def from_dict(cls, d: dict[str, Any], index: int) -> FleetEngineRecord:
        """``index``: the entry's position, its id when the entry names none."""
        return cls(
            id=d.get("id", index),
            node=str(d.get("node") or ""),
            url=str(d.get("url") or d.get("api_url") or ""),
            state=str(d.get("state") or ""),
            restarts=int(d.get("restarts") or 0),
            last_reason=str(d.get("last_reason") or ""),
        )


@dataclass
class FleetSnapshot:
    """``state.json["fleet"]``: the fleet controller's last snapshot of the fleet (engines, totals,
    restart budget, policy, recent events), marked ``final`` once the job is over.

    ``engines`` is None when the snapshot holds no engine list (a reader then lists the engines from
    the engine listings); ``figures`` is everything else as written, for a reader that shows it whole."""

    engines: list[FleetEngineRecord] | None
    fatal: str | None = None
    """Why the controller gave up on the fleet (the restart budget is spent), or None."""
    final: bool = False
    figures: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> FleetSnapshot | None:
        """The snapshot in a job state (``JobDir.read_state``); None before the controller wrote one."""
        d = state.get("fleet")
        if not isinstance(d, dict) or not d:
            return None
        raw = d.get("engines")
        engines = (
            [FleetEngineRecord.from_dict(e, i) for i, e in enumerate(raw) if isinstance(e, dict)]
            if isinstance(raw, list)
            else None
        )
        fatal = d.get("fatal")
        return cls(
            engines=engines,
            fatal=str(fatal) if fatal else None,
            final=bool(d.get("final")),
            figures={k: v for k, v in d.items() if k != "engines"},
        )


@dataclass
class GatewayMemberRecord:
    """One backend in the gateway's own view (``launcher.gateways.GatewayMember``)."""

    url: str
    healthy: bool | None = None
    """None when the gateway does not report health per backend, or the job is over."""
    detail: str = ""


@dataclass
class GatewaySnapshot:
    """``state.json["gateway"]``: the front's own view of the fleet (``launcher.gateways.GatewayView``),
    written every tick by the fleet controller or the driver's gateway watcher, and marked ``final``
    (stopped, no member healthy) once the job is over.

    ``kind``, ``base_url`` and ``reachable`` are None when not written: the watcher's view of a failed
    tick names only the kind, and a reader must not invent the rest."""

    kind: str | None = None
    base_url: str | None = None
    reachable: bool | None = None
    detail: str = ""
    final: bool = False
    members: list[GatewayMemberRecord] = field(default_factory=list)
    """The members that name a URL (an entry without one cannot be matched to an engine)."""

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> GatewaySnapshot | None:
        """The view in a job state (``JobDir.read_state``); None when no gateway view was written."""
        d = state.get("gateway")
        if not isinstance(d, dict):
            return None
        return cls(
            kind=d.get("kind"),
            base_url=d.get("base_url"),
            reachable=d.get("reachable"),
            detail=str(d.get("detail") or ""),
            final=bool(d.get("final")),
            members=[
                GatewayMemberRecord(
                    url=str(m["url"]), healthy=m.get("healthy"), detail=str(m.get("detail") or "")
                )
                for m in d.get("members") or []
                if isinstance(m, dict) and m.get("url")
            ],
        )
