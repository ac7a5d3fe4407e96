"""Command line of the simulator process: ``python -m launcher.engines.sim --host H --port P ...``.

Every ``SimConfig`` field is a flag (``--num-gpu-blocks``, ``--speed``, ...), generated from the
dataclass so the two never drift apart (a dict field such as ``--weight-transfer-config`` takes JSON, as
vLLM's flag does). The API key comes from ``--api-key-file`` or the
``RL_LAUNCH_API_KEY`` environment variable, never from argv, which any user on the node can read in
``ps``. Prints one ``SIM_URL http://host:port`` line per engine once all are bound (and writes them to
``--url-file`` atomically, which is how ``SimEngine`` learns OS-chosen ports), then serves until
SIGTERM or SIGINT, or until every engine's core died (exit status 1, as vLLM's server exits then).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys
import typing
from collections.abc import Mapping, Sequence

from .config import RUNTIME_LORA_ENV, SimConfig
from .faults import FAULT_MODES, FaultSpec
from .fleet import SimFleet

API_KEY_ENV = "RL_LAUNCH_API_KEY"
URL_PREFIX = "SIM_URL "
FROM_ENV = {"allow_runtime_lora_updating": RUNTIME_LORA_ENV}
"""``SimConfig`` fields vLLM takes from its environment, not its command line: read from there (as vLLM
does, ``"1"`` or ``"true"``), so a launcher that gives vLLM the variable gives the simulator the same."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launcher.engines.sim", description="vLLM-compatible engine simulator"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--port",
        type=int,
        default=0,
        help="first engine's port; engine i gets port+i (0: every port OS-chosen)",
    )
    p.add_argument("--engines", type=int, default=1, help="engines served by this process")
    p.add_argument("--api-key-file", default=None, help=f"file holding the API key (else ${API_KEY_ENV})")
    p.add_argument(
        "--key-guard",
        action="store_true",
        help="every route but /health takes the API key (vLLM with the launcher's --middleware); "
        "without it, as vLLM: only /v1 and the like",
    )
    p.add_argument("--url-file", default=None, help="write the served URLs here, one a line, once bound")
    p.add_argument("--fault", choices=FAULT_MODES, default="none", help="initial fault mode")
    p.add_argument("--error-rate", type=float, default=0.3)
    p.add_argument("--slow-factor", type=float, default=10.0)
    p.add_argument("--no-wedge-health", action="store_true", help="wedge: keep /health answering")
    p.add_argument(
        "--watch-parent",
        action="store_true",
        help="exit when the parent process dies (no orphan engines after a crashed launcher)",
    )
    p.add_argument("--model", dest="model_name", default=None, help="alias of --model-name")
    hints = typing.get_type_hints(SimConfig)
    for f in dataclasses.fields(SimConfig):
        if f.name in FROM_ENV:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if kind is bool:
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
        elif any(dict in (t, typing.get_origin(t)) for t in (kind, *typing.get_args(kind))):
            p.add_argument(flag, dest=f.name, type=_json_object, default=None, help="a JSON object")
        elif kind in (int, float, str):
            if f.name == "model_name":  # also vLLM's spelling, so launch scripts can swap engines
                p.add_argument(flag, "--served-model-name", dest=f.name, type=str, default=None)
            else:
                p.add_argument(flag, dest=f.name, type=kind, default=None)
    return p


def _json_object(text: str) -> dict[str, object]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("not a JSON object")
    return value


def config_from_args(args: argparse.Namespace) -> SimConfig:
    overrides: dict[str, object] = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(SimConfig)
        if getattr(args, f.name, None) is not None
    }
    for name, var in FROM_ENV.items():
        overrides[name] = os.environ.get(var, "0").strip().lower() in ("1", "true")
    cfg = SimConfig(**overrides)  # type: ignore[arg-type]
    cfg.validate()
    return cfg


def options_to_flags(options: Mapping[str, object]) -> list[str]:
    """``SimConfig`` options (``{"speed": 10, "chunked": False}``) as this command's flags, for
    callers that start the simulator as a process (the engine host, the replay bench)."""
    args: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args


def read_api_key(path: str | None) -> str | None:
    if path:
        with open(path) as fh:
            key = fh.read().strip()
        return key or None
    return os.environ.get(API_KEY_ENV) or None


def _write_url_file(path: str, urls: Sequence[str]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write("".join(u + "\n" for u in urls))
    os.replace(tmp, path)  # atomic: a reader never sees half a list


async def serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    fault = FaultSpec(
        mode=args.fault,
        error_rate=args.error_rate,
        slow_factor=args.slow_factor,
        wedge_health=not args.no_wedge_health,
    )
    ports = [args.port + i for i in range(args.engines)] if args.port else None
    fleet = SimFleet(
        args.engines,
        config,
        host=args.host,
        ports=ports,
        api_key=read_api_key(args.api_key_file),
        key_guard=args.key_guard,
        fault=fault,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    urls = await fleet.astart()
    rc = 0
    try:
        for u in urls:
            print(URL_PREFIX + u, flush=True)
        if args.url_file:
            _write_url_file(args.url_file, urls)
        parent = os.getppid()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.2)
            if args.watch_parent and os.getppid() != parent:
                print("parent process gone; exiting", flush=True)
                break
            if all(s.exited.is_set() for s in fleet.servers):
                # vLLM's API server exits once its engine core died (VLLM_KEEP_ALIVE_ON_ENGINE_DEATH unset)
                print("EngineCore died; the server exits", flush=True)
                rc = 1
                break
    finally:
        await fleet.astop()
    print("simulator stopped", flush=True)
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.engines < 1:
        print("--engines must be >= 1", file=sys.stderr)
        return 2
    try:
        import uvloop  # optional: a faster loop for big fleets
    except ImportError:
        return asyncio.run(serve(args))
    return uvloop.run(serve(args))
