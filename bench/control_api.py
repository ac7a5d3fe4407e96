"""What a refit through the router's control URL costs against the same calls sent straight to one engine.

A trainer written for one vLLM (NeMo-RL's ``remote_vllm``) refits with ``/pause``, ``/collective_rpc
reload_weights``, ``/resume``. Pointed at rl-launch's control URL, the same three calls become the
fleet's transaction (the checkpoint's check, a canary, every engine, verify, stamp). This bench sends
NeMo-RL's exact calls (``tests/support/trainer_replays.py``) both ways, alternating between two
checkpoint directories so every round really changes the weights, and prints each call's median time
and the ratio control / straight.

What to expect: the fleet's reload is the canary's reload and then the other engines' (in parallel), so
with a reload time R it takes about 2R against one engine's R, plus the checkpoint check (every header
read) and the verify (each engine's checksum); pause and resume add the gate and one call per engine.

Engines: simulated (launcher/engines/sim: vLLM's RL and dev routes, a reload that reads and hashes the
checkpoint's safetensors; ``--reload-ms`` adds the load time of a real model): ``--engines`` behind the
router, and one more, alone, for the straight calls. Bounded: ``--rounds`` refits each way, each call at
most 600 s.

    .venv/bin/python bench/control_api.py --engines 2 --rounds 10
    .venv/bin/python bench/control_api.py --engines 4 --rounds 10 --checkpoint-mb 64 --reload-ms 200
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launcher.engines.sim.checkpoint import write_checkpoint
from launcher.engines.sim.config import SimConfig
from launcher.engines.sim.server import SimServer
from launcher.fleet.client import FleetClient
from router import GenerationRouter
from router.config import RouterConfig
from tests.support.trainer_replays import NemoRlRemoteVllm

TOKEN = "bench-control-token"
MODEL = "sim"
PHASES = ("pause", "reload_weights", "resume")


def write_checkpoints(mb: float) -> list[str]:
    """Two checkpoint directories of one ``mb``-sized float32 tensor each (different bytes)."""
    root = tempfile.mkdtemp(prefix="control-api-checkpoints-")
    floats = max(1, int(mb * 1024 * 1024) // 4)
    return [write_checkpoint(os.path.join(root, tag), tag.encode(), floats) for tag in ("a", "b")]


def one_refit(nemo: NemoRlRemoteVllm, directory: str) -> dict[str, float]:
    """One NeMo-RL refit to ``directory``: each call's time and the whole refit's."""
    t0 = time.perf_counter()
    calls = nemo.refit(directory)
    row = {phase: call.seconds for phase, call in zip(PHASES, calls, strict=True)}
    row["refit"] = time.perf_counter() - t0
    return row


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=2, help="engines behind the router")
    p.add_argument("--rounds", type=int, default=10, help="refits each way")
    p.add_argument("--checkpoint-mb", type=float, default=8.0, help="size of each checkpoint")
    p.add_argument("--reload-ms", type=float, default=0.0, help="each engine's load time beyond reading")
    args = p.parse_args()
    if args.engines < 1 or not 1 <= args.rounds <= 1000:
        p.error("--engines must be >= 1 and --rounds in 1..1000")
    dirs = write_checkpoints(args.checkpoint_mb)
    # Every engine starts on checkpoint a, as a launched fleet starts on its model: the router's check
    # compares a checkpoint's tensors with the served model's.
    config = {"model_name": MODEL, "model_path": dirs[0], "reload_delay_s": args.reload_ms / 1000}
    sims = [SimServer(SimConfig(**config), index=i) for i in range(args.engines + 1)]
    router: GenerationRouter | None = None
    try:
        for s in sims:
            await s.start()
        fleet, alone = sims[:-1], sims[-1]
        router = GenerationRouter(
            RouterConfig(host="127.0.0.1", port=0, admin_token=TOKEN, probe_interval_s=0),
            [s.url for s in fleet],
        )
        router.serve_in_background()
        url = router.base_url()
        # As a NeMo-RL user configures it: the control URL is the router's origin, default paths.
        through = NemoRlRemoteVllm(url + "/v1", MODEL, TOKEN, control_base_url=url)
        straight = NemoRlRemoteVllm(alone.url + "/v1", MODEL, None)
        await asyncio.to_thread(through.preflight)
        await asyncio.to_thread(straight.preflight)
        # Interleaved (one refit each way, then the next round) so both see the same machine load; the
        # engines start on a, so round 0 moves to b, round 1 back to a, and so on.
        via, direct, steps = [], [], []
        fleet_client = FleetClient(url, TOKEN)
        for i in range(args.rounds):
            target = dirs[(i + 1) % 2]
            via.append(await asyncio.to_thread(one_refit, through, target))
            direct.append(await asyncio.to_thread(one_refit, straight, target))
            last = (await asyncio.to_thread(fleet_client.refit_state))["last"]
            steps.append({s["phase"]: s["took_s"] for s in last["steps"]})
    finally:
        if router is not None:
            router.stop()
        for s in sims:
            await s.stop()
    m_via, m_direct = medians(via), medians(direct)
    print(
        f"NeMo-RL refit (pause, collective_rpc reload_weights, resume), {args.rounds} rounds each way, "
        f"simulated engines, checkpoints of {args.checkpoint_mb:g} MB, reload +{args.reload_ms:g} ms:"
    )
    via_label = f"control URL ({args.engines} engines)"
    print(f"  {'call':16} {via_label:>24} {'one engine':>12} {'ratio':>7}")
    for k in (*PHASES, "refit"):
        ratio = m_via[k] / m_direct[k] if m_direct[k] > 0 else float("inf")
        print(f"  {k:16} {m_via[k] * 1000:21.1f} ms {m_direct[k] * 1000:9.1f} ms {ratio:6.2f}x")
    phases = {k: statistics.median(r.get(k, 0.0) for r in steps) for k in steps[0]}
    print("  the router's transaction, median per step (GET /fleet/refit):")
    print("    " + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in phases.items()))
    worst = max(r["refit"] for r in via), max(r["refit"] for r in direct)
    print(f"  slowest refit: control URL {worst[0] * 1000:.1f} ms, one engine {worst[1] * 1000:.1f} ms")


if __name__ == "__main__":
    asyncio.run(main())
