"""Virtual-time replay: the simulator's schedulers, the router's policies and a Gym-like client on one
virtual clock, with no sockets and no sleeping.

Why it exists: on a 2-core machine the HTTP replay (``rl-launch bench replay``) of a longtail step takes a
minute per arm and its time-to-90% moves ~10% from run to run (CPU contention between the client, the
router and the engines), which is as large as the effects a routing policy is judged on. Here the very
objects that decide in production — ``SimConfig``/``Scheduler`` (the engine's cost model) and the
``router.policies`` classes — run against the same trace on an event loop whose clock jumps to the next
timer instead of waiting for it. A full-scale step runs in seconds of CPU and the same inputs give the
same figures every time, so a policy change can be measured, not guessed. What it leaves out (HTTP,
proxy overhead, CPU starvation) is exactly what the HTTP replay keeps: use this one to explore, the HTTP
one to confirm.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import random
import selectors
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from launcher.bench.arms import DIRECT
from launcher.bench.client import gym_chat_payload, gym_pin
from launcher.bench.report import load_stats, time_to_fraction
from launcher.bench.trace import Session, Trace, session_work
from launcher.bench.workload import generate
from launcher.engines.sim.config import SimConfig
from launcher.engines.sim.protocol import parse_generation, plan_output
from launcher.engines.sim.scheduler import ReqState, Scheduler, SimRequest
from launcher.engines.sim.tokens import TOKEN_BYTES
from router.policies import LoadTracker, RouteRequest, make_policy

CHAT_PATH = "/v1/chat/completions"
ORACLE = "oracle"
"""Not a router policy: sessions pinned, before the step starts, to balance the work each will bring
(longest first onto the least loaded engine), which only a replay that has read the whole trace can
know. Its figures are a yardstick for sticky placement, not a target any router can be held to."""


def oracle_placement(trace: Trace, n_engines: int, turns: int | None = None) -> dict[str, int]:
    """Engine index per session by LPT over each session's work (its first ``turns`` turns if given)."""

    work = {
        s.id: session_work(trace, s if turns is None else dataclasses.replace(s, turns=s.turns[:turns]))
        for s in trace.sessions
    }
    heap = [(0, i) for i in range(n_engines)]
    out: dict[str, int] = {}
    for sid in sorted(work, key=work.__getitem__, reverse=True):
        total, i = heapq.heappop(heap)
        out[sid] = i
        heapq.heappush(heap, (total + work[sid], i))
    return out


