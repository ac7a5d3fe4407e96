"""The elastic tail policy on a virtual clock: node-seconds given back against wall clock, with the drain
waiting for the requests in flight (before issue 41) or moving them (continuation, after).

Why it exists: the real measurement (``bench/elastic_tail.py`` without ``--virtual``) is two or three
whole jobs on the local Slurm cluster, minutes each, and its wall clock moves a few % from run to run on
a shared machine, which is the size of the effect (the target is <= +1% wall clock). Here the very
objects that decide in production run on ``launcher.bench.virtual``'s clock that jumps to the next
timer: the simulator's ``Scheduler`` (the engine's cost model; greedy decoding that continues exactly,
``launcher.engines.sim.decoding``), the router's policy, the longtail trace, and the driver's
``TailPolicy`` read every ``READ_EVERY_S`` with in-flight counts of the serving engines, as the elastic
manager reads them. A shrink is modelled as the manager runs it: the node's engines leave the routing set
at the controller's next push (``PUSH_DELAY_S`` after the decision), and the node goes back once its
engines read zero in flight ``ZERO_READS_TO_DRAIN`` times over ``QUIET_S``, polled every
``DRAIN_POLL_S`` (or at ``drain_timeout_s``). With ``move`` the requests in flight on it are moved at the
decision and again at the push (``Gateway.move_off``, then the push without it): each is aborted there
and resumed on a serving engine from its prompt plus the tokens it produced (``max_tokens`` less them),
re-prefilled wherever that engine's prefix cache misses, as the router's continuation does.

What it leaves out: HTTP and the router's own time, a tick's phase against the decision (the push delay
is its mean), Slurm's time to take a node back (the node-seconds stop at the release). Same arguments
and the same ``PYTHONHASHSEED``, same figures: the policy's prefix index hashes bytes, and another hash
seed breaks placement ties otherwise, which moved one arm's wall clock by ~1% (``bench/elastic_tail.py
--virtual`` runs with 0).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from launcher.bench.client import gym_chat_payload
from launcher.bench.trace import Session, Trace
from launcher.bench.virtual import CHAT_PATH, VirtualClockLoop
from launcher.engines.sim.config import SimConfig
from launcher.engines.sim.protocol import PlannedOutput, parse_generation, plan_output
from launcher.engines.sim.scheduler import Scheduler, SimRequest
from launcher.fleet.elastic.drain import DRAIN_POLL_S, QUIET_S, ZERO_READS_TO_DRAIN
from launcher.fleet.elastic.manager import READ_EVERY_S
from launcher.fleet.elastic.tail import Reading, TailPolicy, TailSettings
from router.policies import DEFAULT_POLICY, LoadTracker, RouteRequest, make_policy

PUSH_DELAY_S = 0.5
"""From a drain's start to the push that leaves its engines out: the controller pushes every second."""


@dataclass
class TailArm:
    """One arm: ``settings`` None is the static fleet; ``move`` whether a drain moves what is in flight."""

    name: str
    settings: TailSettings | None = None
    move: bool = False


@dataclass
class TailResult:
    arm: str
    wall_s: float
    node_s: float
    released_at: list[float | None]
    moved: int = 0
    moved_tokens: int = 0
    """Tokens already produced by the moved requests (re-prefilled, not regenerated)."""
    decisions: list[str] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return {
            "arm": self.arm,
            "wall_s": round(self.wall_s, 3),
            "node_s": round(self.node_s, 2),
            "released_at": [None if t is None else round(t, 2) for t in self.released_at],
            "moved": self.moved,
            "moved_tokens": self.moved_tokens,
            "decisions": self.decisions,
        }


