"""The spec as written: one pydantic model per YAML section, each field checked on its own.

Why the validation is strict (``extra="forbid"``, strict types): a typo in a job spec otherwise costs a
queue wait plus an allocation before anything notices. Rules across fields live in
``launcher.spec.resolution``; ``JobSpec.check`` / ``JobSpec.resolved`` delegate there.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator

from launcher.gateways.vllm_router.command import VllmRouterSection
from launcher.slurm.options import check_sbatch_option, parse_sbatch_option
from launcher.slurm.time import format_time, parse_time
from launcher.spec.errors import Issue, SpecError
from router.config import RouterSettings

if TYPE_CHECKING:
    from launcher.spec.resolved import ResolvedSpec

DEFAULT_JOB_ROOT = "~/rl-launch/jobs"
DEFAULT_ROUTER_PORT_RANGE = (20000, 20999)
DEFAULT_GYM_OVERLAY = "gym_overlay.yaml"

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

# vLLM flags the launcher sets from spec fields (or must own: the port is chosen at start, the API key
# is generated at run time). A copy in vllm_args would win (it comes last) and break the fleet.
_VLLM_MANAGED_FLAGS: dict[str, str] = {
    "--host": "the launcher binds engines itself; remove it",
    "--port": "the launcher picks free engine ports; remove it",
    "--model": "set generation.model instead",
    "--served-model-name": "set generation.served_model_name instead",
    "--tensor-parallel-size": "set generation.tensor_parallel_size instead",
    "-tp": "set generation.tensor_parallel_size instead",
    "--pipeline-parallel-size": "set generation.pipeline_parallel_size instead",
    "-pp": "set generation.pipeline_parallel_size instead",
    "--api-key": "the driver generates the API key at run time (secrets never live in the spec); remove it",
}
_SECRET_WORDS = {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "APIKEY", "CREDENTIALS"}
_SECRET_PAIRS = {("API", "KEY"), ("ACCESS", "KEY"), ("PRIVATE", "KEY")}
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MEM_RE = re.compile(r"\d+[KMGT]?B?", re.IGNORECASE)
_NO_SPACE_RE = re.compile(r"\S+")


class _Section(BaseModel):
    """Every section refuses unknown fields and silent type coercion: ``"8"`` for a GPU count, or a
    misspelt key, is far more likely a mistake than an intent."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=False)


def _str_args(value: Any) -> Any:
    """Lists of command-line arguments: YAML numbers become strings (``["--max-model-len", 8192]`` is
    what people write), booleans are refused (``yes`` would silently become ``True``)."""
    if not isinstance(value, list):
        return value
    out = []
    for item in value:
        if isinstance(item, bool):
            raise ValueError(
                f"arguments must be strings; quote {item!r} (YAML reads yes/no/true as booleans)"
            )
        out.append(str(item) if isinstance(item, int | float) else item)
    return out


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


class Container(_Section):
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


class RoleSlurm(_Section):
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
        return _str_args(v)

    @field_validator("partition", "qos", "constraint")
    @classmethod
    def _one_word(cls, v: str | None) -> str | None:
        return _no_space(v)

    @field_validator("extra_sbatch")
    @classmethod
    def _extras(cls, v: list[str]) -> list[str]:
        return _check_extra_sbatch(v)


class SlurmSection(_Section):
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
        return _str_args(v)

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


class TrainingSection(_Section):
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


class GenerationSection(_Section):
    nodes: int = Field(default=1, ge=1)
    engine: Literal["vllm", "sim", "dynamo-vllm", "dynamo-mocker"] = "vllm"
    model: str | None = Field(default=None, description="Hugging Face id or path of the model to serve")
    served_model_name: str | None = None
    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    engines_per_node: int | None = Field(default=None, ge=1)
    vllm_args: list[str] = Field(default_factory=list)
    startup_timeout_s: float = Field(default=1200.0, gt=0)
    restarts_per_engine: int = Field(default=3, ge=0, description="in-place restarts of one engine")
    restarts_per_run: int | None = Field(default=None, ge=0, description="all restarts; default 2 x engines")
    allow_cpu: bool = False
    sim: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    slurm: RoleSlurm | None = None

    @field_validator("vllm_args", mode="before")
    @classmethod
    def _args_before(cls, v: Any) -> Any:
        return _str_args(v)

    @field_validator("env", mode="before")
    @classmethod
    def _env_before(cls, v: Any) -> Any:
        return _str_env(v)

    @field_validator("vllm_args")
    @classmethod
    def _vllm_args(cls, v: list[str]) -> list[str]:
        for arg in v:
            words = arg.split("=", 1)[0].split()
            flag = words[0] if words else arg
            if flag in _VLLM_MANAGED_FLAGS:
                raise ValueError(f"{flag!r} is set by the launcher: {_VLLM_MANAGED_FLAGS[flag]}")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env(v)


