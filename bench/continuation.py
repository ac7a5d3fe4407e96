"""Tokens regenerated per killed engine: the router's retry from scratch against continuation (issue 41).

An engine killed (SIGKILL) in the middle of a batch of long generations loses what it produced. Before
issue 41 (``continuation_max_moves: 0``) the router retried each of its requests once, from the first
token, on another engine: every token the dead engine had made is made again. With continuation (the
default, 3 moves) each request goes on from the prompt's token ids plus the tokens the router had read.

Two simulated engines (each its own process, ``launcher.engines.sim``), a real router on 127.0.0.1,
``--requests`` whole (non-streamed) completions of ``--max-tokens`` tokens each, all started on engine A
(the serving set is A alone until they run there); once A has made ``--kill-at`` of the batch's tokens,
A's token counter is read and A is killed with SIGKILL. Then every answer is awaited (bounded by
``--timeout``) and engine B's counter read. Printed per arm and round: tokens A made, tokens B made, tokens
delivered (the answers' ``completion_tokens``), **regenerated** = made - delivered (made twice, or made by
A after the read and lost with it), answers whole, and the batch's wall clock.

    .venv/bin/python bench/continuation.py [--requests 8] [--max-tokens 1500] [--kill-at 0.5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from launcher.engines.base import EngineSpec
from launcher.engines.sim import SimEngine
from router import GenerationRouter, RouterConfig

GENERATED = "vllm:generation_tokens_total"


def generated(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(GENERATED))


def complete(url: str, i: int, max_tokens: int, timeout_s: float) -> dict[str, Any]:
    body = {
        "model": "sim",
        "prompt": f"request {i}: a long story",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            answer = json.loads(r.read())
            return {"status": r.status, "tokens": int(answer["usage"]["completion_tokens"])}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "tokens": 0}
    except OSError as exc:
        return {"status": None, "tokens": 0, "error": repr(exc)}


def until(check: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def one_round(moves: int, args: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    engines = []
    router = None
    try:
        for name in ("a", "b"):
            spec = EngineSpec(model="sim", log_path=str(logdir / f"sim-{name}.log"), startup_timeout_s=60)
            engine = SimEngine(spec)
            engine.start_and_wait()
            engines.append(engine)
        a, b = engines
        router = GenerationRouter(
            RouterConfig(host="127.0.0.1", port=0, insecure_admin=True, continuation_max_moves=moves),
            [a.url, b.url],
        )
        router.serve_in_background()
        url = router.base_url()
        a0, b0 = generated(a.url), generated(b.url)
        answers: list[dict[str, Any]] = [{} for _ in range(args.requests)]

        def run(i: int) -> None:
            answers[i] = complete(url, i, args.max_tokens, args.timeout)

        router.set_serving_backends([a.url])
        t0 = time.monotonic()
        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(args.requests)]
        for t in threads:
            t.start()
        try:
            if not until(lambda: router.in_flight().get(a.url, 0) == args.requests, 30):
                raise RuntimeError(f"the requests did not all start on A: {router.in_flight()}")
        finally:
            router.set_serving_backends([a.url, b.url])
        target = a0 + args.kill_at * args.requests * args.max_tokens
        if not until(lambda: generated(a.url) >= target, args.timeout):
            raise RuntimeError("engine A did not reach the kill point in time")
        a_made = generated(a.url) - a0
        assert a.pid is not None
        os.killpg(a.pid, signal.SIGKILL)
        for t in threads:
            t.join(max(0.0, t0 + args.timeout - time.monotonic()))
        wall = time.monotonic() - t0
        time.sleep(0.2)
        b_made = generated(b.url) - b0
        delivered = sum(x.get("tokens", 0) for x in answers)
        whole = sum(x.get("status") == 200 and x.get("tokens") == args.max_tokens for x in answers)
        return {
            "a_made": a_made,
            "b_made": b_made,
            "delivered": delivered,
            "regenerated": a_made + b_made - delivered,
            "whole": whole,
            "wall_s": wall,
        }
    finally:
        if router is not None:
            router.stop()
        for e in engines:
            e.stop(grace_s=5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=1500)
    p.add_argument("--kill-at", type=float, default=0.5, help="fraction of the batch's tokens A makes first")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=120.0, help="bound on each batch, seconds")
    args = p.parse_args()
    if not (0 < args.kill_at < 1) or args.requests < 1 or args.max_tokens < 2 or args.rounds < 1:
        p.error("--kill-at in (0, 1), --requests >= 1, --max-tokens >= 2, --rounds >= 1")
    print(
        f"{args.requests} requests x {args.max_tokens} tokens on engine A, SIGKILL after "
        f"{args.kill_at:.0%} of the batch's tokens; {args.rounds} round(s) per arm"
    )
    print("| arm | round | A made | B made | delivered | regenerated | whole answers | wall |")
    print("|---|---|---|---|---|---|---|---|")
    summary: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-continuation-") as tmp:
        for moves in (0, 3):
            arm = f"continuation_max_moves {moves}" + (" (before)" if moves == 0 else "")
            for r in range(args.rounds):
                got = one_round(moves, args, Path(tmp))
                summary.setdefault(arm, []).append(got["regenerated"])
                print(
                    f"| {arm} | {r + 1} | {got['a_made']:.0f} | {got['b_made']:.0f} | {got['delivered']} | "
                    f"{got['regenerated']:.0f} | {got['whole']}/{args.requests} | {got['wall_s']:.1f} s |"
                )
    for arm, values in summary.items():
        print(f"{arm}: tokens regenerated per killed engine, mean {statistics.fmean(values):.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
