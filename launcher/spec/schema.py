"""The spec's sections as written: one pydantic model per YAML section, each field checked on its own.

Why the validation is strict (``extra="forbid"``, strict types): a typo in a job spec otherwise costs a
queue wait plus an allocation before anything notices. The whole spec (``JobSpec``) and its rules across
fields are in ``launcher.spec.job`` and ``launcher.spec.rules``.

Two sections belong to the kinds: ``router:`` is the section of the front ``router.kind`` names
(``launcher.gateways.kinds``), and ``generation:`` holds, beside its shared fields, every engine kind's own
(``launcher.engines.kinds``: ``vllm_args``, ``sim``...), flat as users write them.
"""

from __future__ import annotations

import itertools
import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from launcher.engines.kinds import DEFAULT_ENGINE_KIND, ENGINE_KINDS, engine_settings
from launcher.gateways.kinds import router_section_type
from launcher.slurm.options import check_sbatch_option, parse_sbatch_option
from launcher.slurm.time import format_time, parse_time
from launcher.spec.section import Section, str_args
from router.adapters.plan import LoraPlan

DEFAULT_JOB_ROOT = "~/rl-launch/jobs"
DEFAULT_GYM_OVERLAY = "gym_overlay.yaml"

_SECRET_WORDS = {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "APIKEY", "CREDENTIALS"}
_SECRET_PAIRS = {("API", "KEY"), ("ACCESS", "KEY"), ("PRIVATE", "KEY")}
_ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MEM_RE = re.compile(r"\d+[KMGT]?B?", re.IGNORECASE)
_NO_SPACE_RE = re.compile(r"\S+")
ADAPTER_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
"""An adapter's name as ``fleet.consumers.<job>.adapters`` reserves it (the router's consumer file takes the
same: ``router.consumers``)."""


def _str_env(value: Any) -> Any:
    """Environment values are strings; YAML numbers are converted, booleans refused (ambiguous)."""
    if not isinstance(value, dict):
        return value
    out = {}
    for key, item in value.items():
        if isinstance(item, bool):
            raise ValueError(f'{key}: environment values are strings; quote {item!r} (e.g. "1" or "true")')
        out[key] = str(item) if isinstance(item, int | float) else item
    return out


def _check_env(value: dict[str, str]) -> dict[str, str]:
    for key in value:
        if not _ENV_KEY_RE.fullmatch(key):
            raise ValueError(f"{key!r} is not a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
        if looks_secret(key):
            raise ValueError(
                f"{key} looks like a secret, and secrets never live in the spec: export it in the shell "
                "you submit from (Slurm passes your environment to the job)"
            )
    return value


def looks_secret(name: str) -> bool:
    """Whether an environment variable name names a credential (``HF_TOKEN``, ``WANDB_API_KEY``), by
    whole ``_``-separated words, so that ``TOKENIZERS_PARALLELISM`` is not one."""
    words = name.upper().split("_")
    return bool(_SECRET_WORDS.intersection(words)) or any(
        pair in _SECRET_PAIRS for pair in itertools.pairwise(words)
    )


def _check_extra_sbatch(value: list[str]) -> list[str]:
    seen: set[str] = set()
    for opt in value:
        check_sbatch_option(opt)
        name = parse_sbatch_option(opt)[0]
        if name in seen:
            raise ValueError(f"'--{name}' is given twice; keep one")
        seen.add(name)
    return [opt.strip() for opt in value]


def _mem(value: Any) -> Any:
    """sbatch ``--mem``: an integer is megabytes (as sbatch reads it); strings like ``200G`` or ``0``."""
    if isinstance(value, bool):
        raise ValueError("must be a memory size like '200G' or '0' (all of the node's memory)")
    if isinstance(value, int):
        value = str(value)
    if isinstance(value, str) and not _MEM_RE.fullmatch(value.strip()):
        raise ValueError(f"{value!r} is not a memory size; use e.g. '200G', '512000M' or '0' (all memory)")
    return value.strip() if isinstance(value, str) else value


def _no_space(value: str | None) -> str | None:
    if value is not None and not _NO_SPACE_RE.fullmatch(value):
        raise ValueError(f"{value!r} must be one word without spaces (Slurm #SBATCH lines split on them)")
    return value


class Container(Section):
    """pyxis/enroot container for the job's ``srun`` steps (engines, Ray, training)."""

    image: str = Field(description="container image, e.g. nvcr.io/nvidia/nemo-rl:v0.4 or a .sqsh path")
    mounts: list[str] = Field(default_factory=list, description="SRC:DST[:FLAGS] bind mounts")
    workdir: str | None = None

    @field_validator("image", "workdir")
    @classmethod
    def _one_word(cls, v: str | None) -> str | None:
        return _no_space(v)

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, v: list[str]) -> list[str]:
        for m in v:
            if "," in m or not re.fullmatch(r"[^:\s]+:[^:\s]+(:[^:\s]+)?", m):
                raise ValueError(f"mount {m!r} must be SRC:DST or SRC:DST:FLAGS (one per list entry)")
        return v


