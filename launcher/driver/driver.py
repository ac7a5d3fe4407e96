"""The on-allocation driver: one process, on the first training node, that runs the whole job.

Phases, each bounded and each recorded in the job directory (``state.json``, ``events.jsonl``):

1. **Ray**: the head here, a worker step on every other node; all alive before the deadline, or fail
   naming the node whose step died.
2. **Engines**: one engine-host step per generation node (``launcher.engines.host``) with the node's GPUs;
   each publishes its engines' URLs when all are healthy; a host that dies or misses the startup
   deadline fails the job with the engine log tail.
3. **Router**: a ``GenerationRouterActor`` pinned to this node with ``max_restarts=-1``, on a port
   reserved once from the spec's range (a restart rebinds the same URL).
4. **Gym wiring**: the overlay (``policy_base_url`` = router + ``/v1``, ``policy_api_key``,
   ``policy_model_name``; mode 0600) and the same values as environment variables for the training
   command.
5. **Training**: the command runs here (``bash -c``), its output teed to the job log; its exit code is the
   job's.

Teardown runs on every path (success, failure, SIGTERM from ``scancel``, Ctrl-C): training, router,
engine hosts (which stop their engines' process groups), Ray workers, Ray head. Nothing of the job is
left running on any node.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from launcher.driver.fleet_controller import FleetController
from launcher.driver.jobdir import JobDir, write_json_atomic
from launcher.driver.ray_cluster import ROUTER_ACTOR_NAME, RayCluster
from launcher.driver.status_server import StatusServer
from launcher.driver.steps import LocalSteps, SrunSteps, Step, wait_for_file
from launcher.engines.host import EngineHostConfig
from launcher.engines.sim.cli import options_to_flags
from launcher.fleet import HealthPolicy
from launcher.spec import ResolvedSpec


class JobFailed(RuntimeError):
    """The job could not run; the message is the reason recorded in result.json and events.jsonl."""


class Terminated(BaseException):
    """SIGTERM/SIGINT arrived (scancel, Ctrl-C): unwind through teardown."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def node_address(node: str, local: bool) -> str:
    """The address other nodes reach ``node`` at (local mode: loopback only)."""
    if local:
        return "127.0.0.1"
    return socket.gethostbyname(node)


