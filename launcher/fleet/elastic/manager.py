"""The driver's elastic fleet: grow by Slurm jobs of its own, drain and hand nodes back, the tail policy.

One thread, ticking every second, next to the fleet controller (``launcher.fleet.controller``), which
stays the one judge of engine health; this manager only changes which nodes are in the fleet:

* **Grow** (``rl-launch fleet grow``, the tail policy): a grow job is submitted (``slurm_ops``: the
  generation role's resources, none of the fleet's nodes, a time limit no later than the job's); while it
  queues its Slurm reason is shown; once it runs, one engine host per node is started into it (``srun
  --jobid``: the driver's own steps, restarted and stopped like every other), and when every host has
  published its engines they join the controller's fleet, which pushes them to the front on its next
  tick (the front checks their weight version: STALE until refit, as for any engine). In local mode the
  hosts start at once on this machine.
* **Drain and shrink** (``rl-launch fleet shrink``, the tail policy): the node's engines go DRAINING in
  the controller, so its next push leaves them out (a session's next turn goes to another engine, as
  after a failure); their requests in flight finish, read from the engines' own gauges (running +
  waiting) after that push, twice in a row, and at most ``drain_timeout_s``, after which they are ended
  with the engines and the front answers them as the contract says (a retry elsewhere, else 500). Then
  the host stops, the engines leave the fleet, and the node goes back to Slurm: its grow job ends, or the
  job holding it is shrunk (``scontrol update``), its Ray worker stopped first.
* **Bad input** is refused before anything changes, with the reason: a shrink that would leave no
  engine, a node that is not the fleet's (or runs the driver), a grow the partition can never run.

Everything it does is an ``elastic`` event in ``events.jsonl`` with its reason, and the ``elastic`` part
of the job state (``launcher.fleet.elastic.shapes``) says which nodes serve, drain or were given back,
what each grow waits for, and the node-seconds held and given back.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from launcher.fleet.elastic import shapes, slurm_ops
from launcher.fleet.elastic.drain import DRAIN_POLL_S, Drain, NodeDrains, in_flight_of
from launcher.fleet.elastic.grow import Grow, GrowLifecycle, NodeRow
from launcher.fleet.elastic.shapes import ElasticAnswer, ElasticRequest
from launcher.fleet.elastic.tail import Decision, Reading, TailPolicy, TailSettings
from launcher.slurm.request import container_srun_args

if TYPE_CHECKING:
    from launcher.fleet.controller import FleetController
    from launcher.fleet.elastic.hosts import EngineHostFleet
    from launcher.jobdir import JobDir, StateWriter
    from launcher.spec import ResolvedSpec
    from launcher.steps.ray_cluster import RayCluster

READ_EVERY_S = 0.9
"""The tail policy reads the engines' load about every tick: a coarser reading adds its interval to every
shrink's delay, and the tail is when nodes are wasted."""
MAX_LOCAL_NODES = 8
"""A local job's generation nodes in all, grown ones included: each is one more engine host with its
engines on this one machine, so an unbounded ``--nodes`` (``["localhost"] * nodes``) was as many hosts as
asked, until the machine ran out of memory or processes."""