class _Flight:
    """One turn's generation, across the engines it is moved through."""

    def __init__(self, rid: str, prompt: list[int], out: PlannedOutput, request: RouteRequest) -> None:
        self.rid = rid
        self.prompt = prompt
        self.out = out
        self.request = request
        self.produced = 0  # tokens made on engines it left
        self.req: SimRequest | None = None
        self.url = ""
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class _Fleet:
    def __init__(self, trace: Trace, arm: TailArm, nodes: int, per_node: int, config: SimConfig, cap: int):
        self.trace, self.arm, self.config, self.cap = trace, arm, config, cap
        self.node_urls = [[f"http://node{n}-engine{i}:8000" for i in range(per_node)] for n in range(nodes)]
        self.urls = [u for node in self.node_urls for u in node]
        self.schedulers = {u: Scheduler(config) for u in self.urls}
        self.policy = make_policy(DEFAULT_POLICY)
        self.load = LoadTracker(self.urls, rng=random.Random(0))
        self.policy.on_backends_changed(self.urls)
        self.on: dict[str, set[_Flight]] = {u: set() for u in self.urls}
        self.released: list[float | None] = [None] * nodes
        self.draining: set[int] = set()
        self.tail = TailPolicy(arm.settings) if arm.settings is not None else None
        self.moved = 0
        self.moved_tokens = 0
        self.decisions: list[str] = []
        self.done = False
        self.t0 = 0.0
        self.drains: list[asyncio.Task[None]] = []

    # -- one request on one engine -------------------------------------------------------------------
    def submit(self, f: _Flight, url: str) -> None:
        target = len(f.out.tokens) - f.produced
        req = SimRequest(
            f"{f.rid}@{f.produced}", f.prompt + f.out.tokens, len(f.prompt) + f.produced, target, ""
        )
        f.req, f.url = req, url
        self.on[url].add(f)
        self.load.acquire(url, len(f.request.body))
        self.schedulers[url].submit(req)
        req.done.add_done_callback(lambda _: self._ended(f, req, url))

    def _ended(self, f: _Flight, req: SimRequest, url: str) -> None:
        if f.req is not req:
            return  # moved: its successor carries on
        self.on[url].discard(f)
        self.load.release(url, len(f.request.body))
        if not f.finished.done():
            f.finished.set_result(None)

    def move_off(self, url: str) -> None:
        for f in list(self.on[url]):
            req = f.req
            assert req is not None
            if req.done.done():
                continue  # finished; its end is being delivered
            f.produced += req.n_gen
            self.moved += 1
            self.moved_tokens += f.produced
            f.req = None
            self.on[url].discard(f)
            self.load.release(url, len(f.request.body))
            self.schedulers[url].abort(req)
            to = self.policy.choose(f.request, self.load)
            self.policy.commit(f.request, to)  # as the router's move: the turn's affinity follows it
            self.submit(f, to)

    # -- the client ------------------------------------------------------------------------------------
    async def session(self, s: Session) -> None:
        if s.start_s > 0:
            await asyncio.sleep(s.start_s)
        messages = [
            {"role": "system", "content": self.trace.system_prompt(s)},
            {"role": "user", "content": s.task},
        ]
        for k, turn in enumerate(s.turns):
            if k > 0 and turn.gap_s > 0:
                await asyncio.sleep(turn.gap_s)
            if k > 0:
                messages.append({"role": "user", "content": turn.tool_output})
            body = orjson.dumps(gym_chat_payload(self.config.model_name, messages, turn.max_tokens))
            request = self.policy.prepare(RouteRequest(CHAT_PATH, body, {}))
            url = self.policy.choose(request, self.load)
            self.policy.commit(request, url)
            params = parse_generation("chat", orjson.loads(body), self.config)
            f = _Flight(f"{s.id}-{k}", params.prompt, plan_output(params, self.config), request)
            self.submit(f, url)
            await f.finished
            messages.append({"role": "assistant", "content": f.out.text})

    # -- the elastic manager -----------------------------------------------------------------------------
    def serving_nodes(self) -> list[int]:
        return [n for n in range(len(self.node_urls)) if n not in self.draining and self.released[n] is None]

    async def manage(self) -> None:
        loop = asyncio.get_running_loop()
        assert self.tail is not None
        while not self.done:
            await asyncio.sleep(READ_EVERY_S)
            serving = self.serving_nodes()
            urls = [u for n in serving for u in self.node_urls[n]]
            reading = Reading(
                loop.time() - self.t0,
                sum(len(self.on[u]) for u in urls),
                len(urls) * self.cap,
                len(serving),
                None,
                busy=bool(self.draining),
            )
            decision = self.tail.observe(reading)
            if decision is None:
                continue
            self.decisions.append(f"{reading.now:.1f} s: {decision.op} {decision.nodes}: {decision.reason}")
            if decision.op == "shrink":
                for n in sorted(serving, reverse=True)[: decision.nodes]:  # the manager's: newest first
                    self.drains.append(loop.create_task(self.drain(n)))

    async def drain(self, n: int) -> None:
        loop = asyncio.get_running_loop()
        self.draining.add(n)
        started = loop.time()
        if self.arm.move:
            for u in self.node_urls[n]:
                self.move_off(u)
        await asyncio.sleep(PUSH_DELAY_S)
        stay = [u for u in self.load.backends if u not in self.node_urls[n]]
        self.load.set_backends(stay)
        self.policy.on_backends_changed(stay)
        if self.arm.move:
            for u in self.node_urls[n]:
                self.move_off(u)  # what the push's 'removed' moves: requests sent before it
        zero_reads, zero_since = 0, None
        timeout = 120.0
        while True:
            now = loop.time()
            if sum(len(self.on[u]) for u in self.node_urls[n]) == 0:
                zero_reads += 1
                zero_since = now if zero_since is None else zero_since
            else:
                zero_reads, zero_since = 0, None
            if zero_reads >= ZERO_READS_TO_DRAIN and now - (zero_since or now) >= QUIET_S:
                break
            if now - started > timeout:
                for u in self.node_urls[n]:
                    self.move_off(u)  # the drain timeout: aborted there (counted as moves)
                break
            await asyncio.sleep(DRAIN_POLL_S)
        self.released[n] = loop.time() - self.t0
        self.draining.discard(n)