class RoleSlurm(Section):
    """Per-role Slurm resources. Any value that differs from ``slurm`` makes the job heterogeneous."""

    partition: str | None = None
    qos: str | None = None
    constraint: str | None = None
    gpus_per_node: int | None = Field(default=None, ge=0)
    cpus_per_task: int | None = Field(default=None, ge=1)
    mem: str | None = None
    exclusive: bool | None = None
    extra_sbatch: list[str] = Field(default_factory=list)

    @field_validator("mem", mode="before")
    @classmethod
    def _mem_before(cls, v: Any) -> Any:
        return _mem(v)

    @field_validator("extra_sbatch", mode="before")
    @classmethod
    def _extras_before(cls, v: Any) -> Any:
        return str_args(v)

    @field_validator("partition", "qos", "constraint")
    @classmethod
    def _one_word(cls, v: str | None) -> str | None:
        return _no_space(v)

    @field_validator("extra_sbatch")
    @classmethod
    def _extras(cls, v: list[str]) -> list[str]:
        return _check_extra_sbatch(v)


class SlurmSection(Section):
    """Slurm settings shared by both roles (ignored with ``cluster: local``)."""

    account: str | None = None
    partition: str | None = None
    qos: str | None = None
    time: str | None = Field(default=None, description="wall time, e.g. '04:00:00' or '1-00:00:00'")
    constraint: str | None = None
    exclusive: bool = False
    gpus_per_node: int = Field(default=0, ge=0)
    gpu_request: Literal["gpus-per-node", "gres"] = "gpus-per-node"
    cpus_per_task: int | None = Field(default=None, ge=1)
    mem: str | None = None
    extra_sbatch: list[str] = Field(default_factory=list)
    container: Container | None = None

    @field_validator("mem", mode="before")
    @classmethod
    def _mem_before(cls, v: Any) -> Any:
        return _mem(v)

    @field_validator("extra_sbatch", mode="before")
    @classmethod
    def _extras_before(cls, v: Any) -> Any:
        return str_args(v)

    @field_validator("time", mode="before")
    @classmethod
    def _time(cls, v: Any) -> Any:
        if v is None:
            return v
        return format_time(parse_time(v))

    @field_validator("account", "partition", "qos", "constraint")
    @classmethod
    def _one_word(cls, v: str | None) -> str | None:
        return _no_space(v)

    @field_validator("extra_sbatch")
    @classmethod
    def _extras(cls, v: list[str]) -> list[str]:
        return _check_extra_sbatch(v)