DYNAMO_ENGINES = ("dynamo-vllm", "dynamo-mocker")


class DynamoOptions(_Section):
    """``router.dynamo``: how the launcher-owned Dynamo fleet runs (used with ``router.kind: dynamo``).

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
    listen on the nodes' addresses. ``true`` accepts that on a network you trust (README, "Behind
    Dynamo"); etcd, NATS and the front URL check the job's secrets either way. No effect with ``cluster:
    local``, where everything listens on loopback."""

    @field_validator("frontend_args", "worker_args", mode="before")
    @classmethod
    def _args_before(cls, v: Any) -> Any:
        return _str_args(v)


class RouterSection(RouterSettings):
    """The spec's ``router:`` section: which front the fleet sits behind (``kind``, see
    ``launcher.gateways``), ``RouterSettings`` for our own router (validated there, once, with the
    policy's own options), and where the driver reserves the front's port. The driver hands these
    settings whole to ``RouterConfig.from_settings``; nothing is copied field by field."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, validate_default=False)

    kind: Literal["builtin", "vllm-router", "dynamo", "ray-serve"] = Field(
        default="builtin", description="the front in front of the fleet"
    )
    serve_routing: Literal["policy", "power_of_two"] = Field(
        default="policy",
        description="ray-serve only: route by our policy inside Serve (policy) or by Serve's default",
    )
    port_range: tuple[int, int] = DEFAULT_ROUTER_PORT_RANGE
    # vllm-router (rules across these fields: ``resolution._router_issues``)
    mode: Literal["managed", "external"] | None = Field(
        default=None, description="vllm-router: start it (managed) or attach to a running one"
    )
    url: str | None = Field(default=None, description="external vllm-router's base URL (no /v1)")
    vllm_router: VllmRouterSection | None = None
    # dynamo (rules: ``resolution._dynamo_issues``)
    dynamo: DynamoOptions = Field(default_factory=DynamoOptions)

    @field_validator("serve_routing")
    @classmethod
    def _serve_routing(cls, v: str, info: ValidationInfo) -> str:
        if v != "policy" and info.data.get("kind") != "ray-serve":
            raise ValueError("applies to router.kind: ray-serve only; remove it or set kind: ray-serve")
        return v

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


class GymSection(_Section):
    overlay: str = Field(
        default=DEFAULT_GYM_OVERLAY, description="where the driver writes Gym's config overlay"
    )
    model_name: str | None = None


class JobSpec(_Section):
    """The job spec as written (defaults not yet derived). Use ``resolved()`` for a runnable view."""

    name: str = Field(description="job name, e.g. grpo-qwen3-8b ([A-Za-z0-9._-], at most 64 characters)")
    cluster: Literal["slurm", "local"] = "slurm"
    job_root: str = DEFAULT_JOB_ROOT
    slurm: SlurmSection = Field(default_factory=SlurmSection)
    training: TrainingSection
    generation: GenerationSection = Field(default_factory=GenerationSection)
    router: RouterSection = Field(default_factory=RouterSection)
    gym: GymSection = Field(default_factory=GymSection)

    _source: Path | None = PrivateAttr(default=None)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RE.fullmatch(v):
            raise ValueError(
                f"{v!r} must be 1-64 characters of letters, digits, '.', '_' or '-', starting with a letter "
                "or digit (it names the Slurm job and the job directory)"
            )
        return v

    @field_validator("job_root")
    @classmethod
    def _job_root(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("is empty; give a directory (default ~/rl-launch/jobs)")
        if any(ch.isspace() for ch in v):
            raise ValueError(f"{v!r} contains whitespace, which Slurm's #SBATCH --output cannot take")
        return v

    @property
    def source(self) -> Path | None:
        """The file this spec was loaded from (absolute), if any."""
        return self._source

    def check(self) -> list[Issue]:
        """Cross-field rules that a single field cannot express (``resolution.semantic_issues``)."""
        from launcher.spec.resolution import semantic_issues  # resolution imports this module

        return semantic_issues(self)

    def resolved(self) -> ResolvedSpec:
        """Every default filled and every rule checked; raises ``SpecError`` if the spec cannot run."""
        issues = self.check()
        if issues:
            raise SpecError(str(self._source) if self._source else "<spec>", issues)
        from launcher.spec.resolution import resolve

        return resolve(self)
