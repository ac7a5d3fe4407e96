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

Stopping, every way, through one teardown (training, router, engine hosts, which stop their engines'
process groups, Ray workers, Ray head; nothing of the job is left running on any node):

* the job ends by itself (training exits, the fleet is gone, a phase fails): ``finished`` / ``failed``;
* SIGTERM (``scancel``, ``rl-launch cancel``, Slurm at the time limit) or SIGINT (Ctrl-C): ``cancelled``,
  or ``time limit`` when the SIGTERM comes at the allocation's end time;
* SIGUSR2, Slurm's warning before the time limit (``--signal=B:USR2@<s>``, sent to the batch step
  only): ``time limit``, torn down while there is still time to do it in order;
* the allocation's end time (``squeue %e``) minus a margin (``stop_margin_s``), even when no warning
  signal arrives: ``time limit``, exit 124.

``ray.init`` installs Ray's own SIGTERM handlers (a Python one that calls ``sys.exit`` and a C++ one that
prints a stack dump), which used to win over the driver's: the driver is why the handlers are installed
again right after ``ray.init``. On a signal the result is recorded before the teardown starts (Slurm
sends SIGKILL ``KillWait`` seconds after SIGTERM, which may come before the teardown ends) and again,
with the teardown's duration, once it has ended.
"""

from __future__ import annotations

import functools
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

from launcher.driver.ray_cluster import RayCluster, driver_process_env
from launcher.driver.status_server import StatusServer
from launcher.driver.steps import LocalSteps, SrunSteps, Step, wait_for_file
from launcher.engines.host_config import EngineHostConfig
from launcher.engines.kinds import engine_kind
from launcher.fleet import HealthPolicy
from launcher.fleet.controller import FleetController
from launcher.gateways import Gateway, GatewayContext, GatewayError, gateway_class, make_gateway
from launcher.gateways.kinds import front_kind
from launcher.jobdir import JobDir, JobResult, StateWriter, start_ticks, write_text_atomic
from launcher.slurm.request import container_srun_args
from launcher.spec import ResolvedSpec
from router.ports import PortHold, free_port, reserve_port

# The signals that stop a job; SIGUSR2 is Slurm's warning before the time limit.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)


class JobFailed(RuntimeError):
    """The job could not run; the message is the reason recorded in result.json and events.jsonl."""


class Terminated(BaseException):
    """A stop signal arrived (scancel, cancel, Ctrl-C, the time limit): unwind through teardown.

    A ``BaseException`` so no ``except Exception`` on the way (a phase's retry loop) swallows it."""

    def __init__(self, signum: int, outcome: str) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.outcome = outcome

    @property
    def reason(self) -> str:
        name = signal.Signals(self.signum).name
        if self.outcome == "time limit" and self.signum == signal.SIGUSR2:
            return f"time limit: Slurm's warning before the end of the allocation ({name})"
        if self.outcome == "time limit":
            return f"time limit: Slurm ended the allocation ({name} at its end time)"
        return f"cancelled by {name}"


class TimeLimitReached(Exception):
    """The allocation's end is near: stop in order now rather than be killed at the limit."""


# Exit status of a job the driver stopped itself before the time limit (as coreutils' ``timeout``).
TIME_LIMIT_EXIT = 124


def stop_margin_s(allocation_s: float) -> float:
    """How long before the allocation's end the driver starts its teardown on its own: enough for an
    orderly teardown (a few seconds) with room for a slow node, never more than a tenth of a short job."""
    return min(90.0, max(10.0, 0.1 * allocation_s))


def slurm_end_time(job_id: str | None) -> float | None:
    """The allocation's end time (epoch seconds) from ``squeue``, or None (no Slurm, unlimited)."""
    if not job_id:
        return None
    from launcher.slurm.queue import job_end_time

    return job_end_time(job_id)


class EngineHostSteps:
    """The engine-host step of every generation node, restartable one at a time (the fleet controller
    restarts the host of a node whose step died)."""

    def __init__(self, start: Any) -> None:
        self._start = start  # node index -> Step
        self.steps: dict[int, Step] = {}
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Teardown has begun: no host may be started again (a fleet tick still in flight would see the
        hosts the teardown stops as dead, and restart them into orphans)."""
        with self._lock:
            self._closed = True

    def launch(self, node_index: int) -> Step:
        with self._lock:
            if self._closed:
                raise RuntimeError("the job is being torn down; no engine host is started")
            step = self._start(node_index)
            self.steps[node_index] = step
        return step

    def exited(self, node_index: int) -> int | None:
        with self._lock:
            step = self.steps.get(node_index)
        return None if step is None or step.alive() else step.returncode()

    def restart(self, node_index: int) -> None:
        with self._lock:
            old = self.steps.get(node_index)
        if old is not None:
            old.stop(grace_s=5)
        self.launch(node_index)

    def describe(self, node_index: int) -> str:
        with self._lock:
            step = self.steps.get(node_index)
        if step is None:
            return "never started"
        return f"node {step.node}; log {step.log}:\n{step.log_tail(10)}"

    def all(self) -> list[Step]:
        with self._lock:
            return [self.steps[i] for i in sorted(self.steps)]


class GatewayFleetWatcher:
    """For a gateway that owns its engines: every ``period_s`` its own view and its engines (as
    listings) go to the job directory, where ``rl-launch status`` reads them; the last view is kept,
    marked stopped, when the job ends."""

    def __init__(self, job: JobDir, state: StateWriter, gateway: Gateway, period_s: float = 2.0) -> None:
        self.job, self.state, self.gateway, self.period_s = job, state, gateway, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gateway-fleet-watcher", daemon=True)

    def start(self) -> GatewayFleetWatcher:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as exc:  # a view that fails this tick is retried on the next
                view = {"kind": self.gateway.kind, "reachable": False, "detail": repr(exc)}
                self.state.update(gateway=view)
            self._stop.wait(self.period_s)

    def tick(self) -> None:
        self.state.update(gateway=self.gateway.view().to_json())
        for listing in self.gateway.engine_listings():
            self.job.write_listing(listing)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        last = dict(self.state.snapshot().get("gateway") or {})
        if last:
            self.state.update(gateway={**last, "reachable": False, "detail": "stopped"})


def node_address(node: str, local: bool) -> str:
    """The address other nodes reach ``node`` at (local mode: loopback only)."""
    if local:
        return "127.0.0.1"
    return socket.gethostbyname(node)


class Driver:
    def __init__(
        self, spec: ResolvedSpec, job_dir: Path, training_nodes: list[str], generation_nodes: list[str]
    ) -> None:
        self.spec = spec
        self.front = front_kind(spec.router.kind)
        """What the front kind declares (``launcher.gateways.front.FrontKind``)."""
        self.job = JobDir(job_dir).create()
        self.state = StateWriter(self.job)
        self.local = spec.cluster == "local"
        self.training_nodes = training_nodes
        self.generation_nodes = generation_nodes
        self.steps: LocalSteps | SrunSteps = (
            LocalSteps() if self.local else SrunSteps(container_srun_args(spec))
        )
        self.ray: RayCluster | None = None
        self.hosts = EngineHostSteps(self._launch_host)
        self.end_time: float | None = None
        self.stop_at: float | None = None
        self.gateway: Gateway | None = None
        self.engine_runtime: dict[str, Any] = {}
        """What the engines need of the gateway's runtime (Dynamo: discovery and planes); see
        ``Gateway.prepare_engines``."""
        self.router_port: PortHold | None = None
        """The front's port, held for the job's life where the front binds beside the hold."""
        self.controller: FleetController | GatewayFleetWatcher | None = None
        self.status_server: StatusServer | None = None
        self.training: subprocess.Popen[bytes] | None = None
        self.t0 = time.monotonic()
        self.timings: dict[str, float] = {}

    # -- the job ------------------------------------------------------------------------------------
    def run(self) -> int:
        with driver_process_env(self.local):
            return self._run()

    def _run(self) -> int:
        previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        self._install_stop_handlers()
        code = 1
        reason = ""
        outcome = "failed"
        signame: str | None = None
        # Every process the job starts inherits this, so leftovers can be traced to their job.
        os.environ["RL_LAUNCH_JOB_DIR"] = str(self.job.path)
        try:
            self._say(f"job directory: {self.job.path}")
            self._write_spec()
            self.state.event(
                "starting",
                f"driver on {socket.gethostname()}",
                nodes={"training": self.training_nodes, "generation": self.generation_nodes},
                driver_pid=os.getpid(),
                driver_start_ticks=start_ticks(os.getpid()),
                driver_host=socket.gethostname(),
                **self.spec.kind_labels(),
                slurm_job_id=os.environ.get("SLURM_JOB_ID") if not self.local else None,
            )
            if not self.local:
                self.end_time = slurm_end_time(os.environ.get("SLURM_JOB_ID"))
                if self.end_time is not None:
                    self.stop_at = self.end_time - stop_margin_s(self.end_time - time.time())
            self._start_ray()
            self._start_fleet()
            self._start_status_endpoint()
            env = self._wire_gym(self.state.snapshot()["router_url"])
            code = self._run_training(env)
            reason = "training finished" if code == 0 else f"training command exited with {code}"
            outcome = "finished" if code == 0 else "failed"
        except Terminated as exc:
            code = 128 + exc.signum
            reason, outcome, signame = exc.reason, exc.outcome, signal.Signals(exc.signum).name
        except TimeLimitReached as exc:
            code, reason, outcome = TIME_LIMIT_EXIT, str(exc), "time limit"
        except (JobFailed, TimeoutError, RuntimeError, OSError) as exc:
            code = 1
            reason = str(exc)
        finally:
            for s in previous:  # a second signal during teardown must not abort it half-way
                signal.signal(s, signal.SIG_IGN)
        result = JobResult(code, reason, outcome, signame, self.timings, time.time(), torn_down=False)
        phase = {"finished": "finished", "failed": "failed"}.get(outcome, "cancelled")
        if signame is not None:
            # Slurm's SIGKILL follows its SIGTERM after KillWait seconds (5 s on some clusters), maybe
            # before the teardown ends: record how the job ended, and its final phase, first.
            self._say(f"{reason}: tearing down")
            self.state.event(phase, reason, exit_code=code, outcome=outcome, signal=signame, torn_down=False)
            self.job.write_result(result)
        try:
            self._teardown(hurry=signame is not None)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        result.timings = self.timings
        result.torn_down = True
        if signame is None:
            self.state.event(
                phase, reason, exit_code=code, outcome=outcome, timings=self.timings, torn_down=True
            )
        else:
            self.state.update(timings=self.timings, torn_down=True)
            self.job.log_event("torn_down", f"teardown took {self.timings.get('teardown_s')} s")
        self.job.write_result(result)
        self._say(f"{outcome}: {reason} (exit {code})")
        if self.ray is not None and not self.ray.disconnected:
            # ray.shutdown is stuck on a head Slurm took down; Ray's exit hook would wait on it again
            # until SIGKILL. Everything is stopped and recorded: leave now.
            self._say("Ray did not disconnect; exiting without its exit hooks")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code

    def _install_stop_handlers(self) -> None:
        """The driver's handlers for every stop signal. Called again right after ``ray.init``, which
        replaces the SIGTERM handler with Ray's (``sys.exit`` plus a C++ stack dump, exit 134)."""

        def on_signal(signum: int, frame: object) -> None:
            raise Terminated(signum, self._outcome_of(signum))

        for s in STOP_SIGNALS:
            signal.signal(s, on_signal)

    def _outcome_of(self, signum: int) -> str:
        if signum == signal.SIGUSR2:
            return "time limit"
        if signum == signal.SIGTERM and self.end_time is not None and time.time() >= self.end_time - 10:
            return "time limit"  # Slurm's SIGTERM at the end of the allocation, not a scancel
        return "cancelled"

    def _say(self, message: str) -> None:
        line = f"[rl-launch {time.monotonic() - self.t0:6.1f}s] {message}"
        print(line, file=sys.stderr, flush=True)
        with self.job.driver_log.open("a") as f:
            f.write(line + "\n")

    def _mark(self, name: str, since: float) -> None:
        self.timings[name] = round(time.monotonic() - since, 2)

    def _write_spec(self) -> None:
        if not self.job.spec_file.exists():  # ``submit`` wrote the snapshot this job runs; keep it
            self.job.write_spec(self.spec)
        self.job.new_api_key()
        self.job.new_admin_token()
        self.job.new_ray_token()

    # -- phases ----------------------------------------------------------------------------------------
    def _start_ray(self) -> None:
        t = time.monotonic()
        head_ip = node_address(socket.gethostname(), self.local)
        os.environ.update(gateway_class(self.spec.router.kind).ray_env)  # before Ray reads it
        others = [n for n in [*self.training_nodes, *self.generation_nodes] if n != self.training_nodes[0]]
        others = list(dict.fromkeys(others)) if not self.local else []
        self.ray = RayCluster(
            head_ip,
            free_port(head_ip),
            self.job.path,
            self.job.ray_token_file,
            os.environ,
            self.local,
            num_cpus=os.cpu_count() if self.local else None,
        )
        self._say(f"starting Ray ({1 + len(others)} node(s))")
        self.ray.start_head()
        if others:
            assert isinstance(self.steps, SrunSteps)
            groups = None
            if self.spec.slurm is not None and self.spec.slurm.layout == "hetjob":
                groups = {n: 0 if n in self.training_nodes else 1 for n in others}
            self.ray.start_workers(others, self.steps, groups)
        try:
            self.ray.connect_and_wait(1 + len(others), time.monotonic() + 120)
        except SystemExit as exc:
            # For its whole duration ray.init makes SIGTERM ``sys.exit(15)``: a scancel while Ray
            # connects (seconds on a loaded node) would skip the teardown and leave the Ray head and
            # the worker steps running. It is our stop signal, and it unwinds like one.
            if exc.code != signal.SIGTERM:
                raise
            raise Terminated(signal.SIGTERM, self._outcome_of(signal.SIGTERM)) from None
        finally:
            self._install_stop_handlers()  # ray.init replaced the SIGTERM handler with Ray's
        self._mark("ray_start_s", t)
        self.state.event("ray_up", f"{1 + len(others)} Ray node(s) alive at {self.ray.address}")
        self._say(f"Ray up: {1 + len(others)} node(s) in {self.timings['ray_start_s']} s")

    def _engine_start_error(self, indices: list[int]) -> str | None:
        """The first error an engine host wrote into its listing, naming its node; None if none did."""
        for i in indices:
            listing = self.job.read_listing(i)
            if listing is not None and listing.error:
                return f"engines on node {self.generation_nodes[i]} failed to start:\n{listing.error}"
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
            env=dict(gen.env),
            startup_timeout_s=gen.startup_timeout_s,
            log_dir=str(self.job.logs),
            job_dir=str(self.job.path),
            api_key_file=str(self.job.api_key_file),
            node_index=index,
            **engine_kind(gen.engine).host_fields(gen, os.environ),
            **self.front.engine_host_fields(self.spec.router, self.engine_runtime),
        )

    def _launch_host(self, index: int) -> Step:
        """Start (or start again) generation node ``index``'s engine host step."""
        gen = self.spec.generation
        resources = gen.resources
        gpus = resources.gpus_per_node if resources is not None else 0
        het_group = 1 if self.spec.slurm is not None and self.spec.slurm.layout == "hetjob" else None
        node = self.generation_nodes[index]
        path = self.job.host_config_file(index)
        if not path.exists():
            self._engine_config(index, node).dump(path)
        argv = [sys.executable, "-m", "launcher.engines.host", "--config", str(path)]
        return self.steps.start(
            node,
            f"engines-{node}",
            argv,
            os.environ,
            self.job.engine_host_log(index),
            gpus=gpus,
            het_group=het_group,
        )

    def _start_engines(self) -> list[str]:
        t = time.monotonic()
        gen = self.spec.generation
        indices = list(range(len(self.generation_nodes)))
        self._say(f"starting {gen.num_engines} {gen.engine} engine(s) on {len(indices)} node(s)")
        for i in indices:
            self.hosts.launch(i)
        steps = self.hosts.all()
        deadline = time.monotonic() + gen.startup_timeout_s + 30
        urls: list[str] = []
        for i, step in zip(indices, steps, strict=True):
            try:
                wait_for_file(self.job.listing_file(i), steps, deadline)
            except TimeoutError:
                raise JobFailed(
                    f"engines on node {step.node} not ready within {gen.startup_timeout_s:g} s; "
                    f"log {step.log}:\n{step.log_tail()}"
                ) from None
            except RuntimeError as exc:
                # A host that gives up writes its reason before exiting; report that reason (it names
                # the deadline and carries the engine's log tail) rather than the bare exit, whichever
                # node's listing the loop happened to be waiting on when the other host died.
                reason = self._engine_start_error(indices) or f"engines failed to start: {exc}"
                raise JobFailed(reason) from None
            error = self._engine_start_error([i])
            if error:
                raise JobFailed(error)
            listing = self.job.read_listing(i)
            assert listing is not None
            urls += [e.api_url for e in sorted(listing.engines, key=lambda e: e.index)]
            self.state.event(
                "engines_ready",
                f"{len(urls)}/{gen.num_engines} engines ready",
                engines_ready=len(urls),
                engines_total=gen.num_engines,
            )
        self._mark("engine_start_s", t)
        self._say(f"engines ready: {len(urls)} in {self.timings['engine_start_s']} s")
        return urls

    def _start_fleet(self) -> None:
        """Engine hosts on the generation nodes, the gateway in front, our fleet controller; or, for a
        gateway that owns its engines (``FrontKind.owns_engines``, e.g. ray-serve), the gateway alone: it
        starts, checks and replaces its engines itself, so no engine hosts and no fleet controller (whose
        engine restarts do not apply); a watcher copies its view and engines to the job directory."""
        self._make_gateway()
        assert self.gateway is not None
        if self.front.owns_engines:
            self._start_router([])
            assert self.gateway is not None
            self.controller = GatewayFleetWatcher(self.job, self.state, self.gateway).start()
            return
        api_urls = self._start_engines()
        self._start_router(api_urls)
        gen = self.spec.generation
        self.controller = FleetController(
            self.job,
            self.state,
            self.gateway,
            len(self.generation_nodes),
            HealthPolicy(
                restarts_per_engine=gen.restarts_per_engine, restarts_per_run=gen.restarts_per_run
            ),
            hosts=self.hosts,
            restart_timeout_s=gen.startup_timeout_s + 30,
            say=self._say,
        ).start()

    def _make_gateway(self) -> None:
        """The front in front of the fleet (``router.kind``; see ``launcher.gateways``), on a port
        reserved once from the spec's range and held (``router.ports.PortHold``), so a restarted front
        rebinds the same URL and nobody else can take it meanwhile. Made before the engines because some
        kinds run what the engines register with (Dynamo's runtime)."""
        t = time.monotonic()
        r = self.spec.router
        host = node_address(socket.gethostname(), self.local)
        self.router_port = PortHold.reserve(host, r.port_range)
        context = GatewayContext(
            spec=self.spec,
            job=self.job,
            host=host,
            port=self.router_port.port,
            api_key=self.job.read_api_key(),
            admin_token=self.job.read_admin_token(),
            say=self._say,
            generation_nodes=tuple(self.generation_nodes) if not self.local else (),
            reserve_port=lambda: reserve_port(host, r.port_range),
        )
        try:
            self.gateway = make_gateway(r.kind, context)
            self.engine_runtime = self.gateway.prepare_engines()
        except GatewayError as exc:
            raise JobFailed(str(exc)) from None
        if self.engine_runtime:
            self._mark("gateway_runtime_start_s", t)

    def _start_router(self, api_urls: list[str]) -> str:
        t = time.monotonic()
        r = self.spec.router
        assert self.gateway is not None and self.router_port is not None
        if not self.gateway.binds_beside_port_hold:
            self.router_port.release()  # it binds its own socket without SO_REUSEPORT
        try:
            url = self.gateway.start(api_urls)
        except GatewayError as exc:
            raise JobFailed(str(exc)) from None
        self._mark("router_start_s", t)
        fleet_url = self.gateway.fleet_url()
        if fleet_url:
            self.state.update(fleet_url=fleet_url)
        label = self.front.label(r)
        self.state.event(
            "router_serving",
            f"router serving {url}/v1",
            router_url=url,
            policy=self.front.policy(r),
            gateway=r.kind,
            front=label,
        )
        engines = "engines of its own" if self.front.owns_engines else f"{len(api_urls)} engines"
        self._say(f"router serving {url}/v1 ({label}, {engines})")
        return url

    def _start_status_endpoint(self) -> None:
        host = node_address(socket.gethostname(), self.local)
        self.status_server = StatusServer(
            self.job, host, reserve_port(host, self.spec.router.port_range)
        ).start()
        self.state.update(status_url=self.status_server.url)
        self.job.log_event(
            "status_endpoint",
            f"status endpoint {self.status_server.url}/status (Authorization: Bearer <the job's API key>)",
            status_url=self.status_server.url,
        )

    def _wire_gym(self, router_url: str) -> dict[str, str]:
        key = self.job.read_api_key()
        overlay = self.spec.gym_overlay_path(self.job.path)
        write_gym_overlay(
            overlay,
            {
                "policy_base_url": f"{router_url}/v1",
                "policy_api_key": key,
                "policy_model_name": self.spec.gym.model_name,
            },
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
            env.update(self.ray.client_env())
        return env

    def _run_training(self, env: dict[str, str]) -> int:
        t = time.monotonic()
        self.state.event("training", "training command running")
        self._say(f"training: {self.spec.training.command}")
        log_path = self.job.training_log
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
                if isinstance(self.controller, FleetController) and self.controller.fatal:
                    # No engine can serve and none is coming back: fail now, instead of leaving the
                    # trainer to retry against an empty fleet until the allocation's time limit.
                    raise JobFailed(self.controller.fatal) from None
                failure = self.gateway.failed() if self.gateway is not None else None
                if failure:
                    # A launcher-owned front (Dynamo's frontend, etcd, NATS) died: every request fails.
                    raise JobFailed(f"the {self.spec.router.kind} gateway failed: {failure}") from None
                if self.stop_at is not None and time.time() >= self.stop_at:
                    # The warning signal may never reach this process (with --signal=B:USR2 it goes to
                    # the batch shell, which must pass it on); the end time alone is reason enough.
                    assert self.end_time is not None
                    left = self.end_time - time.time()
                    raise TimeLimitReached(
                        f"time limit: the allocation ends in {left:.0f} s; stopped before Slurm kills it"
                    ) from None
        tee.join(5)
        self._mark("training_s", t)
        return code

    # -- teardown --------------------------------------------------------------------------------------
    def _teardown(self, hurry: bool = False) -> None:
        """Stop everything the job started, on every node; the independent parts in parallel and each
        bounded, so the whole fits inside Slurm's KillWait after a scancel (the steps got SIGTERM from
        Slurm as well, and mostly only need to be waited for). Each part's time goes to the timings.

        ``hurry`` (a stop signal: Slurm's SIGKILL may be seconds away): the Ray head is stopped together
        with the rest instead of after the router's orderly stop, which only waits on a head that Slurm
        is taking down anyway (the router actor goes with it)."""
        t = time.monotonic()
        self.hosts.close()
        parts: list[tuple[str, Any]] = [("training", self._stop_training)]
        if not hurry or not self.front.dies_with_ray:
            # Hurried, a front that lives only as a Ray actor (FrontKind.dies_with_ray) goes with the Ray
            # head; the others are our processes.
            parts.append(("router", self._stop_router))
        if self.controller is not None:
            parts.append(("fleet-controller", self.controller.stop))
        if self.status_server is not None:
            parts.append(("status-endpoint", self.status_server.stop))
        parts += [(f"engines-{s.node}", s.stop) for s in self.hosts.all()]
        if self.ray is not None:
            parts += [(f"ray-worker-{s.node}", s.stop) for s in self.ray.workers]
            if hurry:
                parts.append(("ray-head", functools.partial(self.ray.stop, hurry=True)))
        took: dict[str, float] = {}

        def timed(name: str, part: Any) -> None:
            t_part = time.monotonic()
            try:
                part()
            except Exception as exc:  # one part's failure must not keep the others running
                self._say(f"teardown: stopping {name} failed: {exc!r}")
            finally:
                took[name] = round(time.monotonic() - t_part, 2)
                self._say(f"teardown: {name} stopped in {took[name]} s")

        threads = [threading.Thread(target=timed, args=part) for part in parts]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if self.ray is not None and not hurry:
            timed("ray-head", self.ray.stop)
        if self.router_port is not None:
            self.router_port.release()  # the front is gone: the job's URL with it
        self._mark("teardown_s", t)
        self._say(f"torn down in {self.timings['teardown_s']} s")

    def _stop_training(self) -> None:
        if self.training is None or self.training.poll() is not None:
            return
        try:
            os.killpg(self.training.pid, signal.SIGTERM)
            self.training.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.training.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _stop_router(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()


def write_gym_overlay(path: Path, values: dict[str, str]) -> None:
    """The Gym overlay (it holds the client key): a new 0600 file renamed into place, so an existing
    file's looser mode is not kept and a symlink planted at ``path`` is replaced, never written through
    (the old in-place write did both)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, yaml.safe_dump(values, sort_keys=False), mode=0o600)


def _tee(proc: subprocess.Popen[bytes], log_path: Path) -> None:
    assert proc.stdout is not None
    with log_path.open("ab") as log:
        for line in iter(proc.stdout.readline, b""):
            log.write(line)
            log.flush()
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
