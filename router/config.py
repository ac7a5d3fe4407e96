"""``RouterConfig``: every router setting in one pydantic model, validated once.

Before this model the same settings were checked three times (click callbacks, ``GenerationRouter``, the
spec's router section) with copied error text that drifted, and five of them were copied by hand from the
spec into the Ray actor. Now the CLI, the spec and the driver build one ``RouterConfig`` and hand it whole
to ``GenerationRouter`` / ``GenerationRouterActor`` (it pickles for Ray).

Two layers, because a job spec must not set everything:

* ``RouterSettings`` holds what a job spec's ``router:`` section may set (policy and its options,
  timeouts, retries, the no-healthy status, the request size cap). Its errors carry the field's location,
  so a spec loader that prefixes ``router.`` reports ``router.policy_options.load_slack: ...``.
* ``RouterConfig`` adds what the process running the router decides: address, secrets, whether a fleet
  controller owns the serving set (``health_managed``), active probing, admin-API limits.

Secrets (``api_key``, ``admin_token``, ``backend_api_key``, ``registration_capability``) are ``SecretStr``
fields excluded from ``model_dump``/``model_dump_json`` and hidden from ``repr``: a saved or logged config
never holds them.

This module must stay light (no aiohttp, Ray or ``router.server``): ``rl-launch validate`` imports it.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import typing
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from router.adapters.plan import LoraPlan
from router.http.limits import DEFAULT_HTTP_LIMITS, HttpLimits
from router.http.status import DEFAULT_NO_HEALTHY_BACKEND_STATUS, validate_no_healthy_status
from router.policies import DEFAULT_POLICY, POLICIES

DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024
DEFAULT_RECORD_MAX_BYTES = 256 * 1024 * 1024
SECRET_FIELDS = ("api_key", "admin_token", "backend_api_key", "registration_capability")
# Worker processes beyond this cost more in the shared decision service than they add in parsing and
# relaying: every decision crosses one process (see router/multiprocess/decisions.py).
MAX_WORKERS = 64
DEFAULT_WORKERS_CAP = 8


def default_worker_count() -> int:
    """The cores this process may run on (its CPU affinity, which Slurm and taskset narrow; not the
    machine's count), capped at ``DEFAULT_WORKERS_CAP``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, DEFAULT_WORKERS_CAP))


def _option_error(key: str, message: str, value: Any) -> ValidationError:
    """A ``ValidationError`` located at ``<key>`` inside the field: raised from the ``policy_options``
    validator, pydantic reports it at ``policy_options.<key>``, so a spec loader can point at its line."""
    loc: tuple[str, ...] = (key,) if key else ()
    return ValidationError.from_exception_data(
        "RouterSettings",
        [InitErrorDetails(type=PydanticCustomError("value_error", message), loc=loc, input=value)],
    )


def _options_model(policy: str) -> type[BaseModel]:
    """A strict model of the policy constructor's keyword parameters (names, types, defaults)."""
    cls = POLICIES[policy]
    hints = typing.get_type_hints(cls.__init__)
    fields: dict[str, Any] = {}
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        default = ... if param.default is param.empty else param.default
        fields[name] = (hints.get(name, Any), default)
    return create_model(  # type: ignore[call-overload,no-any-return]
        f"{cls.__name__}Options", __config__=ConfigDict(extra="forbid", strict=True), **fields
    )


def validate_policy_options(policy: str, options: dict[str, Any]) -> dict[str, Any]:
    """Check ``options`` against ``policy``'s constructor and build it once; raise a ``ValidationError``
    at ``policy_options.<key>`` for an unknown key, a wrong type or a value the policy refuses."""
    model = _options_model(policy)
    known = ", ".join(model.model_fields) or "none"
    for key in options:
        if key not in model.model_fields:
            raise _option_error(
                str(key),
                f"not an option of policy {policy!r} (its options: {known})",
                options[key],
            )
    try:
        model.model_validate(options)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = str(err["loc"][0]) if err["loc"] else ""
        raise _option_error(key, f"{err['msg']} (got {options.get(key)!r})", options.get(key)) from None
    try:
        POLICIES[policy](**options)
    except (TypeError, ValueError) as exc:
        # The policy's own range checks: name the key its message mentions, if any.
        key = next((k for k in options if k in str(exc)), "")
        raise _option_error(key, str(exc), options.get(key, options)) from None
    return dict(options)


class RouterSettings(BaseModel):
    """The router settings a job spec's ``router:`` section may set (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    policy: str = Field(default=DEFAULT_POLICY, description="routing policy name")
    policy_options: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the policy's constructor"
    )
    backend_timeout_s: float = Field(
        default=300.0, gt=0, description="total time one backend attempt may take before it counts as failed"
    )
    connect_timeout_s: float = Field(default=5.0, gt=0, description="TCP connect timeout toward a backend")
    workers: int = Field(
        default=1,
        ge=1,
        le=MAX_WORKERS,
        description="HTTP worker processes sharing the port, with one routing state in the router process "
        "(1: everything in one process; `rl-launch router` defaults to the cores it may use, at most 8)",
    )
    max_attempts: int = Field(default=2, ge=1, description="attempts per request on distinct backends")
    retry_on_timeout: bool = Field(default=True, description="retry an attempt that timed out elsewhere")
    no_healthy_backend_status: int = Field(
        default=DEFAULT_NO_HEALTHY_BACKEND_STATUS, description="status when no backend serves (a 4xx)"
    )
    max_request_bytes: int = Field(
        default=DEFAULT_MAX_REQUEST_BYTES, ge=1, description="largest request body accepted (413 above)"
    )
    http: HttpLimits = Field(
        default=DEFAULT_HTTP_LIMITS,
        description="HTTP resource limits: head_timeout_s, keepalive_timeout_s, max_client_connections, "
        "max_backend_header_bytes, max_error_body_bytes, body_timeout_s, max_connections_per_consumer, "
        "max_body_bytes_per_consumer (see router.http.limits)",
    )
    pause_max_held: int = Field(
        default=10_000, ge=0, description="generation requests held during a fleet pause (refused above)"
    )
    pause_max_wait_s: float = Field(
        default=600.0, gt=0, description="longest a request is held during a fleet pause before refusal"
    )
    version_max_wait_s: float = Field(
        default=60.0,
        gt=0,
        description="longest a request gated on a weight version (x-rl-weight-version) waits, the fleet not "
        "paused, for an engine with that version before the no-healthy status. Shorter than a pause: a "
        "version that is coming comes with a refit, whose pause holds the request by pause_max_wait_s; "
        "what is left is an engine coming back, and a gated request must not outlive what a plain one "
        "would be answered at once (a version no engine will serve is answered 400 at once)",
    )
    continuation_max_moves: int = Field(
        default=3,
        ge=0,
        description="times one completions or chat generation may move to another engine, with the tokens "
        "it produced, when its engine dies, restarts, is drained or quarantined mid-request "
        "(router.continuation; docs/continuation.md): an engine's death costs its own GPU time, never the "
        "work done on a request. 0: off, every request is proxied byte for byte as it is and a broken one "
        "retried from its start (the router reads no tokens: its cost per request, docs/continuation.md, "
        "'Limits'). Off in Dynamo's key-checking front, whose one backend is the frontend",
    )
    max_held_per_consumer: int | None = Field(
        default=None,
        ge=0,
        description="generation requests one consumer may have held at once (paused, gated on a version, "
        "waiting for a fair-share slot); one more is refused at once with the no-healthy status. None: its "
        "weighted share (consumers' weights, the owner's 1) of the smaller of pause_max_held and "
        "http.max_client_connections, so that no consumer can fill what the router holds for all",
    )

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        if v not in POLICIES:
            raise ValueError(f"unknown routing policy {v!r}; choose one of: {', '.join(POLICIES)}")
        return v

    @field_validator("policy_options")
    @classmethod
    def _policy_options(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        policy = info.data.get("policy")
        if policy is None:  # the policy itself was invalid: its error already says so
            return v
        return validate_policy_options(policy, v)

    @field_validator("no_healthy_backend_status")
    @classmethod
    def _status(cls, v: int) -> int:
        return validate_no_healthy_status(v)

    @field_validator("http", mode="before")
    @classmethod
    def _http(cls, v: Any) -> Any:
        """A mapping (YAML, ``--options-json``) becomes ``HttpLimits``; an unknown key or a bad value is
        one error naming it, instead of a dataclass ``TypeError``."""
        if isinstance(v, HttpLimits):
            return v
        if not isinstance(v, dict):
            raise ValueError(f"must be a mapping of HTTP limits, got {v!r}")
        known = {f.name for f in dataclasses.fields(HttpLimits)}
        unknown = sorted(set(v) - known)
        if unknown:
            raise ValueError(f"unknown HTTP limit {unknown[0]!r}; known: {', '.join(sorted(known))}")
        for key, value in v.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{key} must be a number, got {value!r}")
        return HttpLimits(**v)


class RouterConfig(RouterSettings):
    """Every setting of one router process. Build it once (CLI flags, or ``from_settings`` for a job) and
    pass it whole to ``GenerationRouter`` / ``GenerationRouterActor``."""

    # A model-level error's text would otherwise quote the whole input, secrets included.
    model_config = ConfigDict(hide_input_in_errors=True)

    host: str = Field(default="127.0.0.1", min_length=1, description="address to listen on")
    port: int = Field(default=0, ge=0, le=65535, description="port to listen on (0: the OS chooses)")
    bind_retry_s: float = Field(
        default=0.0, ge=0, description="keep retrying a port still held by a dying process this long"
    )
    port_held: bool = Field(
        default=False,
        description="the launcher holds this port for the job's life (router.ports.PortHold): bind "
        "beside its placeholder with SO_REUSEPORT, so no other user can take the port while the router "
        "restarts",
    )
    health_managed: bool = Field(
        default=False,
        description="a fleet controller owns the serving set: no active probing, a failed backend leaves at "
        "once and only the controller re-admits it",
    )
    probe_interval_s: float = Field(
        default=1.0, ge=0, description="GET /health on each backend this often (0: off)"
    )
    probe_timeout_s: float = Field(default=2.0, gt=0, description="a probe slower than this fails")
    probe_failures_to_eject: int = Field(
        default=3, ge=1, description="consecutive failures (probes or proxied attempts) that eject a backend"
    )
    probe_successes_to_readmit: int = Field(
        default=2, ge=1, description="consecutive successful probes that re-admit an ejected backend"
    )
    worker_health_timeout_s: float = Field(
        default=300.0, gt=0, description="POST /workers waits this long for the worker's GET /health"
    )
    max_pending_registrations: int = Field(
        default=64, ge=1, description="distinct worker URLs POST /workers may be waiting on at once"
    )
    consumers_file: str | None = Field(
        default=None,
        min_length=1,
        description="a standing fleet's consumers file (router.consumers): the jobs attached to it, each "
        "with its own key (stored hashed), weight and admin right; re-read within 0.5 s of a change. "
        "Client routes then require the API key or a consumer's key",
    )
    lora: LoraPlan | None = Field(
        default=None,
        description="the fleet's LoRA plan (router.adapters.plan): its engines serve adapters that "
        "/fleet/adapters loads; None: no adapter routes, and a request's model is passed through as is",
    )
    fair_share_capacity: int | None = Field(
        default=None,
        ge=1,
        description="generation requests in flight through the router at most; when more wait, a freed "
        "slot goes to the consumer lowest in in-flight / weight (router.state.fair_share). None: no "
        "admission control",
    )
    fair_share_max_wait_s: float = Field(
        default=600.0,
        gt=0,
        description="longest a generation request waits for a fair-share slot before it is refused",
    )
    record_dir: str | None = Field(
        default=None,
        min_length=1,
        description="write one line per generation request to <dir>/requests.jsonl (each worker process "
        "to requests-w<k>.jsonl; router.record.format), off the request path. None: no record",
    )
    record_max_bytes: int = Field(
        default=DEFAULT_RECORD_MAX_BYTES,
        ge=64 * 1024,
        description="the record's files take at most this many bytes in all (rotated by size)",
    )
    record_keep_files: int = Field(
        default=4,
        ge=1,
        le=1000,
        description="files per process the record is rotated through (each at most record_max_bytes / "
        "this, divided among the worker processes)",
    )
    record_text: bool = Field(
        default=False,
        description="also record the prompt's text (the request body) and, for a whole JSON answer, the "
        "completion's; off: hashes only",
    )
    insecure_admin: bool = Field(
        default=False,
        description="allow a router without any admin token or API key, on any address, loopback included "
        "(its /workers and /fleet/* are then open to every user who can reach it; never in production)",
    )

    api_key: SecretStr | None = Field(default=None, exclude=True, repr=False)
    admin_token: SecretStr | None = Field(default=None, exclude=True, repr=False)
    backend_api_key: SecretStr | None = Field(default=None, exclude=True, repr=False)
    registration_capability: SecretStr | None = Field(default=None, exclude=True, repr=False)
    """A path segment that stands in for every key under ``/t/<it>/`` (``router.http.capability``): a
    trainer that registers its own engines (NeMo-RL's external-router flow) sends no header at all."""

    @field_validator(*SECRET_FIELDS, mode="before")
    @classmethod
    def _secret(cls, v: Any, info: ValidationInfo) -> Any:
        raw = v.get_secret_value() if isinstance(v, SecretStr) else v
        if isinstance(raw, str) and not raw.strip():
            raise ValueError(f"{info.field_name} is empty; give a non-empty secret or none at all")
        return v

    @model_validator(mode="after")
    def _capability_is_a_secret(self) -> RouterConfig:
        cap = self.secret("registration_capability")
        if cap is not None and (len(cap) < 32 or not cap.replace("-", "").replace("_", "").isalnum()):
            raise ValueError(
                "registration_capability must be at least 32 URL-safe characters (letters, digits, - and _): "
                "it is the only credential of the routes under /t/<capability>/"
            )
        if cap is not None and self.health_managed:
            raise ValueError(
                "registration_capability needs a router that owns its serving set (health_managed is off): "
                "a fleet controller's next push would drop the engines a trainer registered"
            )
        return self

    @model_validator(mode="after")
    def _adapters_in_one_process(self) -> RouterConfig:
        if self.lora is not None and self.workers > 1:
            raise ValueError(
                f"lora needs workers: 1 (got {self.workers}): the adapter table (which version each "
                "request goes to, and its requests in flight) lives in the router process"
            )
        return self

    @model_validator(mode="after")
    def _admin_is_not_open(self) -> RouterConfig:
        # Loopback included: every local user reaches 127.0.0.1, and on a shared login or compute node
        # that is every user of the cluster who can log in there.
        if self.api_key is None and self.admin_token is None and not self.insecure_admin:
            raise ValueError(
                f"the admin routes (/workers, /fleet/*) would be open to every user who can reach "
                f"{self.host}, every local user included: give --admin-token-file or --api-key-file (or "
                "RL_ROUTER_ADMIN_TOKEN / RL_ROUTER_API_KEY), or pass --insecure-admin to accept that"
            )
        return self

    # -- derived views -------------------------------------------------------------------------------
    @property
    def probing(self) -> bool:
        """Active probing runs only when standalone: a fleet controller has more evidence than a probe."""
        return self.probe_interval_s > 0 and not self.health_managed

    @property
    def consumer_accounting(self) -> bool:
        """Requests are told apart by consumer (a consumers file or a fair-share capacity): the routing
        state keeps the per-consumer ledger and the forwarder reports each request's end to it."""
        return self.consumers_file is not None or self.fair_share_capacity is not None

    @property
    def admin_secret(self) -> str | None:
        """What ``/workers`` requires: the admin token, else the client API key, else nothing."""
        secret = self.admin_token or self.api_key
        return secret.get_secret_value() if secret is not None else None

    def secret(self, name: str) -> str | None:
        value = getattr(self, name)
        return value.get_secret_value() if value is not None else None

    @classmethod
    def from_settings(cls, settings: RouterSettings, **process: Any) -> RouterConfig:
        """A job's router settings plus what the driver decides (``host``, ``port``, secrets,
        ``health_managed=True``...). Extra fields of a subclass (a spec's ``port_range``) are dropped."""
        own = settings.model_dump(include=set(RouterSettings.model_fields))
        return cls.model_validate({**own, **process})


def describe_errors(exc: ValidationError, prefix: str = "") -> str:
    """One line per problem, ``<prefix><field.path>: <message>``, for CLIs and logs."""
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"])
        msg = str(err["msg"])
        if msg.startswith(("Value error, ", "Assertion failed, ")):
            msg = msg.split(", ", 1)[1]
        where = f"{prefix}{path}" if path else prefix.rstrip(".")
        secret = bool(err["loc"]) and err["loc"][0] in SECRET_FIELDS
        if err["type"] not in ("value_error", "assertion_error") and "input" in err and not secret:
            msg = f"{msg} (got {err['input']!r})"
        lines.append(f"{where}: {msg}" if where else msg)
    return "\n".join(lines)
