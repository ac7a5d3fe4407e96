"""The resolved view: every default filled in, frozen; what the driver, ``render`` and ``submit`` read.

``to_yaml`` writes it and ``launcher.spec.loading.load_snapshot`` reads it back, so a job can run
exactly the spec that was submitted (not whatever the file says when the job starts).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict

from launcher.engines.kinds import engine_settings
from launcher.spec.schema import Container, EngineName, RouterSection
from router.adapters.plan import LoraPlan


class _Resolved(BaseModel):
    """Frozen, and unknown fields refused: a snapshot from another version must fail loudly."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class ResolvedResources(_Resolved):
    """One role's Slurm resources after merging ``slurm`` with the role's overrides."""

    partition: str | None
    qos: str | None
    constraint: str | None
    gpus_per_node: int
    gpu_request: Literal["gpus-per-node", "gres"]
    cpus_per_task: int | None
    mem: str | None
    exclusive: bool
    extra_sbatch: tuple[str, ...]


class ResolvedSlurm(_Resolved):
    account: str | None
    time: str
    """Normalized ``[D-]HH:MM:SS``."""
    time_min: int
    """Whole minutes, rounded up (submitit's ``timeout_min``)."""
    container: Container | None
    layout: Literal["single", "hetjob"]
    """``single``: one allocation split by node index; ``hetjob``: component 0 training, 1 generation."""


class ResolvedTraining(_Resolved):
    nodes: int
    command: str
    env: dict[str, str]
    resources: ResolvedResources | None
    """``None`` with ``cluster: local``."""


class ResolvedElastic(_Resolved):
    """``generation.elastic`` with its capacity per engine filled in (``launcher.fleet.elastic.tail``)."""

    floor_nodes: int
    shrink_below: float
    for_s: float
    grow_back: bool
    grow_above: float
    capacity_per_engine: int


class _SharedResolvedGeneration(_Resolved):
    """The resolved fields of ``generation`` every engine kind has."""

    nodes: int
    engine: EngineName
    model: str | None
    served_model_name: str
    """What clients (Gym) send as ``model``: ``served_model_name`` or ``model``, else the engine kind's
    default (``sim`` for a sim engine without either)."""
    tensor_parallel_size: int
    pipeline_parallel_size: int
    gpus_per_engine: int
    """TP x PP: GPUs one engine occupies (0 on CPU-only nodes)."""
    engines_per_node: int
    num_engines: int
    """nodes x engines_per_node: the fleet size the router starts with."""
    startup_timeout_s: float
    restarts_per_engine: int
    restarts_per_run: int | None
    env: dict[str, str]
    resources: ResolvedResources | None
    fleet: str | None = None
    """The standing fleet this job attaches to (then it starts no engines: ``nodes`` and ``num_engines``
    are 0 and the fleet's model, URL and a consumer key of its own are the job's)."""
    fleet_wait_s: float = 600.0
    drain_timeout_s: float = 300.0
    elastic: ResolvedElastic | None = None
    owner: Literal["launcher", "trainer"] = "launcher"
    """``trainer``: the training command starts the engines and registers them (``num_engines`` is 0 and
    rl-launch starts, restarts and grows none)."""

    lora: LoraPlan | None = None
    """``generation.lora``: the engines' LoRA flags and the router's adapter table (None: no adapters)."""

    @property
    def trainer_owned(self) -> bool:
        return self.owner == "trainer"


class ResolvedGeneration(*engine_settings(), _SharedResolvedGeneration):  # type: ignore[misc]
    """The fleet, sized; with every engine kind's own fields as the spec gave them (``vllm_args``...)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)


ResolvedRouter = RouterSection
"""The front's section as the spec gave it: the same model, checked by the same rules when a snapshot is
read back (its port range comes back from YAML as a list, which the section's own validator takes)."""


class ResolvedConsumer(_Resolved):
    weight: float
    admin: bool
    adapters: tuple[str, ...] = ()
    """The LoRA adapters the fleet reserves for the job (``router.consumers.Consumer.adapters``)."""


class ResolvedFleet(_Resolved):
    """A standing fleet's sharing rules (``fleet:``): what the router's fair share and the consumer
    registration read."""

    capacity: int
    """In-flight requests shared fairly: the spec's, else engines x the engine's max_num_seqs."""
    default_weight: float
    consumers: dict[str, ResolvedConsumer]

    def consumer(self, job_name: str) -> ResolvedConsumer:
        """The rules for a job of this name: its own entry, else the default weight and no admin."""
        return self.consumers.get(job_name) or ResolvedConsumer(weight=self.default_weight, admin=False)


class ResolvedRecord(_Resolved):
    enabled: bool
    max_bytes: int
    keep_files: int
    text: bool


class ResolvedGym(_Resolved):
    overlay: str
    model_name: str


class ResolvedSpec(_Resolved):
    """Everything the driver, ``render`` and ``submit --dry-run`` need, with no default left implicit."""

    name: str
    cluster: Literal["slurm", "local"]
    spec_path: str | None
    """Absolute path of the spec file (the sbatch script re-reads it inside the allocation)."""
    job_root: str
    """Absolute, ``~`` expanded on the submitting machine."""
    total_nodes: int
    slurm: ResolvedSlurm | None
    """``None`` with ``cluster: local``."""
    training: ResolvedTraining
    generation: ResolvedGeneration
    router: ResolvedRouter
    gym: ResolvedGym
    record: ResolvedRecord = ResolvedRecord(enabled=True, max_bytes=256 << 20, keep_files=4, text=False)
    """The router's request record (``<job>/record``)."""
    fleet: ResolvedFleet | None = None
    """Set for a standing fleet (``rl-launch fleet up``): it runs no training (``training.nodes`` 0)."""

    @property
    def role(self) -> Literal["job", "fleet", "attached"]:
        """``fleet``: a standing fleet; ``attached``: a job on a standing fleet; ``job``: both in one."""
        if self.fleet is not None:
            return "fleet"
        return "attached" if self.generation.fleet else "job"

    def job_dir(self, job_id: str | int) -> Path:
        """``<job_root>/<name>-<job_id>``; the sbatch template builds the same path from SLURM_JOB_ID."""
        return Path(self.job_root) / f"{self.name}-{job_id}"

    def kind_labels(self) -> dict[str, str]:
        """The front and the engines in the kinds' own words (``validate``, ``list``, ``status``):
        recorded by ``submit`` (queued jobs) and by the driver (``state.json``)."""
        from launcher.engines.kinds import engine_kind
        from launcher.gateways.kinds import front_kind

        attached = self.generation.fleet
        if attached is not None:  # no front or engines of its own: the standing fleet's serve it
            return {
                "front": f"the router of standing fleet {attached!r}",
                "engines": f"standing fleet {attached!r}",
            }
        return {
            "front": front_kind(self.router.kind).label(self.router),
            "engines": (
                f"{self.generation.engine} engines the trainer registers"
                if self.generation.trainer_owned
                else engine_kind(self.generation.engine).label(self.generation)
            ),
        }

    def gym_overlay_path(self, job_dir: str | os.PathLike[str]) -> Path:
        """Where the Gym overlay goes: ``gym.overlay`` if absolute, else inside ``job_dir``."""
        overlay = Path(os.path.expanduser(self.gym.overlay))
        return overlay if overlay.is_absolute() else Path(job_dir) / overlay

    def to_yaml(self) -> str:
        """The resolved spec as YAML (what ``submit --dry-run`` prints)."""
        return yaml.safe_dump(
            self.model_dump(mode="json"), sort_keys=False, default_flow_style=None, width=100
        )
