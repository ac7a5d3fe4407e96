"""One Dynamo worker per engine slot: ``python -m dynamo.vllm`` (GPUs) or ``python -m dynamo.mocker`` (CPU).

A Dynamo worker serves no HTTP API of its own: it registers with Dynamo's discovery (etcd, or a directory
shared with the frontend) and takes requests from the frontend over the request plane. What the launcher
needs of an engine is still "a process group it can start, watch and stop, and a URL whose ``/health``
says whether it serves", so each worker gets Dynamo's *system status server* on a port of its own
(``DYN_SYSTEM_PORT``): that URL is the engine URL the engine host publishes and the fleet controller
probes, and a worker restarted in place comes back on a new one and rejoins through discovery.

Credentials: the worker reads the job's etcd password and NATS token from the files ``DynamoPlanes``
names into its environment (``DynamoPlanes.apply``). What the worker itself listens on, its request plane
and its status server (whose ``/engine/*`` routes pause, sleep and reload weights), Dynamo 1.6 does not
authenticate: it binds the node's address (loopback in local mode), and ``cluster: slurm`` needs
``router.dynamo.allow_insecure_network`` (``launcher.gateways.dynamo``).

Why one process per worker (``--num-workers 1`` for the mocker) and not one mocker process with N
workers: a worker must be able to die and be restarted alone, as a vLLM engine can.

The command lines are built by pure functions (``worker_command``) so they can be tested exactly without
Dynamo installed; the interpreter is the Dynamo venv's (``RL_LAUNCH_DYNAMO_PYTHON``), never the launcher's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from launcher.engines.base import EngineSpec, EngineStartError
from launcher.engines.vllm.engine import VllmEngine, _connect_host
from router.ports import NoFreePort, free_port_in

DynamoEngineKind = Literal["dynamo-vllm", "dynamo-mocker"]
DYNAMO_PYTHON_ENV = "RL_LAUNCH_DYNAMO_PYTHON"


# What Dynamo's runtime (ai-dynamo-runtime 1.6) reads to authenticate to etcd and NATS. Any of them inherited
# from the user's environment is dropped: NATS_AUTH_USERNAME/PASSWORD would win over the job's token (the
# runtime tries them first) and the process would be refused by the job's NATS.
CREDENTIAL_VARS = (
    "ETCD_AUTH_USERNAME", "ETCD_AUTH_PASSWORD",
    "ETCD_AUTH_CA", "ETCD_AUTH_CLIENT_CERT", "ETCD_AUTH_CLIENT_KEY",
    "NATS_AUTH_USERNAME", "NATS_AUTH_PASSWORD",
    "NATS_AUTH_TOKEN", "NATS_AUTH_NKEY", "NATS_AUTH_CREDENTIALS_FILE",
)  # fmt: skip


@dataclass(frozen=True)
class DynamoPlanes:
    """How workers and the frontend find each other: the same three values on both sides, or the
    frontend never sees the workers (one module owns the shape: ``launcher.gateways.dynamo`` builds it
    from the spec, the engine host receives it in its config)."""

    discovery: Literal["etcd", "file"] = "etcd"
    request_plane: Literal["tcp", "nats"] = "tcp"
    env: dict[str, str] = field(default_factory=dict)
    """ETCD_ENDPOINTS / NATS_SERVER / DYN_FILE_KV / DYN_NAMESPACE / ETCD_AUTH_USERNAME: where the job's
    runtime is and who to be there (no secret: this dict is written to the engine hosts' config files)."""
    secret_files: dict[str, str] = field(default_factory=dict)
    """``{variable: path}``: ETCD_AUTH_PASSWORD and NATS_AUTH_TOKEN, each read from its 0600 file in the
    job's ``secrets/`` by the process that starts a worker or the frontend, and handed over in that
    process's environment: never in argv, a config file or a log."""

    @property
    def event_plane(self) -> str:
        # etcd discovery: KV events over NATS (JetStream), as a multi-node fleet needs; file discovery
        # has no NATS, so events go over ZMQ directly.
        return "nats" if self.discovery == "etcd" else "zmq"

    def flags(self) -> list[str]:
        return [
            "--discovery-backend",
            self.discovery,
            "--request-plane",
            self.request_plane,
            "--event-plane",
            self.event_plane,
        ]

    def apply(self, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` without inherited credentials (``CREDENTIAL_VARS``), plus where the runtime is and the
        job's credentials read from their files. ``ValueError`` naming the file if one cannot be read."""
        out = {k: v for k, v in env.items() if k not in CREDENTIAL_VARS}
        out.update(self.env)
        for var, path in self.secret_files.items():
            try:
                value = Path(path).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"cannot read the Dynamo credential {path} ({var}): {exc}") from None
            if not value:
                raise ValueError(f"the Dynamo credential {path} ({var}) is empty")
            out[var] = value
        return out


# Dynamo parses DYN_SYSTEM_PORT as a signed 16-bit number: the OS's ephemeral ports (32768+) are refused,
# so status ports come from below them, above the Ray worker ports and the default router range.
STATUS_PORT_RANGE = (21000, 32000)


def status_port(host: str, port_range: tuple[int, int] = STATUS_PORT_RANGE) -> int:
    """A port free on ``host`` now in ``port_range``, from a random offset (workers of one node start at
    once; ``router.ports``' race, and a clash fails that worker's start loudly)."""
    try:
        return free_port_in(host, port_range, order="random", what="a Dynamo worker's status server")
    except NoFreePort as exc:
        raise EngineStartError(str(exc)) from None


def dynamo_python(configured: str | None = None) -> str:
    """The Dynamo venv's interpreter: the given one, else ``$RL_LAUNCH_DYNAMO_PYTHON``; a clear error
    otherwise (the launcher's own venv has no Dynamo on purpose)."""
    python = configured or os.environ.get(DYNAMO_PYTHON_ENV)
    if not python:
        raise ValueError(
            f"no Dynamo interpreter: set {DYNAMO_PYTHON_ENV} to the python of a venv with ai-dynamo "
            "(.ci/install-dynamo.sh makes one)"
        )
    return python


def worker_command(
    kind: DynamoEngineKind,
    python: str,
    model: str,
    served_name: str | None,
    planes: DynamoPlanes,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    vllm_args: Sequence[str] = (),
    worker_args: Sequence[str] = (),
) -> list[str]:
    """The exact argv of one worker. ``vllm_args`` (dynamo.vllm only) and then ``worker_args`` come last,
    so a user's flag wins by argparse's last-one-wins."""
    if kind == "dynamo-vllm":
        argv = [python, "-m", "dynamo.vllm", "--model", model]
        if served_name:
            argv += ["--served-model-name", served_name]
        argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
        if pipeline_parallel_size > 1:
            argv += ["--pipeline-parallel-size", str(pipeline_parallel_size)]
        # --enable-rl: token-in/token-out defaults and per-token logprobs, as an RL trainer needs.
        argv += [*planes.flags(), "--enable-rl", "--enable-prefix-caching", *vllm_args]
    elif kind == "dynamo-mocker":
        argv = [python, "-m", "dynamo.mocker", "--model-path", model]
        if served_name:
            argv += ["--model-name", served_name]
        argv += ["--num-workers", "1", *planes.flags()]
    else:
        raise ValueError(f"unknown Dynamo engine kind {kind!r} (dynamo-vllm or dynamo-mocker)")
    return [*argv, *worker_args]


class DynamoWorker(VllmEngine):
    """One Dynamo worker process group; its ``url`` is its system status server (``/health``).

    Reuses ``VllmEngine``'s process-group lifecycle (own session, SIGTERM then SIGKILL of the whole
    group, log file, readiness by ``/health``); only the command and the environment differ."""

    def __init__(
        self,
        spec: EngineSpec,
        kind: DynamoEngineKind,
        planes: DynamoPlanes,
        *,
        python: str,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        worker_args: Sequence[str] = (),
    ) -> None:
        super().__init__(spec, python=python, launch="module", health_poll_s=0.5)
        self.kind: DynamoEngineKind = kind
        self.planes = planes
        self.tp = tensor_parallel_size
        self.pp = pipeline_parallel_size
        self.worker_args = list(worker_args)

    def command(self) -> list[str]:
        return worker_command(
            self.kind,
            self.python,
            self.spec.model,
            self.spec.served_name,
            self.planes,
            tensor_parallel_size=self.tp,
            pipeline_parallel_size=self.pp,
            vllm_args=self.spec.extra_args,
            worker_args=self.worker_args,
        )

    def start(self) -> None:
        if self._port is None:
            self._port = status_port(_connect_host(self.spec.host))
        super().start()

    def _fail(self, why: str) -> None:
        self.stop()
        raise EngineStartError(
            f"Dynamo worker ({self.kind}, status {self.url}) {why}; log: {self.log_path}\n"
            f"--- last lines of the worker log ---\n{self.log_tail()}"
        )

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        try:
            env = self.planes.apply(super().environment(base))
        except ValueError as exc:
            raise EngineStartError(str(exc)) from None
        # The status server is the worker's engine URL; bind it where the frontend's node reaches it.
        env["DYN_SYSTEM_PORT"] = str(self.port)
        env["DYN_SYSTEM_HOST"] = self.spec.host
        # Where the frontend reaches this worker: else Dynamo advertises the node's first interface.
        for var in ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST"):
            env[var] = self.spec.host
        # Ready = the generate endpoint is registered and serving. Without this list the 1.6 runtime
        # reports "notready" for ever although it logs the variable as deprecated (checked with the mocker).
        env["DYN_SYSTEM_STARTING_HEALTH_STATUS"] = "notready"
        env["DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS"] = '["generate"]'
        env.pop("VLLM_API_KEY", None)  # workers take requests from the frontend only, over the request plane
        env.update(self.spec.env)
        return env
