"""The engine host: one process per generation node that starts, watches and stops that node's engines.

The driver starts it once per node (a ``srun`` step on Slurm, a subprocess in local mode) with a JSON
config in the job directory. It splits the node's GPUs between engines by footprint (TP x PP), starts
them in parallel, waits for all to be healthy within the startup deadline, and publishes their URLs in
a file the driver reads (the job directory is on the shared filesystem, as on a real cluster). On
SIGTERM (``scancel``, driver teardown) it stops every engine's whole process group before exiting, so
no engine survives its step even under ``proctrack/linuxproc``, which does not reap leftovers.

Why one host per node rather than one step per engine: a ``srun`` step costs a second or more of
controller round trips, and a node's engines share one GPU inventory that only a process on the node can
split correctly.

The API key is read from a 0600 file named in the config and handed to each engine through its
environment: never in argv (world-readable in ``/proc``), never in the config, never in a log.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.engines.base import Engine, EngineSpec, EngineStartError
from launcher.jobdir import EngineEntry, EngineListing, JobDir, write_json_atomic


@dataclass
class EngineHostConfig:
    kind: str  # "vllm" | "sim" | "dynamo-vllm" | "dynamo-mocker"
    count: int
    host: str
    model: str
    served_name: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpus: list[str] | None = None  # None: take CUDA_VISIBLE_DEVICES of the step (may be empty)
    extra_args: list[str] = field(default_factory=list)
    sim_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 900.0
    log_dir: str = "."
    job_dir: str = "."
    api_key_file: str | None = None
    vllm_python: str | None = None
    node_index: int = 0
    dynamo: dict[str, Any] = field(default_factory=dict)
    """Dynamo workers: ``DynamoPlanes`` as a dict (discovery, request plane, runtime env)."""
    dynamo_python: str | None = None
    dynamo_worker_args: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, path: str | Path) -> EngineHostConfig:
        return cls(**json.loads(Path(path).read_text()))

    def dump(self, path: str | Path) -> None:
        write_json_atomic(Path(path), self.__dict__)


def split_gpus(gpus: Sequence[str], count: int, per_engine: int) -> list[list[str]]:
    """GPU ids per engine: consecutive groups of ``per_engine`` (TP peers on adjacent devices)."""
    if not gpus:
        return [[] for _ in range(count)]
    if count * per_engine > len(gpus):
        raise ValueError(
            f"{count} engine(s) x {per_engine} GPU(s) each need {count * per_engine} GPUs, "
            f"but this node has {len(gpus)} ({','.join(gpus)})"
        )
    return [list(gpus[i * per_engine : (i + 1) * per_engine]) for i in range(count)]


def read_secret(path: str | None) -> str | None:
    if not path:
        return None
    return Path(path).read_text().strip() or None


def build_engine(cfg: EngineHostConfig, index: int, gpus: list[str]) -> Engine:
    """Engine ``index`` of this node (a fresh object each time: a restart starts a new process on a
    new port, on the same GPUs)."""
    api_key = read_secret(cfg.api_key_file)
    log_dir = Path(cfg.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = str(JobDir(cfg.job_dir).engine_log(cfg.node_index, index))
    if cfg.kind == "sim":
        from launcher.engines.sim.process import SimEngine

        spec = EngineSpec(
            model=cfg.served_name or cfg.model,
            host=cfg.host,
            api_key=api_key,
            extra_args=list(cfg.sim_args),
            env=dict(cfg.env),
            log_path=log_path,
            startup_timeout_s=cfg.startup_timeout_s,
        )
        # One process per simulated engine, like vLLM, so one engine can die and be restarted alone.
        return SimEngine(spec, engines=1)
    if cfg.kind in ("dynamo-vllm", "dynamo-mocker"):
        return build_dynamo_worker(cfg, gpus, api_key, log_path)
    if cfg.kind != "vllm":
        raise ValueError(f"unknown engine kind {cfg.kind!r} (vllm, sim, dynamo-vllm or dynamo-mocker)")
    from launcher.engines.vllm.engine import VllmEngine

    env = dict(cfg.env)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    extra = list(cfg.extra_args)
    if cfg.pipeline_parallel_size > 1:
        extra = ["--pipeline-parallel-size", str(cfg.pipeline_parallel_size), *extra]
    spec = EngineSpec(
        model=cfg.model,
        served_name=cfg.served_name,
        host=cfg.host,
        port=0,
        api_key=api_key,
        tensor_parallel_size=cfg.tensor_parallel_size,
        extra_args=extra,
        env=env,
        log_path=log_path,
        startup_timeout_s=cfg.startup_timeout_s,
    )
    return VllmEngine(spec, python=cfg.vllm_python)


def build_dynamo_worker(cfg: EngineHostConfig, gpus: list[str], api_key: str | None, log_path: str) -> Engine:
    """One Dynamo worker (one TP x PP group, on this node's GPUs) registering with the job's runtime."""
    from launcher.engines.dynamo.worker import DynamoPlanes, DynamoWorker, dynamo_python

    env = dict(cfg.env)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    spec = EngineSpec(
        model=cfg.model,
        served_name=cfg.served_name,
        host=cfg.host,
        api_key=api_key,
        tensor_parallel_size=cfg.tensor_parallel_size,
        extra_args=list(cfg.extra_args) if cfg.kind == "dynamo-vllm" else [],
        env=env,
        log_path=log_path,
        startup_timeout_s=cfg.startup_timeout_s,
    )
    return DynamoWorker(
        spec,
        cfg.kind,  # type: ignore[arg-type]
        DynamoPlanes(**cfg.dynamo),
        python=dynamo_python(cfg.dynamo_python),
        tensor_parallel_size=cfg.tensor_parallel_size,
        pipeline_parallel_size=cfg.pipeline_parallel_size,
        worker_args=cfg.dynamo_worker_args,
    )


def gpu_groups(cfg: EngineHostConfig) -> list[list[str]]:
    gpus = cfg.gpus
    if gpus is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        gpus = [g for g in visible.split(",") if g]
    if cfg.kind in ("sim", "dynamo-mocker"):
        return [[] for _ in range(cfg.count)]
    return split_gpus(gpus, cfg.count, cfg.tensor_parallel_size * cfg.pipeline_parallel_size)


def engine_urls(engine: Engine) -> list[str]:
    urls = getattr(engine, "urls", None)
    return list(urls) if urls else [engine.url]


def start_all(engines: list[Engine], timeout_s: float) -> None:
    """Start every engine, then wait for all within one deadline; on any failure stop them all."""
    deadline = time.monotonic() + timeout_s
    try:
        for engine in engines:
            engine.start()
        errors: list[BaseException] = []

        def wait(e: Engine) -> None:
            try:
                e.wait_ready(deadline)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=wait, args=(e,)) for e in engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    except BaseException:
        for engine in engines:
            engine.stop()
        raise


class EngineHost:
    """Holds the node's engines and restarts one on request.

    Restart requests come from the fleet controller through ``engines/node-<i>.control.json``
    (``ControlRequests``, written atomically on the shared filesystem): a request whose generation is
    newer than the engine's current one stops that engine and starts a replacement on a new port, on the
    same GPUs; the listing is rewritten with the new URL and generation once it is healthy, or with the
    error. A host started again after its step died takes the requested generations as its own, so its
    fresh engines answer the restart requests the controller made for the dead host's engines.
    A file rather than a socket because the driver and the host may be on different nodes and already
    share the job directory; polling it every half second costs nothing next to an engine's start time.
    """

    def __init__(self, cfg: EngineHostConfig) -> None:
        self.cfg = cfg
        self.node = socket.gethostname()
        self.job = JobDir(cfg.job_dir)
        self.groups = gpu_groups(cfg)
        self.engines: list[Engine] = [build_engine(cfg, i, g) for i, g in enumerate(self.groups)]
        requested = self.job.read_control(cfg.node_index).restart
        self.generations = [requested.get(i, 0) for i in range(len(self.engines))]
        self.errors: list[str | None] = [None] * len(self.engines)

    def entry(self, index: int) -> EngineEntry:
        engine = self.engines[index]
        url = engine_urls(engine)[0] if self.errors[index] is None else ""
        return EngineEntry(
            index=index,
            url=url,
            api_url=f"{url}/v1" if url else "",
            node=self.node,
            node_index=self.cfg.node_index,
            generation=self.generations[index],
            log=str(getattr(engine, "log_path", "") or ""),
            error=self.errors[index],
        )

    def publish(self, started: float) -> None:
        self.job.write_listing(
            EngineListing(
                node=self.node,
                node_index=self.cfg.node_index,
                engines=[self.entry(i) for i in range(len(self.engines))],
                ready_s=time.monotonic() - started,
            )
        )

    def publish_error(self, error: str) -> None:
        self.job.write_listing(EngineListing(node=self.node, node_index=self.cfg.node_index, error=error))

    def restart(self, index: int, generation: int) -> None:
        old = self.engines[index]
        old.stop()
        engine = build_engine(self.cfg, index, self.groups[index])
        self.engines[index] = engine
        self.generations[index] = generation
        try:
            engine.start_and_wait()
            self.errors[index] = None
        except EngineStartError as exc:
            self.errors[index] = str(exc)

    def pending_restarts(self) -> dict[int, int]:
        requests = self.job.read_control(self.cfg.node_index).restart
        return {i: g for i, g in requests.items() if 0 <= i < len(self.engines) and g > self.generations[i]}

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()


def run(cfg: EngineHostConfig) -> int:
    stop = threading.Event()

    def abort_startup(signum: int, frame: object) -> None:
        # While engines start, unwind through start_all, which stops every engine it started: a host
        # that waited for them instead would be SIGKILLed by the driver and leave them running.
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, abort_startup)
    # Slurm's time-limit warning is the driver's to act on (it tears the whole job down in order); an
    # engine host, and the engines that inherit this disposition, must not die of it 90 s early.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    host = EngineHost(cfg)
    started = time.monotonic()
    try:
        start_all(host.engines, cfg.startup_timeout_s)
    except EngineStartError as exc:
        host.publish_error(str(exc))
        print(f"engine host on {host.node}: {exc}", file=sys.stderr, flush=True)
        return 3
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    host.publish(started)
    print(
        f"engine host on {host.node}: {len(host.engines)} engine(s) ready "
        f"in {time.monotonic() - started:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    try:
        while not stop.wait(0.5):
            for index, generation in host.pending_restarts().items():
                print(f"engine host on {host.node}: restarting engine {index}", file=sys.stderr, flush=True)
                host.restart(index, generation)
                host.publish(started)
        return 0
    finally:
        host.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Start and hold one node's engines (used by the driver).")
    parser.add_argument("--config", required=True, help="EngineHostConfig JSON written by the driver")
    args = parser.parse_args(argv)
    return run(EngineHostConfig.load(args.config))


if __name__ == "__main__":
    sys.exit(main())