class TrainingSection(Section):
    nodes: int = Field(default=1, ge=1)
    command: str = Field(description="the training command, run with RL_POLICY_BASE_URL set to the router")
    env: dict[str, str] = Field(default_factory=dict)
    slurm: RoleSlurm | None = None

    @field_validator("env", mode="before")
    @classmethod
    def _env_before(cls, v: Any) -> Any:
        return _str_env(v)

    @field_validator("command")
    @classmethod
    def _command(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("is empty; give the command that runs training")
        return v.strip()

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env(v)


EngineName = Literal[tuple(ENGINE_KINDS)]  # type: ignore[valid-type]
EngineOwner = Literal["launcher", "trainer"]
"""``generation.engine``: a name in ``launcher.engines.kinds.ENGINE_KINDS``."""


class ElasticSection(Section):
    """The tail policy (``launcher.fleet.elastic.tail``), off unless given: once a step's load has reached
    ``shrink_below`` of the fleet's capacity, in-flight requests below it for ``for_s`` shrink the fleet
    to ``floor_nodes`` (drained, handed back to Slurm); the next step's start (a new weight version) or
    load above ``grow_above`` of the smaller fleet's capacity grows it back."""

    floor_nodes: int = Field(default=1, ge=1, description="generation nodes the tail policy keeps")
    shrink_below: float = Field(default=0.25, gt=0, lt=1, description="in-flight fraction of capacity")
    for_s: float = Field(default=30.0, gt=0, description="how long in-flight must stay below it")
    grow_back: bool = Field(default=True, description="grow back at the next step's start")
    grow_above: float = Field(default=0.75, gt=0, le=1, description="in-flight fraction that grows back")
    capacity_per_engine: int | None = Field(
        default=None, ge=1, description="requests one engine runs at once; default its max_num_seqs"
    )


class LoraSection(LoraPlan):
    """``generation.lora``: the router's ``LoraPlan`` with the spec's strictness (``"8"`` for a rank is
    refused, as everywhere in the spec); an instance is a ``LoraPlan``, so the router takes it as is."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class _SharedGeneration(Section):
    """The fields of ``generation:`` every engine kind has."""

    nodes: int = Field(default=1, ge=1)
    engine: EngineName = DEFAULT_ENGINE_KIND
    owner: EngineOwner = Field(
        default="launcher",
        description="who starts the engines: launcher (rl-launch, on the generation nodes) or trainer (the "
        "training command starts its own, e.g. NeMo-RL's, and registers them with the router under the "
        "job's registration URL, $RL_ROUTER_REGISTRATION_URL; rl-launch starts none and restarts none)",
    )
    model: str | None = Field(default=None, description="Hugging Face id or path of the model to serve")
    served_model_name: str | None = None
    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    engines_per_node: int | None = Field(default=None, ge=1)
    startup_timeout_s: float = Field(default=1200.0, gt=0)
    restarts_per_engine: int = Field(default=3, ge=0, description="in-place restarts of one engine")
    restarts_per_run: int | None = Field(default=None, ge=0, description="all restarts; default 2 x engines")
    env: dict[str, str] = Field(default_factory=dict)
    slurm: RoleSlurm | None = None
    fleet: str | None = Field(
        default=None,
        description="attach to this standing fleet (rl-launch fleet up) instead of starting engines: its "
        "name under job_root, or its job directory",
    )
    fleet_wait_s: float = Field(
        default=600.0, gt=0, description="how long submit waits for a standing fleet still queued"
    )
    drain_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="how long a node being given back (fleet shrink, the tail policy) waits for its "
        "requests in flight before they are aborted",
    )
    elastic: ElasticSection | None = Field(default=None, description="the tail policy; off when unset")
    lora: LoraSection | None = Field(
        default=None,
        description="serve LoRA adapters (router.adapters.plan): the engines get vLLM's LoRA flags and "
        "runtime loading, the router the adapter table; off when unset",
    )

    @field_validator("env", mode="before")
    @classmethod
    def _env_before(cls, v: Any) -> Any:
        return _str_env(v)

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env(v)

    @field_validator("fleet")
    @classmethod
    def _fleet(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("is empty; give the standing fleet's name (rl-launch list) or leave it unset")
        return v.strip() if v is not None else None


class GenerationSection(*engine_settings(), _SharedGeneration):  # type: ignore[misc]
    """The fleet: the shared fields, then every engine kind's own (``EngineKind.settings``, e.g.
    ``vllm_args``, ``sim``); a field of a kind other than ``engine`` is refused by the spec's rules
    (``launcher.spec.rules``)."""


RouterSection = router_section_type()
"""The spec's ``router:`` section: the section of the front ``kind`` names (``launcher.gateways.kinds``),
each refusing the fields of the others."""


class FleetConsumer(Section):
    """One job the fleet's owner names (by its spec's ``name``): its share and whether it may refit."""

    weight: float = Field(default=1.0, gt=0, description="its share of the in-flight capacity, relative")
    admin: bool = Field(
        default=False, description="may pause, refit and change the serving set (else: generate only)"
    )
    adapters: list[str] = Field(
        default_factory=list,
        description="LoRA adapters reserved for this job: only it (and the fleet's owner) may load, unload "
        "or call them (needs generation.lora)",
    )

    @field_validator("adapters")
    @classmethod
    def _adapters(cls, v: list[str]) -> list[str]:
        for name in v:
            if not ADAPTER_NAME_RE.fullmatch(name):
                raise ValueError(f"{name!r} must be 1-128 characters of letters, digits, '.', '_' or '-'")
        twice = sorted({n for n in v if v.count(n) > 1})
        if twice:
            raise ValueError(f"{', '.join(map(repr, twice))} listed twice; keep one")
        return v


class FleetSection(Section):
    """A standing fleet (``rl-launch fleet up``): generation only, running until ``fleet down``, its time
    limit or a cancel, attached to by jobs whose spec says ``generation: {fleet: NAME}``."""

    capacity: int | None = Field(
        default=None,
        ge=1,
        description="in-flight requests shared fairly between consumers; default engines x max_num_seqs",
    )
    default_weight: float = Field(default=1.0, gt=0, description="the weight of a job not in consumers")
    consumers: dict[str, FleetConsumer] = Field(
        default_factory=dict, description="by job name: weight, admin (may refit)"
    )


class RecordSection(Section):
    """The router's request record (``router.record``): one JSONL line per generation request in
    ``<job>/record``, for ``rl-launch status``'s tail view and ``rl-launch bench replay --trace``."""

    enabled: bool = True
    max_mb: float = Field(
        default=256.0, gt=0, description="the record's size cap on disk, rotated files included"
    )
    keep_files: int = Field(default=4, ge=1, description="files the cap is split across (rotation)")
    text: bool = Field(
        default=False, description="also keep the prompt text (never by default: the job directory is shared)"
    )


class GymSection(Section):
    overlay: str = Field(
        default=DEFAULT_GYM_OVERLAY, description="where the driver writes Gym's config overlay"
    )
    model_name: str | None = None
