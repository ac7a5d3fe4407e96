"""The on-allocation driver: one process, on the first training node, that runs the whole job.

Phases, each bounded and each recorded in the job directory (``state.json``, ``events.jsonl``):

1. **Ray**: the head here, a worker step on every other node; all alive before the deadline, or fail
   naming the node whose step died.
2. **Engines** (``launcher.driver.engine_hosts``): one engine-host step per generation node
   (``launcher.engines.host``) with the node's GPUs; each publishes its engines' URLs when all are
   healthy; a host that dies or misses the startup deadline fails the job with the engine log tail.
3. **Router**: the front ``router.kind`` names (``launcher.gateways``: our router as a Ray actor with
   ``max_restarts=-1``, vllm-router, Ray Serve, Dynamo), on a port reserved once from the spec's range
   and held for the job's life (a restarted front rebinds the same URL).
4. **Gym wiring** (``launcher.driver.gym_wiring``): the overlay (``policy_base_url`` = router + ``/v1``,
   ``policy_api_key``, ``policy_model_name``; mode 0600) and the same values as environment variables
   for the training command; with a fleet URL, vLLM's control API for the fleet (``RL_CONTROL_*``).
5. **Training** (``launcher.driver.training``): the command runs here (``bash -c``), its output teed to
   the job log; its exit code is the job's.

Stopping, every way (the job ends, a stop signal, the allocation's end time), goes through one teardown:
training, router, engine hosts, which stop their engines' process groups, Ray workers, Ray head; nothing
of the job is left running on any node. ``launcher.driver.stopping`` says how each way is told apart and
why the driver installs its signal handlers again after ``ray.init``.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from launcher.driver.engine_hosts import EngineHostLauncher
from launcher.driver.gateway_watcher import GatewayFleetWatcher
from launcher.driver.gym_wiring import control_url_of, wire_gym
from launcher.driver.standing import StandingAttachment, StandingFleet
from launcher.driver.status_server import StatusServer
from launcher.driver.stopping import TIME_LIMIT_EXIT, JobFailed, StopSignals, Terminated, TimeLimitReached
from launcher.driver.training import TrainingCommand
from launcher.fleet import HealthPolicy
from launcher.fleet.controller import FleetController
from launcher.fleet.elastic.manager import ElasticFleet
from launcher.gateways import Gateway, GatewayContext, GatewayError, gateway_class, make_gateway
from launcher.gateways.kinds import front_kind
from launcher.jobdir import JobDir, JobResult, StateWriter, start_ticks
from launcher.slurm.request import container_srun_args
from launcher.spec import ResolvedSpec
from launcher.spec.snapshot import write_spec
from launcher.steps.processes import LocalSteps, SrunSteps, node_address
from launcher.steps.ray_cluster import RayCluster, driver_process_env
from router.ports import PortHold, free_port, reserve_port


class Driver:
    """The phase script of one job, run on its allocation (or locally): ``run`` is the whole job."""

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
        self.engines = EngineHostLauncher(
            spec, self.job, self.state, self.steps, generation_nodes, self.front, self.local, self._say
        )
        self.stops = StopSignals()
        self.gateway: Gateway | None = None
        self.router_port: PortHold | None = None
        """The front's port, held for the job's life where the front binds beside the hold."""
        self.controller: FleetController | GatewayFleetWatcher | None = None
        self.status_server: StatusServer | None = None
        self.training = TrainingCommand(spec.training.command, self.job.training_log)
        self.t0 = time.monotonic()
        self._say_lock = threading.Lock()
        self.timings: dict[str, float] = {}
        self.elastic: ElasticFleet | None = None
        """Grow, drain and the tail policy (``launcher.fleet.elastic``), for a fleet of engine hosts."""
        self.standing: StandingFleet | StandingAttachment | None = None
        """A standing fleet's serving loop, or a job's attachment to one (``launcher.driver.standing``)."""

    # -- the job ------------------------------------------------------------------------------------
    def run(self) -> int:
        with driver_process_env(self.local):
            return self._run()

    def _run(self) -> int:
        self.stops.take_over()
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
                self.stops.watch_allocation_end(os.environ.get("SLURM_JOB_ID"))
            if self.spec.role == "attached":
                self.standing = StandingAttachment(self.spec, self.job, self.state, self._say)
                self.standing.attach()  # before Ray: a fleet that is gone fails the job at once
            self._start_ray()
            if self.spec.role != "attached":
                self._start_fleet()
            self._start_status_endpoint()
            if self.spec.role == "fleet":
                self.standing = StandingFleet(self.spec, self.job, self.state, self._say)
                code, reason = self.standing.serve(self._check_while_training)
                outcome = "finished"
            else:
                ray_client_env = self.ray.client_env() if self.ray is not None else {}
                env = wire_gym(
                    self.spec, self.job, self.state, ray_client_env, self._model_name(), say=self._say
                )
                code = self._run_training(env)
                reason = "training finished" if code == 0 else self.training.failure(code)
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
            self.stops.ignore()  # a second signal during teardown must not abort it half-way
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
            self.stops.restore()
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
        if signame is None and outcome != "time limit":  # Slurm's SIGKILL may be seconds away otherwise
            self._write_rollout_plots()
        first, _, tail = reason.partition("\n")  # a failure's log lines go under its line
        self._say(f"{outcome}: {first} (exit {code})" + (f"\n{tail}" if tail else ""))
        if self.ray is not None and not self.ray.disconnected:
            # ray.shutdown is stuck on a head Slurm took down; Ray's exit hook would wait on it again
            # until SIGKILL. Everything is stopped and recorded: leave now. After a stop signal this is
            # the rule, not a fault (the hurried teardown stops the head while Ray disconnects): the
            # driver log keeps the line, the user's terminal (after a plain cancel) does not.
            self._say("Ray did not disconnect; exiting without its exit hooks", to_user=signame is None)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code

    def _model_name(self) -> str:
        """What Gym sends as ``model``: the spec's, else (a job on a standing fleet) the fleet's."""
        if isinstance(self.standing, StandingAttachment):
            return self.spec.gym.model_name or self.standing.record.served_model_name
        return self.spec.gym.model_name

    def _write_rollout_plots(self) -> None:
        """The step timeline and per-engine load of the job's own record (``launcher.record.plots``),
        once the router has flushed it; a failure costs the plots, never the job's result."""
        if not self.spec.record.enabled or self.spec.role == "attached":
            return
        from launcher.jobdir.paths import plots_dir, record_dir
        from launcher.record.plots import write_job_plots

        try:
            written = write_job_plots(record_dir(self.job.path), plots_dir(self.job.path))
        except Exception as exc:
            self._say(f"rollout plots not written: {exc!r}")
            return
        if written:
            self._say(f"rollout plots: {', '.join(str(p) for p in written)}")

    def _say(self, message: str, to_user: bool = True) -> None:
        """One line to stderr and the driver log, whole: the teardown's threads say theirs at once, and
        ``print`` writes a line and its newline apart (two lines ran together on one)."""
        line = f"[rl-launch {time.monotonic() - self.t0:6.1f}s] {message}\n"
        with self._say_lock:
            if to_user:
                sys.stderr.write(line)
                sys.stderr.flush()
            with self.job.driver_log.open("a") as f:
                f.write(line)

    def _mark(self, name: str, since: float) -> None:
        self.timings[name] = round(time.monotonic() - since, 2)

    def _write_spec(self) -> None:
        if not self.job.spec_file.exists():  # ``submit`` wrote the snapshot this job runs; keep it
            write_spec(self.job, self.spec)
        self.job.new_api_key()
        self.job.new_admin_token()
        self.job.new_engine_key(client_key=self.front.engines_take_client_key)
        self.job.new_ray_token()
        if self.spec.generation.trainer_owned:
            self.job.new_registration_capability()

    # -- phases ----------------------------------------------------------------------------------------
    def _start_ray(self) -> None:
        t = time.monotonic()
        head_ip = node_address(socket.gethostname(), self.local)
        os.environ.update(gateway_class(self.spec.router.kind).ray_env)  # before Ray reads it
        head = (self.training_nodes or self.generation_nodes)[0]  # a standing fleet has no training nodes
        others = [n for n in [*self.training_nodes, *self.generation_nodes] if n != head]
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
            raise Terminated(signal.SIGTERM, self.stops.outcome_of(signal.SIGTERM)) from None
        finally:
            self.stops.install()  # ray.init replaced the SIGTERM handler with Ray's
        self._mark("ray_start_s", t)
        self.state.event("ray_up", f"{1 + len(others)} Ray node(s) alive at {self.ray.address}")
        self._say(f"Ray up: {1 + len(others)} node(s) in {self.timings['ray_start_s']} s")

    def _start_engines(self) -> list[str]:
        t = time.monotonic()
        urls = self.engines.start()
        self._mark("engine_start_s", t)
        self._say(f"engines ready: {len(urls)} in {self.timings['engine_start_s']} s")
        return urls

    def _start_fleet(self) -> None:
        """Engine hosts on the generation nodes, the gateway in front, our fleet controller; or, for a
        gateway that owns its engines (``FrontKind.owns_engines``, e.g. ray-serve), the gateway alone: it
        starts, checks and replaces its engines itself, so no engine hosts and no fleet controller (whose
        engine restarts do not apply); a watcher copies its view and engines to the job directory. The
        same for engines the training command starts and registers (``generation.owner: trainer``)."""
        self._make_gateway()
        assert self.gateway is not None
        if self.front.owns_engines or self.spec.generation.trainer_owned:
            # Engines the trainer owns (``generation.owner: trainer``) are the same for us: the router
            # probes, holds out and readmits the ones it registers; nothing of ours may restart them.
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
            HealthPolicy(restarts_per_engine=gen.restarts_per_engine, restarts_per_run=gen.restarts_per_run),
            hosts=self.engines.hosts,
            restart_timeout_s=gen.startup_timeout_s + 30,
            say=self._say,
        ).start()
        self.elastic = ElasticFleet(
            self.spec,
            self.job,
            self.state,
            self.controller,
            self.engines,
            self.ray,
            local=self.local,
            training_nodes=self.training_nodes,
            held_since=time.time() - (time.monotonic() - self.t0),
            say=self._say,
            refuse_why=self.front.no_elastic_why,
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
            engine_key=self.job.read_engine_key(),
            registration_capability=self.job.read_registration_capability(),
            say=self._say,
            generation_nodes=tuple(self.generation_nodes) if not self.local else (),
            reserve_port=lambda: reserve_port(host, r.port_range),
        )
        try:
            self.gateway = make_gateway(r.kind, context)
            self.engines.engine_runtime = self.gateway.prepare_engines()
        except GatewayError as exc:
            raise JobFailed(str(exc)) from None
        if self.engines.engine_runtime:
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
        control_url = control_url_of(fleet_url)  # vLLM's control API for the whole fleet (docs/trainers.md)
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
            control_url=control_url,
        )
        engines = f"{len(api_urls)} engines"
        if self.front.owns_engines:
            engines = "engines of its own"
        elif self.spec.generation.trainer_owned:
            engines = "engines the trainer registers"
        control = f"; vLLM control API {control_url} (admin token)" if control_url else ""
        self._say(f"router serving {url}/v1 ({label}, {engines}){control}")
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

    def _run_training(self, env: dict[str, str]) -> int:
        t = time.monotonic()
        self.state.event("training", "training command running")
        self._say(f"training: {self.spec.training.command}")
        code = self.training.run(env, check=self._check_while_training)
        self._mark("training_s", t)
        return code

    def _check_while_training(self) -> None:
        """Why the job cannot go on, raised while the training command runs; nothing while it can."""
        if isinstance(self.controller, FleetController) and self.controller.fatal:
            # No engine can serve and none is coming back: fail now, instead of leaving the trainer to
            # retry against an empty fleet until the allocation's time limit.
            raise JobFailed(self.controller.fatal) from None
        failure = self.gateway.failed() if self.gateway is not None else None
        if failure:
            # A launcher-owned front (Dynamo's frontend, etcd, NATS) died: every request fails.
            raise JobFailed(f"the {self.spec.router.kind} gateway failed: {failure}") from None
        self.stops.check_time_limit()

    # -- teardown --------------------------------------------------------------------------------------
    def _teardown(self, hurry: bool = False) -> None:
        """Stop everything the job started, on every node; the independent parts in parallel and each
        bounded, so the whole fits inside Slurm's KillWait after a scancel (the steps got SIGTERM from
        Slurm as well, and mostly only need to be waited for). Each part's time goes to the timings.

        ``hurry`` (a stop signal: Slurm's SIGKILL may be seconds away): the Ray head is stopped together
        with the rest instead of after the router's orderly stop, which only waits on a head that Slurm
        is taking down anyway (the router actor goes with it)."""
        t = time.monotonic()
        if self.elastic is not None:
            # First: no grow may start hosts the teardown would miss; its grow jobs end with the job.
            try:
                self.elastic.close()
            except Exception as exc:
                self._say(f"teardown: closing the elastic fleet failed: {exc!r}")
        self.engines.hosts.close()
        parts: list[tuple[str, Any]] = [("training", self.training.stop)] if self.training.started else []
        if self.standing is not None:
            parts.append(("standing", self.standing.close))
        if not hurry or not self.front.dies_with_ray:
            # Hurried, a front that lives only as a Ray actor (FrontKind.dies_with_ray) goes with the Ray
            # head; the others are our processes.
            parts.append(("router", self._stop_router))
        if self.controller is not None:
            parts.append(("fleet-controller", self.controller.stop))
        if self.status_server is not None:
            parts.append(("status-endpoint", self.status_server.stop))
        parts += [(f"engines-{s.node}", s.stop) for s in self.engines.hosts.all()]
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

    def _stop_router(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