async def _run(
    trace: Trace, arm: TailArm, nodes: int, per_node: int, config: SimConfig, cap: int
) -> TailResult:
    loop = asyncio.get_running_loop()
    fleet = _Fleet(trace, arm, nodes, per_node, config, cap)
    for s in fleet.schedulers.values():
        s.start()
    fleet.t0 = loop.time()
    manager = loop.create_task(fleet.manage()) if fleet.tail is not None else None
    await asyncio.gather(*(fleet.session(s) for s in trace.sessions))
    wall = loop.time() - fleet.t0
    fleet.done = True
    if manager is not None:
        await manager
    for s in fleet.schedulers.values():
        await s.close()
    node_s = sum(wall if r is None else min(r, wall) for r in fleet.released)
    return TailResult(
        arm.name, wall, node_s, fleet.released, fleet.moved, fleet.moved_tokens, fleet.decisions
    )


def run_tail_arm(
    trace: Trace,
    arm: TailArm,
    nodes: int = 2,
    engines_per_node: int = 2,
    config: SimConfig | None = None,
    capacity_per_engine: int = 16,
) -> TailResult:
    """One arm on fresh engines in virtual time; the same arguments give the same result."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(
            _run(trace, arm, nodes, engines_per_node, config or SimConfig(), capacity_per_engine)
        )
    finally:
        loop.close()


def compare_tail(trace: Trace, arms: Sequence[TailArm], **kwargs: Any) -> list[dict[str, Any]]:
    """One row per arm; the first arm is the baseline the others' percentages are against."""
    rows = [run_tail_arm(trace, a, **kwargs).row() for a in arms]
    base = rows[0]
    for r in rows:
        r["node_s_saved_pct"] = round(100 * (1 - r["node_s"] / base["node_s"]), 2)
        r["wall_pct"] = round(100 * (r["wall_s"] / base["wall_s"] - 1), 2)
    return rows
