"""Another local user's keyless connection flood against a standing fleet's router, and a consumer meanwhile.

Not a test: it prints figures (issue 38, finding 4). A router on 127.0.0.1 in front of two simulated
engines, with a consumers file of one consumer; a second Unix user (``tests.support.other_user``, made if
needed: run as root) holds as many idle keep-alive ``GET /health`` connections as it can, with no key
(``tests.support.keyless_flood``), while the consumer sends a generation request every 0.2 s, each on a
new connection. Printed: the connections the flood kept alive each round, the consumer's statuses and
latencies, and the router's error counts by kind (``keyless_evicted``, ``connection_cap``).

    python bench/keyless_flood.py [--cap 1024] [--workers 1 2] [--flood 2048] [--seconds 8]

``--flood 0`` measures the consumer alone. Before issue 38 the flood held the whole cap and every new
consumer connection was closed at accept; with the keyless pool it keeps 5 % of each process's cap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.engines.sim.config import SimConfig
from launcher.engines.sim.server import SimServer
from router import GenerationRouter
from router.config import RouterConfig
from router.consumers import add_consumer, new_key
from router.prometheus import metric_by_label, parse_metrics
from tests.support.keyless_flood import start_flood
from tests.support.other_user import other_user


async def consumer_request(base: str, key: str) -> tuple[str, float]:
    t0 = time.monotonic()
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=10)
        ) as s:
            body = {"model": "sim", "prompt": "hello", "max_tokens": 2}
            async with s.post(
                base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            ) as r:
                await r.read()
                status = str(r.status)
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        status = type(exc).__name__
    return status, time.monotonic() - t0


async def arm(cap: int, workers: int, flood_n: int, seconds: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        key = new_key()
        add_consumer(Path(tmp) / "consumers.json", "C", key)
        sims = [SimServer(SimConfig(speed=20.0), index=i) for i in range(2)]
        for sim in sims:
            await sim.start()
        config = RouterConfig(
            host="127.0.0.1",
            port=0,
            policy="round_robin",
            probe_interval_s=0,
            api_key=new_key(),
            admin_token=new_key(),
            workers=workers,
            consumers_file=str(Path(tmp) / "consumers.json"),
            http={"max_client_connections": cap},
        )
        router = GenerationRouter(config, [sim.url + "/v1" for sim in sims])
        router.serve_in_background()
        try:
            base = router.base_url()
            flood = await start_flood(
                other_user(), router.port, flood_n, seconds + 4, open_files=2 * flood_n + 64
            )
            assert flood.stdout is not None
            first = json.loads(await asyncio.wait_for(flood.stdout.readline(), 60))
            answers: list[tuple[str, float]] = []
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                answers.append(await consumer_request(base, key))
                await asyncio.sleep(0.2)
            out, err = await asyncio.wait_for(flood.communicate(), 60)
            rounds = [first] + [json.loads(line) for line in out.decode().splitlines() if line.strip()]
            async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
                text = await r.text()
            kinds = metric_by_label(parse_metrics(text), "rl_router_errors_total", "kind")
        finally:
            router.stop()
            for sim in sims:
                await sim.stop()
    statuses = [s for s, _ in answers]
    latencies = sorted(t for _, t in answers)
    counts = ", ".join(f"{s} {statuses.count(s)}" for s in sorted(set(statuses)))
    print(f"cap {cap}, {workers} worker(s), flood of {flood_n}:")
    print(f"  flood kept alive per round: {[x['held'] for x in rounds]}")
    print(
        f"  consumer: {len(answers)} requests ({counts}), latency median "
        f"{statistics.median(latencies) * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms"
    )
    print(f"  router errors by kind: {dict(sorted(kinds.items())) or '{}'}")
    if err.strip():
        print(f"  flood stderr: {err.decode().strip()[-300:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cap", type=int, default=1024, help="router.http.max_client_connections")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--flood", type=int, default=2048, help="connections the other user tries to hold")
    ap.add_argument("--seconds", type=float, default=8.0, help="how long the consumer sends (bounded)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/keyless_flood.py: run as root (it makes and runs as a second Unix user)")
    for workers in args.workers:
        asyncio.run(arm(args.cap, workers, args.flood, args.seconds))


if __name__ == "__main__":
    main()