class ElasticFleet(GrowLifecycle, NodeDrains):
    """The elastic manager: requests, the tick, the tail policy and the state; grows in ``grow.py``,
    drains in ``drain.py``."""

    def __init__(
        self,
        spec: ResolvedSpec,
        job: JobDir,
        state: StateWriter,
        controller: FleetController,
        engines: EngineHostFleet,
        ray: RayCluster | None,
        *,
        local: bool,
        training_nodes: list[str],
        held_since: float,
        say: Callable[[str], None],
        refuse_why: str = "",
        tick_s: float = 1.0,
    ) -> None:
        self.spec, self.job, self.state, self.controller = spec, job, state, controller
        self.engines, self.ray, self.local, self.say = engines, ray, local, say
        self.training_nodes = list(training_nodes)
        self.refuse_why = refuse_why
        """Why this front cannot be resized (``FrontKind.no_elastic_why``); every request is refused."""
        self.tick_s = tick_s
        self.job_id = None if local else os.environ.get("SLURM_JOB_ID")
        self.driver_node = socket.gethostname()
        self.hetjob = spec.slurm is not None and spec.slurm.layout == "hetjob"
        self.nodes: dict[int, NodeRow] = {
            i: NodeRow(i, name, self.job_id, held_since) for i, name in enumerate(engines.generation_nodes)
        }
        self.grows: dict[str, Grow] = {}
        self.drains: dict[int, Drain] = {}
        self.decisions: list[dict[str, Any]] = []
        gen = spec.generation
        self.drain_timeout_s = gen.drain_timeout_s
        self.capacity_per_engine = gen.elastic.capacity_per_engine if gen.elastic else 0
        self.policy = (
            TailPolicy(
                TailSettings(
                    floor_nodes=gen.elastic.floor_nodes,
                    shrink_below=gen.elastic.shrink_below,
                    for_s=gen.elastic.for_s,
                    grow_back=gen.elastic.grow_back,
                    grow_above=gen.elastic.grow_above,
                )
            )
            if gen.elastic is not None
            else None
        )
        try:
            self.api_key: str | None = job.read_engine_key()  # the engines' gauges take it
        except OSError:
            self.api_key = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_reading = 0.0
        self._last_full = 0.0
        shapes.make_dirs(job.path)

    # -- life ---------------------------------------------------------------------------------------------
    def start(self) -> ElasticFleet:
        self._write_state()
        self._thread = threading.Thread(target=self._loop, name="elastic-fleet", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """The job is ending: no more resizes, every grow job still held is ended (its hosts are stopped by
        the driver's teardown with the others), and the final node-seconds are written."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(3)  # a tick stopping a host may still run: it finds the hosts closed
        now = time.time()
        for g in self.grows.values():
            if g.state in shapes.GROW_FINAL:
                continue
            if g.job_id is not None:
                error = slurm_ops.cancel_job(g.job_id)
                if error:
                    self.say(f"grow {g.id}: scancel {g.job_id} failed: {error}")
            self._set_grow(g, shapes.GROW_ENDED, "ended with the job")
        for row in self.nodes.values():
            if row.released_at is None:
                row.released_at = now
                row.detail = "held until the job ended"
        self._write_state(final=True)

    def _loop(self) -> None:
        while not self._stop.wait(DRAIN_POLL_S if self.drains else self.tick_s):
            try:
                self.tick()
            except Exception as exc:  # one bad tick must not end resizing (nor the job)
                self.job.log_event("elastic_error", f"elastic tick failed: {exc!r}")

    def tick(self) -> None:
        for request in shapes.take_requests(self.job.path):
            if isinstance(request, tuple):
                if request[0]:
                    shapes.answer(self.job.path, ElasticAnswer(request[0], False, request[1]))
                else:  # no answer can be named for it: said in the driver's log instead
                    self.say(f"elastic: ignored {request[1]}")
                continue
            reply = self.handle(request)
            shapes.answer(self.job.path, reply)
            self._event("request" if reply.ok else "refused", reply.message, op=request.op, by=request.by)
        self._advance_drains()
        now = time.monotonic()
        if now - self._last_full < self.tick_s * 0.9:
            return  # between ticks: only the drains are polled faster
        self._last_full = now
        self._advance_grows()
        self._apply_policy()
        self._write_state()

    # -- requests -----------------------------------------------------------------------------------------
    def handle(self, request: ElasticRequest) -> ElasticAnswer:
        """Act on one request, or refuse it with the reason (nothing changed)."""
        if self.refuse_why:
            return ElasticAnswer(request.id, False, self.refuse_why)
        try:
            if request.op == "grow":
                g = self.grow(request.nodes, request.time_limit_s, by=request.by)
                return ElasticAnswer(request.id, True, self._grow_line(g), grow_id=g.id)
            if request.op == "shrink":
                names = self.shrink(request.nodes, request.node_names, request.drain_timeout_s, by=request.by)
                return ElasticAnswer(
                    request.id, True, f"draining {len(names)} node(s): {', '.join(names)}", nodes=names
                )
            if request.op == "cancel":
                self.cancel(request.grow_id, by=request.by)
                return ElasticAnswer(
                    request.id, True, f"grow {request.grow_id} cancelled", grow_id=request.grow_id
                )
            return ElasticAnswer(request.id, False, f"unknown op {request.op!r}: grow, shrink or cancel")
        except ValueError as exc:
            return ElasticAnswer(request.id, False, str(exc))

    def grow(self, nodes: int, time_limit_s: float | None = None, by: str = "") -> Grow:
        """Ask for ``nodes`` more generation nodes; ``ValueError`` with the reason when refused."""
        if nodes < 1:
            raise ValueError(f"--nodes must be at least 1, got {nodes}")
        gid = f"g{len(self.grows) + 1}"
        g = Grow(gid, nodes, by, time.time())
        if self.local:
            held = sum(1 for r in self.nodes.values() if r.released_at is None)
            if held + nodes > MAX_LOCAL_NODES:
                raise ValueError(
                    f"--nodes {nodes}: a local job runs every node's engines on this machine, at most "
                    f"{MAX_LOCAL_NODES} generation node(s) in all, and it holds {held}; ask for at most "
                    f"{max(MAX_LOCAL_NODES - held, 0)}"
                )
            self.grows[gid] = g
            self._event("grow", f"grow {gid}: {nodes} local node(s) ({by})", grow_id=gid, nodes=nodes)
            self._start_hosts(g, ["localhost"] * nodes)
            return g
        ops = slurm_ops
        held = [r.name for r in self.nodes.values() if r.released_at is None]
        exclude = sorted({*held, *self.training_nodes})
        try:
            ops.check_grow_fits(self.spec, nodes, len(exclude))
            limit = ops.grow_time_limit_s(self.job_id, time_limit_s, time.time())
            script = ops.grow_script(
                self.spec,
                self.job.path,
                gid,
                nodes,
                limit,
                exclude,
                self.job_id or "",
                container_srun_args(self.spec),
            )
            g.job_id = ops.submit_grow(script, self.job.path, gid)
        except ops.SlurmRefused as exc:
            raise ValueError(str(exc)) from None
        g.detail = f"time limit {limit // 60} min"
        self.grows[gid] = g
        self._event(
            "grow",
            f"grow {gid}: Slurm job {g.job_id} for {nodes} node(s), {g.detail} ({by})",
            grow_id=gid,
            slurm_job_id=g.job_id,
            nodes=nodes,
        )
        return g

    def cancel(self, grow_id: str, by: str = "") -> None:
        g = self.grows.get(grow_id)
        if g is None:
            known = ", ".join(self.grows) or "none"
            raise ValueError(f"no grow {grow_id!r} in this job (grows: {known})")
        if g.state in shapes.GROW_FINAL:
            raise ValueError(f"grow {grow_id} is {g.state} already")
        if g.state == shapes.GROW_JOINED:
            names = ", ".join(self.nodes[i].name for i in g.indices)
            raise ValueError(
                f"grow {grow_id} has joined the fleet: shrink its nodes instead (--node {names})"
            )
        self._end_grow(g, shapes.GROW_CANCELLED, f"cancelled ({by})")

    def shrink(
        self, nodes: int, names: list[str], drain_timeout_s: float | None = None, by: str = ""
    ) -> list[str]:
        """Drain ``names`` (or ``nodes`` chosen ones: grown nodes first, newest first); ``ValueError`` with
        the reason, and nothing changed, when refused."""
        serving = [r for r in self.nodes.values() if r.state == shapes.NODE_SERVING]
        if names:
            picked = []
            for name in names:
                rows = [r for r in serving if r.name == name]
                if not rows:
                    mine = ", ".join(sorted({r.name for r in serving})) or "none"
                    draining = [
                        r for r in self.nodes.values() if r.name == name and r.state == shapes.NODE_DRAINING
                    ]
                    if draining:
                        raise ValueError(f"node {name} is DRAINING already")
                    raise ValueError(
                        f"node {name} is not one of the fleet's serving generation nodes ({mine})"
                    )
                if len(rows) > 1:
                    raise ValueError(
                        f"{len(rows)} generation nodes are named {name} (local mode): shrink by --nodes COUNT"
                    )
                picked.append(rows[0])
        else:
            if nodes < 1:
                raise ValueError(f"--nodes must be at least 1, got {nodes}")
            if nodes >= len(serving):
                raise ValueError(
                    f"shrinking by {nodes} of {len(serving)} node(s) would leave no engine serving "
                    f"({self.controller.serving_engines()} serving now); keep at least one"
                )
            candidates = [r for r in serving if self._releasable(r) is None]
            candidates.sort(key=lambda r: (r.grow_id == "", -r.since, -r.index))
            picked = candidates[:nodes]
            if len(picked) < nodes:
                why = "; ".join(f"{r.name}: {self._releasable(r)}" for r in serving if self._releasable(r))
                raise ValueError(
                    f"only {len(picked)} of the fleet's {len(serving)} serving node(s) can be given back"
                    + (f" ({why})" if why else "")
                    + f"; asked for {nodes}"
                )
        for r in picked:
            why = self._releasable(r)
            if why:
                raise ValueError(f"node {r.name} cannot be given back: {why}")
        left = self.controller.serving_engines() - sum(
            self.controller.serving_engines_of(r.index) for r in picked
        )
        if len(picked) >= len(serving) or left < 1:
            raise ValueError(
                f"shrinking by {len(picked)} of {len(serving)} node(s) would leave no engine serving "
                f"({self.controller.serving_engines()} serving now); keep at least one"
            )
        timeout = self.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        if timeout <= 0:
            raise ValueError(f"--drain-timeout must be > 0 s, got {timeout:g}")
        for r in picked:
            self._begin_drain(r, timeout, by)
        return [r.name for r in picked]

    def _releasable(self, r: NodeRow) -> str | None:
        """Why node ``r`` cannot go back to Slurm, or None."""
        if not self.local and r.job_id == self.job_id:
            if r.name == self.driver_node or r.name in self.training_nodes:
                return "it runs the job's driver (Ray head, router); it stays"
            if self.hetjob:
                return "a hetjob's generation component cannot be resized; only grown nodes can be given back"
        return None

    # -- the tail policy ----------------------------------------------------------------------------------
    def _apply_policy(self) -> None:
        if self.policy is None or self.refuse_why:
            return
        now = time.time()
        if now - self._last_reading < READ_EVERY_S:
            return
        self._last_reading = now
        serving_rows = [
            r for r in self.nodes.values() if r.state == shapes.NODE_SERVING and not self._starting(r)
        ]
        urls = self._serving_urls()
        loads = in_flight_of(urls, self.api_key)
        in_flight = sum(v for v in loads.values() if v is not None)
        capacity = len(urls) * self.capacity_per_engine
        busy = bool(self.drains) or any(
            g.state in (shapes.GROW_PENDING, shapes.GROW_STARTING) for g in self.grows.values()
        )
        reading = Reading(now, in_flight, capacity, len(serving_rows), self.controller.last_version, busy)
        decision = self.policy.observe(reading)
        if decision is not None:
            self._decide(decision)

    def _decide(self, d: Decision) -> None:
        entry = {"time": time.time(), "op": d.op, "nodes": d.nodes, "reason": d.reason}
        try:
            if d.op == "shrink":
                entry["done"] = self.shrink(d.nodes, [], by="tail policy")
            else:
                entry["done"] = self.grow(d.nodes, by="tail policy").id
        except ValueError as exc:
            entry["refused"] = str(exc)
        self.decisions = [*self.decisions, entry][-20:]
        self._event(
            "policy",
            f"tail policy: {d.op} {d.nodes}: {d.reason}"
            + (f" -- refused: {entry['refused']}" if "refused" in entry else ""),
            **entry,
        )

    def _serving_urls(self) -> list[str]:
        return self.controller.fleet.serving_urls()

    def _starting(self, r: NodeRow) -> bool:
        return bool(r.grow_id) and self.grows[r.grow_id].state == shapes.GROW_STARTING

    # -- reporting ----------------------------------------------------------------------------------------
    def _event(self, action: str, detail: str, **fields: Any) -> None:
        self.say(f"elastic: {detail}")
        self.job.log_event("elastic", detail, action=action, **fields)

    def _grow_line(self, g: Grow) -> str:
        if g.job_id is None:
            return f"grow {g.id}: {g.nodes} local node(s) starting"
        return f"grow {g.id}: Slurm job {g.job_id} submitted for {g.nodes} node(s) ({g.detail})"

    def snapshot(self, final: bool = False) -> dict[str, Any]:
        now = time.time()
        rows = [asdict(r) for r in sorted(self.nodes.values(), key=lambda r: r.index)]
        for row in rows:
            d = self.drains.get(row["index"])
            if d is not None:
                row["draining_for_s"] = round(now - d.started, 1)
                row["in_flight"] = d.last_in_flight
        held, given = shapes.node_seconds(rows, now)
        return {
            "time": now,
            "final": final,
            "policy": asdict(self.policy.settings) if self.policy is not None else None,
            "capacity_per_engine": self.capacity_per_engine,
            "drain_timeout_s": self.drain_timeout_s,
            "refused": self.refuse_why or None,
            "nodes": rows,
            "grows": [asdict(g) for g in self.grows.values()],
            "node_seconds": {"held": round(held, 1), "given_back": round(given, 1)},
            "decisions": self.decisions,
        }

    def _write_state(self, final: bool = False) -> None:
        self.state.update(elastic=self.snapshot(final))