class _JumpingSelector(selectors.DefaultSelector):
    """Polls real file descriptors without blocking, and instead of waiting advances the loop's clock
    by the timeout asyncio asked for (the time until its next timer)."""

    def __init__(self, loop_clock: list[float]) -> None:
        super().__init__()
        self._clock = loop_clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = super().select(0)
        if events or timeout == 0:
            return events
        if timeout is None:
            raise RuntimeError("virtual-time loop has nothing scheduled: every task waits on nothing")
        self._clock[0] += timeout
        return events


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` is virtual: ``asyncio.sleep(5)`` returns at once, 5 s later."""

    def __init__(self) -> None:
        self._virtual_now = [0.0]
        super().__init__(selector=_JumpingSelector(self._virtual_now))

    def time(self) -> float:
        return self._virtual_now[0]


@dataclass
class VirtualArmResult:
    """One arm's outcome; ``row()`` gives the HTTP replay's keys plus ``moves``, ``preemptions`` and the
    policy's decision counts."""

    arm: str
    wall_s: float
    session_done: dict[str, float]
    engine_requests: list[int]
    hit_rate: float
    moves: int
    preemptions: int
    decisions: dict[str, float] = field(default_factory=dict)

    def row(self, n_sessions: int) -> dict[str, Any]:
        done = list(self.session_done.values())
        cv, spread = load_stats(self.engine_requests)

        def t(q: float) -> float | None:
            x = time_to_fraction(done, n_sessions, q)
            return None if x is None else round(x, 3)

        return {
            "arm": self.arm,
            "wall_s": round(self.wall_s, 3),
            "t50_s": t(0.5),
            "t90_s": t(0.9),
            "t100_s": t(1.0),
            "hit_rate": round(self.hit_rate, 4),
            "engine_requests": self.engine_requests,
            "load_cv": None if cv is None else round(cv, 4),
            "load_spread": None if spread is None else round(spread, 3),
            "moves": self.moves,
            "preemptions": self.preemptions,
            "errors": n_sessions - len(done),
            "decisions": self.decisions,
        }


async def _replay(
    trace: Trace,
    arm: str,
    n_engines: int,
    config: SimConfig,
    policy_options: Mapping[str, Any],
    on_decision: Callable[[str, int, str], None] | None,
    seed: int = 0,
) -> VirtualArmResult:
    urls = [f"http://engine-{i}:8000" for i in range(n_engines)]
    schedulers = {u: Scheduler(config) for u in urls}
    for s in schedulers.values():
        s.start()
    pinned: dict[str, int] | None = None
    policy = None
    if arm == ORACLE:
        pinned = oracle_placement(trace, n_engines, policy_options.get("turns"))
    elif arm != DIRECT:
        policy = make_policy(arm, **dict(policy_options))
    load = LoadTracker(urls, rng=random.Random(seed))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    session_done: dict[str, float] = {}
    last_engine: dict[str, str] = {}
    moves = 0

    async def session(s: Session) -> None:
        nonlocal moves
        if s.start_s > 0:  # a recorded step's arrivals and tool times, on the virtual clock
            await asyncio.sleep(s.start_s)
        messages: list[dict[str, str]] = [
            {"role": "system", "content": trace.system_prompt(s)},
            {"role": "user", "content": s.task},
        ]
        for k, turn in enumerate(s.turns):
            if k > 0 and turn.gap_s > 0:
                await asyncio.sleep(turn.gap_s)
            if k > 0:
                messages.append({"role": "user", "content": turn.tool_output})
            body = orjson.dumps(gym_chat_payload(config.model_name, messages, turn.max_tokens))
            if pinned is not None:
                url = urls[pinned[s.id]]
            elif policy is None:
                url = urls[gym_pin(s.id, n_engines)]
            else:
                request = policy.prepare(RouteRequest(CHAT_PATH, body, {}))
                url = policy.choose(request, load)
                policy.commit(request, url)  # the simulated fleet never fails: nothing to retract
            if k > 0 and last_engine.get(s.id) != url:
                moves += 1
            last_engine[s.id] = url
            if on_decision is not None:
                on_decision(s.id, k, url)
            params = parse_generation("chat", orjson.loads(body), config)
            out = plan_output(params, config)
            prompt = params.prompt
            req = SimRequest(
                f"{s.id}-{k}", prompt + out.tokens, len(prompt), len(out.tokens), out.finish_reason
            )
            load.acquire(url, len(body))
            schedulers[url].submit(req)
            try:
                await req.done
            finally:
                load.release(url, len(body))
            if req.state != ReqState.FINISHED:
                raise RuntimeError(f"session {s.id} turn {k}: request aborted")
            messages.append({"role": "assistant", "content": out.text[: req.n_gen * TOKEN_BYTES]})
        session_done[s.id] = loop.time() - t0

    await asyncio.gather(*(session(s) for s in trace.sessions))
    wall = loop.time() - t0
    for s in schedulers.values():
        await s.close()
    queries = sum(s.stats.prefix_cache_queries for s in schedulers.values())
    hits = sum(s.stats.prefix_cache_hits for s in schedulers.values())
    return VirtualArmResult(
        arm=arm,
        wall_s=wall,
        session_done=session_done,
        engine_requests=[sum(schedulers[u].stats.success.values()) for u in urls],
        hit_rate=hits / queries if queries else 0.0,
        moves=moves,
        preemptions=sum(s.stats.preemptions for s in schedulers.values()),
        decisions=policy.stats() if policy is not None else {},
    )


def run_virtual_arm(
    trace: Trace,
    arm: str,
    n_engines: int = 8,
    config: SimConfig | None = None,
    policy_options: Mapping[str, Any] | None = None,
    on_decision: Callable[[str, int, str], None] | None = None,
    seed: int = 0,
) -> VirtualArmResult:
    """Replay ``trace`` on ``n_engines`` fresh simulated engines in virtual time; ``arm`` is ``direct``
    (Gym's session pin) or a policy name. Same trace, config, options and ``seed`` (the router's
    tie-breaking), same result. ``on_decision(session, turn, engine)`` sees every placement."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(
            _replay(trace, arm, n_engines, config or SimConfig(), policy_options or {}, on_decision, seed)
        )
    finally:
        loop.close()


def compare_virtual(
    trace: Trace,
    arms: Sequence[str],
    n_engines: int = 8,
    config: SimConfig | None = None,
    policy_options: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One row per arm, every arm on fresh engines; ``policy_options`` go to every policy arm."""
    n = len(trace.sessions)
    return [
        run_virtual_arm(
            trace, arm, n_engines, config, {} if arm == DIRECT else policy_options, seed=seed
        ).row(n)
        for arm in arms
    ]


def mean_rows(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The mean of one arm's rows over several traces, with the worst CV (a target is per run)."""

    def mean(key: str) -> float | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return round(statistics.fmean(vals), 4) if vals else None

    cvs = [r["load_cv"] for r in rows if r.get("load_cv") is not None]
    out: dict[str, Any] = {"arm": rows[0]["arm"], "runs": len(rows)}
    for key in ("wall_s", "t50_s", "t90_s", "t100_s", "hit_rate", "load_cv", "moves", "errors"):
        out[key] = mean(key)
    out["load_cv_max"] = max(cvs) if cvs else None
    return out


def compare_virtual_seeds(
    trace_args: Mapping[str, Any],
    seeds: Sequence[int],
    arms: Sequence[str],
    n_engines: int,
    config: SimConfig,
    policy_options: Mapping[str, Any],
    on_row: Callable[[dict[str, Any]], None] = lambda row: None,
) -> dict[str, list[dict[str, Any]]]:
    """``compare_virtual`` on the trace of each seed (``trace_args``: ``generate``'s other arguments),
    each row tagged with its ``seed`` and passed to ``on_row`` as it comes; the rows by arm."""
    per_arm: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    for s in seeds:
        trace = generate(seed=s, **trace_args)
        for row in compare_virtual(trace, arms, n_engines, config, policy_options):
            row["seed"] = s
            per_arm[row["arm"]].append(row)
            on_row(row)
    return per_arm


def seed_line(row: Mapping[str, Any]) -> str:
    """One arm on one seed's trace, as ``rl-launch bench virtual`` prints it."""
    return (
        f"seed {row['seed']:<3} {row['arm']:<18} wall {row['wall_s']:8.2f}  t90 {row['t90_s'] or 0:7.2f}  "
        f"hit {row['hit_rate']:.4f}  cv {row['load_cv'] or 0:.3f}  moves {row['moves']:4}  "
        f"errors {row['errors']}"
    )


def mean_lines(means: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each arm's means (``mean_rows``), with its margin over the direct arm when there is one."""
    base = next((m for m in means if m["arm"] == DIRECT), None)
    lines = []
    for m in means:
        margin = ""
        if base is not None and m is not base and base["t90_s"] and m["t90_s"] and base["wall_s"]:
            t90 = 100 * (m["t90_s"] / base["t90_s"] - 1)
            wall = 100 * (m["wall_s"] / base["wall_s"] - 1)
            hit = 100 * (m["hit_rate"] - base["hit_rate"])
            margin = f"  vs direct: t90 {t90:+.1f}%  wall {wall:+.1f}%  hit {hit:+.2f} pt"
        lines.append(
            f"  {m['arm']:<18} wall {m['wall_s']:8.2f}  t90 {m['t90_s'] or 0:7.2f}  hit {m['hit_rate']:.4f}  "
            f"cv {m['load_cv'] or 0:.3f} (max {m['load_cv_max'] or 0:.3f})  moves {m['moves']:.1f}{margin}"
        )
    return lines
