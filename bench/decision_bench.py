"""What one routing decision costs, in one process and across processes (router workers -> parent).

With ``--workers N`` a worker hashes the prompt (``Policy.prepare``) and asks the parent, over a Unix socket,
for the decision (``router.multiprocess.decisions``). This prints CPU time (on a shared machine wall time
measures the neighbours), at 1,024 backends and a 20 KB Gym-shaped chat body (a growing conversation, ~256
requests in flight):

* ``hash``: ``prepare`` alone (the worker's share);
* ``in-process``: prepare + choose + commit + acquire + release, as ``--workers 1`` does per request;
* ``cross-process, one at a time``: prepare here, the decision in a child process, release sent back:
  the latency a request pays;
* ``cross-process, 64 concurrent``: the same with 64 requests outstanding (the parent batches frames): the
  parent's throughput, and the parent's CPU per decision read from /proc.

    python bench/decision_bench.py [--backends 1024] [--body-kb 20] [--n 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402

from router.multiprocess.decisions import DecisionService  # noqa: E402
from router.multiprocess.remote import RemoteRouting  # noqa: E402
from router.policies import LoadTracker, RouteRequest, make_policy  # noqa: E402
from router.state.backends import BackendSet  # noqa: E402
from router.state.metrics import RouterMetrics  # noqa: E402
from router.state.routing import LocalRouting  # noqa: E402

IN_FLIGHT = 256


def backends(n: int) -> list[str]:
    return [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(n)]


def bodies(body_kb: int, sessions: int = 512) -> list[bytes]:
    """Gym-shaped chat bodies of about ``body_kb`` KB: a shared system prompt, then per session a task
    and turns of assistant reply + tool output."""
    system = "You are a coding agent with tools: bash, edit, search, test. " * 40
    out = []
    for i in range(sessions):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"task {i}"}]
        t = 0
        while len(orjson.dumps(messages)) < body_kb * 1024:
            messages.append({"role": "assistant", "content": f"turn {t} of {i}: " + "I will run it. " * 40})
            messages.append({"role": "user", "content": "FAILED test_x.py::test_y assert 1 == 2 " * 15})
            t += 1
        out.append(orjson.dumps({"model": "m", "messages": messages, "logprobs": True}))
    return out


def local_routing(n_backends: int) -> LocalRouting:
    policy = make_policy("cache_aware")
    state = BackendSet(policy, LoadTracker())
    state.replace(backends(n_backends))
    return LocalRouting(state, policy, RouterMetrics(state, policy.name), health_managed=False)


def bench_in_process(n_backends: int, data: list[bytes], n: int) -> tuple[float, float]:
    routing = local_routing(n_backends)
    policy = routing.policy
    reqs = [RouteRequest("/v1/chat/completions", data[i % len(data)]) for i in range(n)]
    # CPU time, not wall time: on a shared machine the wall clock measures the neighbours.
    t0 = time.process_time()
    for r in reqs:
        policy.prepare(r)
    hash_us = (time.process_time() - t0) / n * 1e6
    inflight: list[tuple[str, int]] = []
    t0 = time.process_time()
    for r in reqs:
        prepared = policy.prepare(r)
        url = routing.dispatch_now(prepared, frozenset())
        inflight.append((url, prepared.size))
        if len(inflight) > IN_FLIGHT:
            routing.release(*inflight.pop(0))
    return hash_us, (time.process_time() - t0) / n * 1e6


def serve(path: str, n_backends: int) -> None:
    """The child: the routing state behind a decision socket, as the router's parent runs it."""

    async def main() -> None:
        service = DecisionService(local_routing(n_backends))
        server = await asyncio.get_running_loop().create_unix_server(service.channel, path)
        print("ready", flush=True)
        async with server:
            await server.serve_forever()

    import uvloop

    uvloop.run(main())


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def bench_cross_process(
    path: str, child_pid: int, data: list[bytes], n: int, concurrency: int
) -> tuple[float, float]:
    policy = make_policy("cache_aware")
    loop = asyncio.get_running_loop()
    _, routing = await loop.create_unix_connection(lambda: RemoteRouting(policy, lambda: None, list), path)
    reqs = [RouteRequest("/v1/chat/completions", data[i % len(data)]) for i in range(n)]
    held: list[tuple[str, int]] = []
    next_i = 0

    async def client() -> None:
        nonlocal next_i
        while next_i < n:
            r = reqs[next_i]
            next_i += 1
            prepared = policy.prepare(r)
            url = (await routing.dispatch(prepared, frozenset())).url
            held.append((url, prepared.size))
            if len(held) > IN_FLIGHT:
                routing.release(*held.pop(0))

    cpu0 = cpu_seconds(child_pid)
    t0, own0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall, own = time.perf_counter() - t0, time.process_time() - own0
    await asyncio.sleep(0.2)  # the last releases reach the parent
    parent_cpu = cpu_seconds(child_pid) - cpu0
    assert routing.transport is not None
    routing.transport.close()
    return wall / n * 1e6, own / n * 1e6, parent_cpu / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", type=int, default=1024)
    ap.add_argument("--body-kb", type=int, default=20)
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.backends)
        return
    data = bodies(args.body_kb)
    mean_kb = sum(map(len, data)) / len(data) / 1024
    hash_us, local_us = bench_in_process(args.backends, data, args.n)
    print(f"{args.backends} backends, {mean_kb:.1f} KB bodies, cache_aware, ~{IN_FLIGHT} in flight")
    print(f"  hash (prepare) alone:                    CPU {hash_us:6.1f} us/request")
    print(f"  in-process decision incl. hashing:       CPU {local_us:6.1f} us/request")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "decisions.sock")
        child = subprocess.Popen(
            [sys.executable, __file__, "--serve", path, "--backends", str(args.backends)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            import uvloop

            for concurrency in (1, 64):
                wall, own, parent = uvloop.run(
                    bench_cross_process(path, child.pid, data, args.n, concurrency)
                )
                label = "one at a time" if concurrency == 1 else f"{concurrency} concurrent"
                print(
                    f"  cross-process, {label:<14}: worker CPU {own:6.1f} us/request (incl. hashing),"
                    f" parent CPU {parent:5.1f} us/decision, wall {wall:6.1f} us/request"
                )
        finally:
            child.terminate()
            child.wait()


if __name__ == "__main__":
    main()
