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

from launcher.engines.base import Engine, EngineSpec, EngineStartError


@dataclass
class EngineHostConfig:
    kind: str  # "vllm" | "sim"
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
    urls_file: str = "engines.json"
    api_key_file: str | None = None
    vllm_python: str | None = None
    node_index: int = 0

    @classmethod
    def load(cls, path: str | Path) -> EngineHostConfig:
        return cls(**json.loads(Path(path).read_text()))

    def dump(self, path: str | Path) -> None:
        write_json_atomic(Path(path), self.__dict__)


def write_json_atomic(path: Path, payload: object) -> None:
    """Readers on other nodes must never see half a file: write aside, then rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    os.replace(tmp, path)


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


def build_engines(cfg: EngineHostConfig) -> list[Engine]:
    api_key = read_secret(cfg.api_key_file)
    log_dir = Path(cfg.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    name = cfg.served_name or cfg.model
    if cfg.kind == "sim":
        from launcher.engines.sim.process import SimEngine

        spec = EngineSpec(
            model=name,
            host=cfg.host,
            api_key=api_key,
            extra_args=list(cfg.sim_args),
            env=dict(cfg.env),
            log_path=str(log_dir / f"engines-node{cfg.node_index}.log"),
            startup_timeout_s=cfg.startup_timeout_s,
        )
        # Simulated engines of one node share one process: many engines on a core.
        return [SimEngine(spec, engines=cfg.count)]
    if cfg.kind != "vllm":
        raise ValueError(f"unknown engine kind {cfg.kind!r} (vllm or sim)")
    from launcher.engines.vllm import VllmEngine

    gpus = cfg.gpus
    if gpus is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        gpus = [g for g in visible.split(",") if g]
    per_engine = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    engines: list[Engine] = []
    for i, group in enumerate(split_gpus(gpus, cfg.count, per_engine)):
        env = dict(cfg.env)
        if group:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(group)
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
            log_path=str(log_dir / f"engine-node{cfg.node_index}-{i}.log"),
            startup_timeout_s=cfg.startup_timeout_s,
        )
        engines.append(VllmEngine(spec, python=cfg.vllm_python))
    return engines


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


def run(cfg: EngineHostConfig) -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    urls_file = Path(cfg.urls_file)
    node = socket.gethostname()
    engines = build_engines(cfg)
    started = time.monotonic()
    try:
        start_all(engines, cfg.startup_timeout_s)
    except EngineStartError as exc:
        write_json_atomic(urls_file, {"node": node, "error": str(exc), "engines": []})
        print(f"engine host on {node}: {exc}", file=sys.stderr, flush=True)
        return 3
    listing = [
        {
            "url": url,
            "api_url": f"{url}/v1",
            "node": node,
            "node_index": cfg.node_index,
            "log": str(getattr(e, "log_path", "") or ""),
        }
        for e in engines
        for url in engine_urls(e)
    ]
    write_json_atomic(urls_file, {"node": node, "engines": listing, "ready_s": time.monotonic() - started})
    print(
        f"engine host on {node}: {len(listing)} engine(s) ready in {time.monotonic() - started:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    try:
        while not stop.wait(1.0):
            if not any(e.is_alive() for e in engines):
                print(f"engine host on {node}: every engine exited", file=sys.stderr, flush=True)
                return 4
        return 0
    finally:
        for engine in engines:
            engine.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Start and hold one node's engines (used by the driver).")
    parser.add_argument("--config", required=True, help="EngineHostConfig JSON written by the driver")
    args = parser.parse_args(argv)
    return run(EngineHostConfig.load(args.config))


if __name__ == "__main__":
    sys.exit(main())