def reserve_port(host: str, port_range: tuple[int, int]) -> int:
    """The first port of the range free on ``host`` now, starting at an offset derived from the job id so
    two jobs sharing a node rarely probe the same ports first."""
    lo, hi = port_range
    span = hi - lo + 1
    start = int(os.environ.get("SLURM_JOB_ID", os.getpid())) % span
    for i in range(span):
        port = lo + (start + i) % span
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise JobFailed(f"no free port in the router port range {lo}-{hi} on {host}")


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Driver:
    def __init__(
        self, spec: ResolvedSpec, job_dir: Path, training_nodes: list[str], generation_nodes: list[str]
    ) -> None:
        self.spec = spec
        self.job = JobDir(job_dir).create()
        self.local = spec.cluster == "local"
        self.training_nodes = training_nodes
        self.generation_nodes = generation_nodes
        self.steps: LocalSteps | SrunSteps = LocalSteps() if self.local else SrunSteps()
        self.ray: RayCluster | None = None
        self.engine_steps: list[Step] = []
        self.router: Any = None
        self.controller: FleetController | None = None
        self.status_server: StatusServer | None = None
        self.training: subprocess.Popen[bytes] | None = None
        self.t0 = time.monotonic()
        self.timings: dict[str, float] = {}

    # -- the job ------------------------------------------------------------------------------------
    def run(self) -> int:
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

        def on_signal(signum: int, frame: object) -> None:
            raise Terminated(signum)

        for s in previous:
            signal.signal(s, on_signal)
        code = 1
        reason = ""
        # Every process the job starts inherits this, so leftovers can be traced to their job.
        os.environ["RL_LAUNCH_JOB_DIR"] = str(self.job.path)
        try:
            self._write_spec()
            self.job.event(
                "starting",
                f"driver on {socket.gethostname()}",
                nodes={"training": self.training_nodes, "generation": self.generation_nodes},
            )
            self._start_ray()
            api_urls = self._start_engines()
            router_url = self._start_router(api_urls)
            gen = self.spec.generation
            self.controller = FleetController(
                self.job,
                self.router,
                {i: self.job.engines / f"node-{i}.urls.json" for i in range(len(self.generation_nodes))},
                HealthPolicy(
                    restarts_per_engine=gen.restarts_per_engine, restarts_per_run=gen.restarts_per_run
                ),
                say=self._say,
            ).start()
            self._start_status_endpoint()
            env = self._wire_gym(router_url)
            code = self._run_training(env)
            reason = "training finished" if code == 0 else f"training command exited with {code}"
        except Terminated as exc:
            code = 128 + exc.signum
            reason = f"terminated by {exc}"
        except (JobFailed, TimeoutError, RuntimeError, OSError) as exc:
            code = 1
            reason = str(exc)
        finally:
            try:
                for s in previous:  # a second signal during teardown must not abort it half-way
                    signal.signal(s, signal.SIG_IGN)
                self._teardown()
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)
        phase = "finished" if code == 0 else "failed"
        self.job.event(phase, reason, exit_code=code, timings=self.timings)
        write_json_atomic(
            self.job.result_file, {"exit_code": code, "reason": reason, "timings": self.timings}
        )
        self._say(f"{phase}: {reason} (exit {code})")
        return code

    def _say(self, message: str) -> None:
        line = f"[rl-launch {time.monotonic() - self.t0:6.1f}s] {message}"
        print(line, file=sys.stderr, flush=True)
        with (self.job.path / "driver.log").open("a") as f:
            f.write(line + "\n")

    def _mark(self, name: str, since: float) -> None:
        self.timings[name] = round(time.monotonic() - since, 2)

    def _write_spec(self) -> None:
        (self.job.path / "spec.resolved.yaml").write_text(self.spec.to_yaml())
        self.job.new_api_key()

    # -- phases ----------------------------------------------------------------------------------------
    def _start_ray(self) -> None:
        t = time.monotonic()
        head_ip = node_address(socket.gethostname(), self.local)
        others = [n for n in [*self.training_nodes, *self.generation_nodes] if n != self.training_nodes[0]]
        others = list(dict.fromkeys(others)) if not self.local else []
        self.ray = RayCluster(
            head_ip,
            free_port(head_ip),
            self.job.logs,
            os.environ,
            self.local,
            num_cpus=os.cpu_count() if self.local else None,
        )
        self.ray.start_head()
        if others:
            assert isinstance(self.steps, SrunSteps)
            groups = None
            if self.spec.slurm is not None and self.spec.slurm.layout == "hetjob":
                groups = {n: 0 if n in self.training_nodes else 1 for n in others}
            self.ray.start_workers(others, self.steps, groups)
        self.ray.connect_and_wait(1 + len(others), time.monotonic() + 120)
        self._mark("ray_start_s", t)
        self.job.event("ray_up", f"{1 + len(others)} Ray node(s) alive at {self.ray.address}")
        self._say(f"Ray up: {1 + len(others)} node(s) in {self.timings['ray_start_s']} s")

    def _engine_start_error(self, hosts: list[tuple[EngineHostConfig, Step]]) -> str | None:
        """The first error an engine host wrote into its listing, naming its node; None if none did."""
        for cfg, step in hosts:
            path = Path(cfg.urls_file)
            listing = _read_json(path) if path.exists() else {}
            if listing.get("error"):
                return f"engines on node {step.node} failed to start:\n{listing['error']}"
        return None

    def _engine_config(self, index: int, node: str) -> EngineHostConfig:
        gen = self.spec.generation
        return EngineHostConfig(
            kind=gen.engine,
            count=gen.engines_per_node,
            host=node_address(node, self.local),
            model=gen.model or gen.served_model_name,
            served_name=gen.served_model_name,
            tensor_parallel_size=gen.tensor_parallel_size,
            pipeline_parallel_size=gen.pipeline_parallel_size,
            extra_args=list(gen.vllm_args),
            sim_args=options_to_flags(gen.sim),
            env=dict(gen.env),
            startup_timeout_s=gen.startup_timeout_s,
            log_dir=str(self.job.logs),
            urls_file=str(self.job.engines / f"node-{index}.urls.json"),
            api_key_file=str(self.job.api_key_file),
            vllm_python=os.environ.get("RL_LAUNCH_VLLM_PYTHON"),
            node_index=index,
        )

    def _start_engines(self) -> list[str]:
        t = time.monotonic()
        gen = self.spec.generation
        resources = gen.resources
        gpus = resources.gpus_per_node if resources is not None else 0
        het_group = 1 if self.spec.slurm is not None and self.spec.slurm.layout == "hetjob" else None
        configs = []
        for i, node in enumerate(self.generation_nodes):
            cfg = self._engine_config(i, node)
            path = self.job.engines / f"node-{i}.json"
            cfg.dump(path)
            configs.append(cfg)
            argv = [sys.executable, "-m", "launcher.engines.host", "--config", str(path)]
            self.engine_steps.append(
                self.steps.start(
                    node,
                    f"engines-{node}",
                    argv,
                    os.environ,
                    self.job.logs / f"engine-host-node{i}.log",
                    gpus=gpus,
                    het_group=het_group,
                )
            )
        deadline = time.monotonic() + gen.startup_timeout_s + 30
        urls: list[str] = []
        for cfg, step in zip(configs, self.engine_steps, strict=True):
            try:
                wait_for_file(Path(cfg.urls_file), self.engine_steps, deadline)
            except TimeoutError:
                raise JobFailed(
                    f"engines on node {step.node} not ready within {gen.startup_timeout_s:g} s; "
                    f"log {step.log}:\n{step.log_tail()}"
                ) from None
            except RuntimeError as exc:
                # A host that gives up writes its reason before exiting; report that reason (it names
                # the deadline and carries the engine's log tail) rather than the bare exit, whichever
                # node's listing the loop happened to be waiting on when the other host died.
                hosts = list(zip(configs, self.engine_steps, strict=True))
                raise JobFailed(
                    self._engine_start_error(hosts) or f"engines failed to start: {exc}"
                ) from None
            error = self._engine_start_error([(cfg, step)])
            if error:
                raise JobFailed(error)
            listing = _read_json(Path(cfg.urls_file))
            urls += [e["api_url"] for e in listing["engines"]]
            self.job.event(
                "engines_ready",
                f"{len(urls)}/{gen.num_engines} engines ready",
                engines_ready=len(urls),
                engines_total=gen.num_engines,
            )
        self._mark("engine_start_s", t)
        self._say(f"engines ready: {len(urls)} in {self.timings['engine_start_s']} s")
        return urls

    def _start_router(self, api_urls: list[str]) -> str:
        t = time.monotonic()
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from router.actor import remote_router_actor

        r = self.spec.router
        host = node_address(socket.gethostname(), self.local)
        port = reserve_port(host, r.port_range)
        node_id = ray.get_runtime_context().get_node_id()
        actor_cls = remote_router_actor(
            num_cpus=0,
            name=ROUTER_ACTOR_NAME,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        )
        key = self.job.read_api_key()
        from router.config import RouterConfig

        config = RouterConfig(
            host=host,
            port=port,
            policy=r.policy,
            backend_timeout_s=r.backend_timeout_s,
            connect_timeout_s=r.connect_timeout_s,
            max_attempts=r.max_attempts,
            no_healthy_backend_status=r.no_healthy_backend_status,
            health_managed=True,  # the fleet-health loop owns the serving set; no probing in the router
            api_key=key,
            admin_token=key,  # still the client key: a separate admin token file is not written yet
        )
        self.router = actor_cls.remote(config, api_urls)
        url = ray.get(self.router.base_url.remote(), timeout=120)
        self._mark("router_start_s", t)
        self.job.event("router_serving", f"router serving {url}/v1", router_url=url, policy=r.policy)
        self._say(f"router serving {url}/v1 ({r.policy}, {len(api_urls)} engines)")
        return url

    def _start_status_endpoint(self) -> None:
        host = node_address(socket.gethostname(), self.local)
        self.status_server = StatusServer(
            self.job, host, reserve_port(host, self.spec.router.port_range)
        ).start()
        self.job.update_state(status_url=self.status_server.url)
        self.job.log_event(
            "status_endpoint",
            f"status endpoint {self.status_server.url}/status",
            status_url=self.status_server.url,
        )

    def _wire_gym(self, router_url: str) -> dict[str, str]:
        key = self.job.read_api_key()
        overlay = self.spec.gym_overlay_path(self.job.path)
        overlay.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(overlay, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(
                {
                    "policy_base_url": f"{router_url}/v1",
                    "policy_api_key": key,
                    "policy_model_name": self.spec.gym.model_name,
                },
                f,
                sort_keys=False,
            )
        env = dict(os.environ)
        # The training command sees the same rl-launch/python that runs the driver, even when the user
        # started it by path without activating the venv.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env.update(self.spec.training.env)
        env.update(
            {
                "RL_POLICY_BASE_URL": f"{router_url}/v1",
                "RL_POLICY_API_KEY": key,
                "RL_POLICY_MODEL_NAME": self.spec.gym.model_name,
                "RL_GYM_OVERLAY": str(overlay),
                "RL_JOB_DIR": str(self.job.path),
                "RL_ROUTER_URL": router_url,
            }
        )
        if self.ray is not None:
            env["RAY_ADDRESS"] = self.ray.address
        return env

    def _run_training(self, env: dict[str, str]) -> int:
        t = time.monotonic()
        self.job.event("training", "training command running")
        self._say(f"training: {self.spec.training.command}")
        log_path = self.job.logs / "training.log"
        self.training = subprocess.Popen(
            ["bash", "-c", self.spec.training.command],
            env=env,
            cwd=os.getcwd(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        tee = threading.Thread(target=_tee, args=(self.training, log_path), daemon=True)
        tee.start()
        while True:
            try:
                code = self.training.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if self.controller is not None and self.controller.fatal:
                    # No engine can serve and none is coming back: fail now, instead of leaving the
                    # trainer to retry against an empty fleet until the allocation's time limit.
                    raise JobFailed(self.controller.fatal) from None
        tee.join(5)
        self._mark("training_s", t)
        return code

    # -- teardown --------------------------------------------------------------------------------------
    def _teardown(self) -> None:
        t = time.monotonic()
        if self.controller is not None:
            self.controller.stop()
        if self.status_server is not None:
            self.status_server.stop()
        if self.training is not None and self.training.poll() is None:
            try:
                os.killpg(self.training.pid, signal.SIGTERM)
                self.training.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.training.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.router is not None:
            try:
                import ray

                ray.get(self.router.stop.remote(), timeout=10)
                ray.kill(self.router, no_restart=True)
            except Exception:  # the actor may be gone already; Ray's shutdown below reaps it anyway
                pass
        threads = [threading.Thread(target=s.stop) for s in self.engine_steps]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if self.ray is not None:
            self.ray.stop()
        self._mark("teardown_s", t)


def _tee(proc: subprocess.Popen[bytes], log_path: Path) -> None:
    assert proc.stdout is not None
    with log_path.open("ab") as log:
        for line in iter(proc.stdout.readline, b""):
            log.write(line)
            log.flush()
            sys.stdout.buffer.write(line)
            sys.stdout.flush()


def _read_json(path: Path) -> dict[str, Any]:
    import json

    return json.loads(path.read_text())
