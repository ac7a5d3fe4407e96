"""Bootstrapping Ray across the allocation: the head on the driver's node, one worker step per other node.

``ray start --block`` keeps each Ray node's lifetime tied to one process (a subprocess on the driver's
node, an ``srun`` step elsewhere), so stopping that process stops the node and a dead node shows up as a
dead step, which the driver reports by name. Waiting is bounded: every node must be alive in Ray's view
before the deadline, and a worker step that exits early fails the wait at once instead of after it.

Environment choices (each against a failure seen on these clusters):
* ``RAY_AUTH_MODE=token`` with ``RAY_AUTH_TOKEN_PATH`` = the job's own token (``secrets/ray_token``, 0600),
  in the head, every worker step, the driver and the training command, and ``RAY_AUTH_TOKEN`` removed so
  nothing inherited overrides the file. Without it Ray serves GCS, its client server, the raylets and
  their agents to anyone who can reach the nodes: a client with no credential, from any account on the
  cluster, ran tasks as the job's user (reading ``secrets/``, calling the router actor whose config holds
  every secret, setting the serving set to its own engines). With the token it gets ``Failed to connect
  to Ray cluster``. Always ``token``, whatever ``RAY_AUTH_MODE`` the user's shell had: it used to be
  ``disabled`` because Ray turns token auth on by itself once ``~/.ray/auth_token`` exists, and workers
  then could not join; a token of the job's own, given to every node, ends both problems.
* Ray's files in a directory only the job's user can enter (``launcher.steps.ray_node``), never the
  shared ``/tmp/ray``, whose folders Ray makes 0777.
* ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in local mode: without it Ray rewrites 127.0.0.1 to the
  machine's external address, and its processes talk over that interface.
* dashboard and usage stats off: nothing to serve, nothing to phone home.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from launcher.steps.processes import LocalSteps, SrunSteps, Step
from launcher.steps.ray_node import node_command

# The job's named actors (the router: router.actor.ROUTER_ACTOR_NAME) live here, so a training script or
# an operator attached to the same cluster (RAY_ADDRESS) can find them with
# ray.get_actor("router", namespace=RAY_NAMESPACE).
RAY_NAMESPACE = "rl-launch"


# What a process needs to reach the job's Ray; os.environ of the driver carries them from ray.init on.
CLIENT_ENV = (
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN_PATH",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
    "RAY_USAGE_STATS_ENABLED",
)


def ray_env(base: Mapping[str, str], local: bool, token_file: str | os.PathLike[str]) -> dict[str, str]:
    env = dict(base)
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN_PATH"] = str(token_file)
    env.pop("RAY_AUTH_TOKEN", None)  # Ray prefers it to the file: an inherited one would win
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_DISABLE_DOCKER_CPU_WARNING"] = "1"
    # No Serve replicas to quiesce: on SIGTERM stop at once instead of draining for 30 s, which would
    # outlast Slurm's KillWait after scancel and end in SIGKILL anyway.
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    if local:
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    else:
        # inherited from a local-mode shell it would make every worker refuse to join the head
        env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    return env


@contextlib.contextmanager
def driver_process_env(local: bool) -> Iterator[None]:
    """What the driver's own process needs of Ray for the job's whole run, set before anything in it
    imports Ray, and restored afterwards (the local driver is ``rl-launch submit``'s own process).

    Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` once, when ``ray`` is first imported: a local driver
    that imported Ray before setting it (loading the ``ray-serve`` front imports Ray Serve) had its GCS
    address rewritten to the machine's external address and hung in ``ray.init``, unless the user had
    exported the variable. On a cluster it must be absent (a shell that had it would make the driver's
    Ray refuse multi-node)."""
    key = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
    saved = os.environ.get(key)
    if local:
        os.environ[key] = "0"
    else:
        os.environ.pop(key, None)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


def reload_ray_auth() -> None:
    """Make this process's Ray read ``RAY_AUTH_MODE`` and the token again.

    Ray reads both once per process, when it is first imported, and caches them: a driver whose process
    imported Ray before the job's settings were in its environment (``rl-launch submit`` validating a
    ``ray-serve`` spec imports ``ray.serve``) connected in the old mode and was refused by its own head.
    Ray's own tests reset them this way (``ray._private.authentication_test_utils``)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def ray_executable() -> str:
    candidate = Path(sys.executable).with_name("ray")
    return str(candidate) if candidate.exists() else "ray"


class RayCluster:
    def __init__(
        self,
        head_ip: str,
        port: int,
        job_dir: Path,
        token_file: Path,
        env: Mapping[str, str],
        local: bool,
        num_cpus: int | None = None,
    ) -> None:
        self.head_ip = head_ip
        self.port = port
        self.job_dir = job_dir
        self.logs = job_dir / "logs"
        self.env = ray_env(env, local, token_file)
        self.local = local
        self.num_cpus = num_cpus
        self.head: Step | None = None
        self.workers: list[Step] = []
        # False once stop() gave up waiting for ray.shutdown: Ray's own exit hook would then wait on the
        # dead head again at interpreter exit, until Slurm's SIGKILL.
        self.disconnected = True

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.port}"

    def client_env(self) -> dict[str, str]:
        """What the training command needs to attach to the job's Ray (``ray.init()``): the address and
        the token's file, never the token itself."""
        return {"RAY_ADDRESS": self.address, **{k: self.env[k] for k in CLIENT_ENV if k in self.env}}

    def start_head(self) -> None:
        argv = [
            ray_executable(),
            "start",
            "--head",
            f"--node-ip-address={self.head_ip}",
            f"--port={self.port}",
            "--include-dashboard=false",
            "--disable-usage-stats",
            "--block",
        ]
        if self.num_cpus is not None:
            argv.append(f"--num-cpus={self.num_cpus}")
        log = self.logs / "ray-head.log"
        self.head = LocalSteps().start("head", "ray-head", node_command(self.job_dir, argv), self.env, log)

    def start_workers(
        self, nodes: Sequence[str], steps: SrunSteps, het_groups: Mapping[str, int] | None = None
    ) -> None:
        """One ``ray start --block`` step per node; ``het_groups`` names each node's hetjob component
        (srun only places a step on a node of the component it targets)."""
        for node in nodes:
            argv = [
                ray_executable(),
                "start",
                f"--address={self.address}",
                "--disable-usage-stats",
                "--block",
            ]
            log = self.logs / f"ray-worker-{node}.log"
            group = het_groups.get(node) if het_groups else None
            self.workers.append(
                steps.start(
                    node,
                    f"ray-worker-{node}",
                    node_command(self.job_dir, argv),
                    self.env,
                    log,
                    het_group=group,
                )
            )

    def connect_and_wait(self, expected_nodes: int, deadline: float) -> object:
        """``ray.init`` against the head, then wait until ``expected_nodes`` are alive."""
        for key in CLIENT_ENV:
            if key in self.env:
                os.environ[key] = self.env[key]
            else:
                os.environ.pop(key, None)
        os.environ.pop("RAY_AUTH_TOKEN", None)
        import ray

        reload_ray_auth()

        while True:
            self._check_alive()
            try:
                ray.init(
                    address=self.address,
                    namespace=RAY_NAMESPACE,
                    log_to_driver=False,
                    configure_logging=False,
                )
                break
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Ray head at {self.address} did not come up: {exc}") from exc
                time.sleep(0.5)
        while True:
            self._check_alive()
            alive = [n for n in ray.nodes() if n.get("Alive")]
            if len(alive) >= expected_nodes:
                return ray
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Ray has {len(alive)} of {expected_nodes} nodes alive at the deadline "
                    f"(alive: {sorted(n.get('NodeManagerAddress') for n in alive)})"
                )
            time.sleep(0.5)

    def _check_alive(self) -> None:
        for step in [s for s in (self.head, *self.workers) if s is not None]:
            if not step.alive():
                raise RuntimeError(
                    f"{step.role} on node {step.node} exited with {step.returncode()}; "
                    f"log {step.log}:\n{step.log_tail()}"
                )

    def stop(self, shutdown_timeout_s: float = 3.0, hurry: bool = False) -> None:
        """Disconnect, then stop every node's step. ``ray.shutdown`` waits on the head, which Slurm may
        have signalled already (scancel signals every process of the job): bounded, so the rest of the
        teardown still fits in KillWait. ``hurry``: stop the steps while the disconnect is under way."""

        def shutdown() -> None:
            try:
                import ray

                if ray.is_initialized():
                    ray.shutdown()
            except Exception:  # teardown must go on
                pass

        t = threading.Thread(target=shutdown, name="ray-shutdown", daemon=True)
        t.start()
        if not hurry:
            t.join(shutdown_timeout_s)
        grace_s = 1.5 if hurry else 10.0  # hurry: Slurm's SIGKILL comes KillWait after its SIGTERM
        for step in self.workers:
            step.stop(grace_s=grace_s)  # a no-op for workers the driver's teardown stopped already
        if self.head is not None:
            self.head.stop(grace_s=grace_s)
            # `ray start --block` stops its node's processes on SIGTERM. Never `ray stop`: it ends every
            # Ray on the machine, other jobs' too. A straggler of this head's session (Ray starts its
            # workers in process groups of their own) is ended by the head's reaper once the driver has
            # exited (launcher.steps.reaper), as everything of the session is if the driver is SIGKILLed.
        t.join(shutdown_timeout_s if not hurry else 0.5)
        self.disconnected = not t.is_alive()
        self.workers.clear()
