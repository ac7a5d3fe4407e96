"""The engines phase: one engine-host step per generation node (``launcher.engines.host``) with the node's
GPUs; each publishes its engines' URLs when all are healthy; a host that dies or misses the startup deadline
fails the job with the engine log tail. The steps stay restartable one at a time, for the fleet controller.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from launcher.driver.stopping import JobFailed
from launcher.engines.host_config import EngineHostConfig
from launcher.engines.kinds import engine_kind
from launcher.gateways.front import FrontKind
from launcher.jobdir import JobDir, StateWriter
from launcher.spec import ResolvedSpec
from launcher.steps.processes import LocalSteps, SrunSteps, Step, node_address, wait_for_file


class EngineHostSteps:
    """The engine-host step of every generation node, restartable one at a time (the fleet controller
    restarts the host of a node whose step died)."""

    def __init__(self, start: Callable[[int], Step]) -> None:
        self._start = start  # node index -> its started step
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

    def stop(self, node_index: int, grace_s: float = 15.0) -> None:
        """Stop one node's host for good (the node leaves the fleet: ``launcher.fleet.elastic``)."""
        with self._lock:
            step = self.steps.pop(node_index, None)
        if step is not None:
            step.stop(grace_s=grace_s)

    def describe(self, node_index: int) -> str:
        with self._lock:
            step = self.steps.get(node_index)
        if step is None:
            return "never started"
        return f"node {step.node}; log {step.log}:\n{step.log_tail(10)}"

    def all(self) -> list[Step]:
        with self._lock:
            return [self.steps[i] for i in sorted(self.steps)]


class EngineHostLauncher:
    """Writes each generation node's engine-host config, starts its step (again, on a restart), and waits
    until every host has published its engines or one has failed."""

    def __init__(
        self,
        spec: ResolvedSpec,
        job: JobDir,
        state: StateWriter,
        steps: LocalSteps | SrunSteps,
        generation_nodes: list[str],
        front: FrontKind[Any],
        local: bool,
        say: Callable[[str], None],
    ) -> None:
        self.spec, self.job, self.state, self.steps = spec, job, state, steps
        self.generation_nodes, self.front, self.local, self.say = generation_nodes, front, local, say
        self.hosts = EngineHostSteps(self.launch_host)
        self.node_jobs: dict[int, str] = {}
        """Generation nodes held by another Slurm job than the driver's (a grow, ``launcher.fleet.elastic``):
        node index -> that job's id, which their steps are started into (``srun --jobid``)."""
        self.engine_runtime: dict[str, Any] = {}
        """What the engines need of the gateway's runtime (Dynamo: discovery and planes); see
        ``Gateway.prepare_engines``. Set before the first host starts."""

    def start_error(self, indices: list[int]) -> str | None:
        """The first error an engine host wrote into its listing, naming its node; None if none did."""
        for i in indices:
            listing = self.job.read_listing(i)
            if listing is not None and listing.error:
                return f"engines on node {self.generation_nodes[i]} failed to start:\n{listing.error}"
        return None

    def config(self, index: int, node: str) -> EngineHostConfig:
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
            lora=gen.lora.model_dump() if gen.lora is not None else None,
            startup_timeout_s=gen.startup_timeout_s,
            log_dir=str(self.job.logs),
            job_dir=str(self.job.path),
            api_key_file=str(self.job.engine_key_file),  # the engines' own key, no client's
            node_index=index,
            **engine_kind(gen.engine).host_fields(gen, os.environ),
            **self.front.engine_host_fields(self.spec.router, self.engine_runtime),
        )

    def launch_host(self, index: int) -> Step:
        """Start (or start again) generation node ``index``'s engine host step."""
        gen = self.spec.generation
        resources = gen.resources
        gpus = resources.gpus_per_node if resources is not None else 0
        jobid = self.node_jobs.get(index)
        hetjob = self.spec.slurm is not None and self.spec.slurm.layout == "hetjob"
        het_group = 1 if hetjob and jobid is None else None
        node = self.generation_nodes[index]
        path = self.job.host_config_file(index)
        if not path.exists():
            self.config(index, node).dump(path)
        argv = [sys.executable, "-m", "launcher.engines.host", "--config", str(path)]
        return self.steps.start(
            node,
            f"engines-{node}",
            argv,
            os.environ,
            self.job.engine_host_log(index),
            gpus=gpus,
            het_group=het_group,
            jobid=jobid,
        )

    def start(self) -> list[str]:
        """Every node's host started, then each one's listing waited for in node order: the engines' API
        URLs, once all are ready."""
        gen = self.spec.generation
        indices = list(range(len(self.generation_nodes)))
        self.say(f"starting {gen.num_engines} {gen.engine} engine(s) on {len(indices)} node(s)")
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
                reason = self.start_error(indices) or f"engines failed to start: {exc}"
                raise JobFailed(reason) from None
            error = self.start_error([i])
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
        return urls
