"""What one fleet pause->resume cycle costs, through the router's /fleet API, with load in flight.

Starts N simulated engines (vLLM's RL routes, same semantics) and the router on 127.0.0.1, keeps a bounded
stream of chat requests going, and runs CYCLES refit windows through the trainer's client: pause(keep),
a hold standing in for the weight transfer, cache reset, version stamp, resume. Prints per cycle the
time of each part and the requests held by the router with their longest wait. Bounded: CYCLES cycles,
at most --clients concurrent requests, each at most 60 s.

    .venv/bin/python bench/refit_cycle.py --engines 4 --cycles 5 --hold 0.5
    .venv/bin/python bench/refit_cycle.py --engine-url http://127.0.0.1:8001 ...   # real engines

With --checkpoint each cycle is one refit transaction from a checkpoint directory instead
(``FleetClient.load_weights``: pause, every engine reloads, verify checksums, reset caches, stamp, resume),
alternating between two directories so every cycle really changes the weights; it prints the load step's
time and the transaction's own overhead beyond it. The directories: --from-dir A --from-dir B, or two
safetensors checkpoints of --checkpoint-mb each that the bench writes to a temporary directory (the
simulator reads and hashes them as its load; vLLM needs real ones, e.g. the tests' tiny model and a copy).

    .venv/bin/python bench/refit_cycle.py --engines 4 --cycles 10 --checkpoint

With --engine-url the engines are real (vLLM with VLLM_SERVER_DEV_MODE=1) and only the router is started;
with --vllm-model DIR the bench starts --engines real vLLM CPU engines itself (python from
$RL_LAUNCH_VLLM_PYTHON; e.g. the tests' tiny model) and stops them at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

import aiohttp

from launcher.engines.base import EngineSpec, start_all
from launcher.engines.sim.checkpoint import write_checkpoint
from launcher.engines.sim.config import SimConfig
from launcher.engines.sim.server import SimServer
from launcher.engines.vllm.engine import VllmEngine
from launcher.fleet.client import FleetClient
from router import GenerationRouter
from router.config import RouterConfig

TOKEN = "bench-refit-token"


async def load(url: str, model: str, clients: int, stop: asyncio.Event, counts: dict[str, int]) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "bench " * 40}], "max_tokens": 32}
    timeout = aiohttp.ClientTimeout(total=60)

    async def one_client(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                await r.read()
                counts[str(r.status)] = counts.get(str(r.status), 0) + 1

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one_client(session) for _ in range(clients)))


def cycles(client: FleetClient, n: int, hold_s: float) -> list[dict[str, float]]:
    out = []
    for i in range(n):
        time.sleep(0.5)  # let load build up between windows
        t0 = time.perf_counter()
        client.pause("keep")
        t1 = time.perf_counter()
        time.sleep(hold_s)
        t2 = time.perf_counter()
        client.reset_prefix_cache()
        client.set_weight_version(f"bench-{i}")
        t3 = time.perf_counter()
        resumed = client.resume()
        t4 = time.perf_counter()
        out.append(
            {
                "pause_s": t1 - t0,
                "reset_and_stamp_s": t3 - t2,
                "resume_s": t4 - t3,
                "cycle_s": t4 - t0,
                "overhead_s": t4 - t0 - hold_s,
                "held": resumed.result["released"],
                "longest_wait_s": resumed.result["held_longest_wait_s"],
            }
        )
    return out


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--engine-url", action="append", default=[])
    p.add_argument("--model", default="sim")
    p.add_argument("--cycles", type=int, default=5)
    p.add_argument("--hold", type=float, default=0.5)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--vllm-model", default=None, help="start --engines real vLLM CPU engines on this model")
    p.add_argument("--checkpoint", action="store_true", help="refit from checkpoint directories")
    p.add_argument("--from-dir", action="append", default=[], help="a checkpoint directory (give two)")
    p.add_argument("--checkpoint-mb", type=float, default=8.0, help="size of each written checkpoint")
    args = p.parse_args()
    if args.checkpoint and not args.from_dir:
        args.from_dir = write_checkpoints(args.checkpoint_mb)
    if args.checkpoint and len(args.from_dir) != 2:
        p.error("--checkpoint needs two --from-dir directories (or none: the bench writes two)")
    sims: list[SimServer] = []
    real: list[VllmEngine] = []
    try:  # every engine this bench started is stopped however it ends
        if args.vllm_model:
            real = start_vllm(args.vllm_model, args.model, args.engines)
            urls = [e.url for e in real]
        elif args.engine_url:
            urls = args.engine_url
        else:
            for i in range(args.engines):
                s = SimServer(SimConfig(speed=20.0, model_name=args.model), index=i)
                await s.start()
                sims.append(s)
            urls = [s.url for s in sims]
        await measure(urls, args, "simulated" if sims else "real")
    finally:
        for s in sims:
            await s.stop()
        for e in real:
            e.stop()


def start_vllm(model_dir: str, name: str, n: int) -> list[VllmEngine]:
    logs = tempfile.mkdtemp(prefix="refit-cycle-")
    cpus = sorted(os.sched_getaffinity(0))
    engines = []
    for i in range(n):
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpus[i % len(cpus)])
        spec = EngineSpec(
            model=model_dir,
            served_name=name,
            extra_args=["--max-model-len", "4096"],
            env=env,
            log_path=f"{logs}/engine{i}.log",
            startup_timeout_s=900,
        )
        engines.append(VllmEngine(spec, python=os.environ["RL_LAUNCH_VLLM_PYTHON"]))
    t0 = time.monotonic()
    start_all(engines, 900)
    print(f"{n} vLLM engines ready in {time.monotonic() - t0:.0f} s (logs {logs})")
    return engines


def write_checkpoints(mb: float) -> list[str]:
    """Two checkpoint directories of one ``mb``-sized float32 tensor each (different bytes)."""
    root = tempfile.mkdtemp(prefix="refit-checkpoints-")
    floats = max(1, int(mb * 1024 * 1024) // 4)
    return [write_checkpoint(os.path.join(root, tag), tag.encode(), floats) for tag in ("a", "b")]


def checkpoint_cycles(client: FleetClient, n: int, dirs: list[str]) -> list[dict[str, float]]:
    out = []
    for i in range(n):
        time.sleep(0.5)  # let load build up between refits
        t0 = time.perf_counter()
        txn = client.load_weights(dirs[i % 2], f"bench-{i}")
        took = time.perf_counter() - t0
        steps = {s["phase"]: s["took_s"] for s in txn["steps"]}
        out.append(
            {
                "refit_s": took,
                "load_s": steps["loading"],
                "overhead_s": took - steps["loading"],
                "verify_s": steps["verifying"],
                "pause_s": steps["pausing"],
                "held": txn["held"]["released"],
                "longest_wait_s": txn["held"]["longest_wait_s"],
                "quarantined": len(txn["quarantined"]),
            }
        )
    return out


async def measure(urls: list[str], args: argparse.Namespace, kind: str) -> None:
    router = GenerationRouter(
        RouterConfig(host="127.0.0.1", port=0, admin_token=TOKEN, policy="round_robin", probe_interval_s=0),
        urls,
    )
    router.serve_in_background()
    stop = asyncio.Event()
    counts: dict[str, int] = {}
    load_task = asyncio.create_task(load(router.base_url(), args.model, args.clients, stop, counts))
    try:
        client = FleetClient(router.base_url(), TOKEN)
        if args.checkpoint:
            result = await asyncio.to_thread(checkpoint_cycles, client, args.cycles, args.from_dir)
        else:
            result = await asyncio.to_thread(cycles, client, args.cycles, args.hold)
    finally:
        stop.set()
        await asyncio.wait_for(load_task, 120)
        router.stop()
    what = f"refit from {args.from_dir}" if args.checkpoint else f"hold {args.hold:g} s"
    print(
        f"{len(urls)} engines ({kind}), {args.clients} clients, {what}, {args.cycles} cycles; "
        f"answers by status: {counts}"
    )
    for k in result[0]:
        vals = [r[k] for r in result]
        print(f"  {k:18} median {statistics.median(vals):8.4f}  max {max(vals):8.4f}")


if __name__ == "__main__":
    asyncio.run(main())
