"""The fleet-health loop of the driver: probe, drain, judge, push the whole serving set, restart.

Every tick (1 s by default) it gathers the two kinds of evidence separately — an active ``GET /health``
per engine with a short timeout (a hung probe is a failure), and the gateway's drained per-backend
outcomes of the same window (where its kind reports them, see ``launcher.gateways``) — hands them to
``launcher.fleet.FleetHealth``, and pushes the **whole** serving set to the gateway (never a delta: a
restarted router actor or managed front converges on the next tick). Engines
the state machine condemns are restarted in place by their node's engine host (``ControlRequests`` in
the job directory; the replacement comes back on a new port and is readmitted only after passing probes).

Two failures the probes alone would handle late or never:

* **A dead engine host** (its srun step or process exited: a node problem, an OOM kill, ``scancel`` of
  the step). Seen on the next tick from the step itself, reported (event and driver log), and every
  engine it held is condemned at once; the engines that get a restart are served by a new host step on
  the same node, which adopts the requested generations. Budgets spent: the engines retire, and with
  none left the job fails with the reason.
* **A restart that never answers.** ``FleetHealth`` has no timer for RESTARTING (only the driver can
  cancel what it started), so this loop gives each restart ``restart_timeout_s`` and then reports it
  failed: no engine waits in RESTARTING forever.

Weight versions are judged by the front alone (``router.fleet.api.FleetApi``, for the builtin router and
vllm-router's fleet endpoint): each tick reads the engines it holds out as stale (``Gateway.stale_engines``)
into the state machine's STALE state, and never reads an engine's version itself, so the two can never
disagree on which engines are stale.

State changes, restarts and router restarts go to ``events.jsonl``; the fleet snapshot goes to the job
state for ``rl-launch status``. When nothing can serve any more, ``fatal`` is set and the driver fails
the job with that reason instead of hanging. ``stop`` writes the final snapshot: every engine STOPPED.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from launcher.fleet.health import (
    SERVING_STATES,
    EngineRecord,
    EngineState,
    FleetHealth,
    HealthPolicy,
    ProbeResult,
    TickInput,
)
from launcher.gateways import Gateway
from launcher.jobdir import STOPPED, JobDir, StateWriter, engine_id
from router.fleet.engine import EngineClient
from router.fleet.ops import fan_out
from router.state.backends import canonical_backend_url

T = TypeVar("T")


def fan_out_now(
    urls: Sequence[str],
    call: Callable[[EngineClient, str], Awaitable[T]],
    timeout_s: float,
    api_key: str | None = None,
) -> list[T]:
    """``router.fleet.ops.fan_out`` from the controller's thread (one ``asyncio.run``): every engine at
    once, each bounded by ``timeout_s``, so a tick waits for its slowest engine at most that long (a hung
    engine is a failed probe, never a stalled tick)."""
    if not urls:
        return []
    return asyncio.run(fan_out(urls, call, api_key=api_key, timeout_s=timeout_s))


async def _probe(engines: EngineClient, url: str) -> ProbeResult:
    health = await engines.health(url)
    return ProbeResult(health.ok, health.detail)


class EngineHosts(Protocol):
    """The driver's engine-host steps, as the controller needs them."""

    def exited(self, node_index: int) -> int | None:
        """The host's exit status if its step has ended, else None."""

    def restart(self, node_index: int) -> None:
        """Start node ``node_index``'s engine host again (same node, same config)."""

    def describe(self, node_index: int) -> str:
        """Node name and log tail, for the report."""


@dataclass
class _HostDown:
    since: float
    code: int | None


class FleetController:
    def __init__(
        self,
        job: JobDir,
        state: StateWriter,
        gateway: Gateway,
        node_count: int,
        policy: HealthPolicy | None = None,
        hosts: EngineHosts | None = None,
        tick_s: float = 1.0,
        probe_timeout_s: float = 1.0,
        restart_timeout_s: float = 900.0,
        say: Callable[[str], None] | None = None,
        view_every: int = 5,
    ) -> None:
        self.job = job
        self.state = state
        self.say = say or (lambda message: None)
        self.gateway = gateway
        self.view_every = view_every
        self._ticks = 0
        self.last_version: str | None = None
        """The fleet's weight version as the front last reported it: kept only to re-seed a front that
        restarted and forgot it (``_reseed_version``), never to judge an engine."""
        try:
            self._engine_key: str | None = job.read_engine_key()
        except OSError:  # a job without one (tests): engines without a key
            self._engine_key = None
        self.hosts = hosts
        self.tick_s = tick_s
        self.probe_timeout_s = probe_timeout_s
        self.restart_timeout_s = restart_timeout_s
        self.where: dict[str, tuple[int, int]] = {}  # engine id -> (node index, engine index)
        self.generation: dict[str, int] = {}
        self.restart_since: dict[str, float] = {}
        self.hosts_down: dict[int, _HostDown] = {}
        records = []
        for node_index in range(node_count):
            listing = job.read_listing(node_index)
            if listing is None:
                raise RuntimeError(f"no engine listing for generation node {node_index}")
            for entry in listing.engines:
                eid = engine_id(node_index, entry.index)
                self.where[eid] = (node_index, entry.index)
                self.generation[eid] = entry.generation
                records.append(EngineRecord(id=eid, node=entry.node, url=canonical_backend_url(entry.url)))
        self.nodes: list[int] = list(range(node_count))
        """The generation nodes (indices) whose engines are in the fleet: the allocation's, then any it
        grew by (``launcher.fleet.elastic``); a node drained away leaves it."""
        self.draining_nodes: set[int] = set()
        """Nodes being drained: their host is stopped on purpose, so its exit condemns nothing."""
        self.pushes = 0
        """Serving sets the front accepted: a drain waits for one pushed after it began."""
        self._lock = threading.RLock()
        """A tick and a change of the fleet's membership (the elastic manager's thread) never interleave."""
        self.fleet = FleetHealth(records, policy)
        self.fatal: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gateway_instance: str | None = None

    def start(self) -> FleetController:
        # The front's identity now, not at the first tick: a front that restarts before the first tick
        # completes (a fault early in training, a slow tick) must still be reported as restarted.
        self._gateway_instance = self._current_instance()
        self._thread = threading.Thread(target=self._loop, name="fleet-health", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop ticking and record the final fleet state (every engine STOPPED, with the state it was in)."""
        self._stop.set()
        self.state.update(fleet=self.final_snapshot(), gateway=self._final_gateway_view())
        if self._thread is not None:
            # A tick may sit in a ray.get whose head is gone already (scancel signals every step): do
            # not wait long for it; its late state write is suppressed once the stop is set.
            self._thread.join(2)

    def _final_gateway_view(self) -> dict[str, Any]:
        """The gateway as a finished job shows it: stopped, no member serving (its last view is kept
        per member as ``state_at_end``-style detail, so the dashboard never shows a live front)."""
        last = self.state.snapshot().get("gateway") or {}
        if not isinstance(last, dict):
            # No tick wrote a view yet: "gateway" is still the kind the router_serving event named (a
            # job that failed within a second of starting its training command hit this teardown error).
            last = {"kind": last}
        return {
            **last,
            "reachable": False,
            "detail": "stopped with the job",
            "members": [{**m, "healthy": None} for m in last.get("members", [])],
            "final": True,
        }

    def final_snapshot(self) -> dict[str, Any]:
        snap = self.snapshot()
        for e in snap["engines"]:
            e["state_at_end"] = e["state"]
            e["state"] = STOPPED
            e["serving"] = False
        snap["totals"] = {
            **{k: 0 for k in snap["totals"]},
            STOPPED: len(snap["engines"]),
            "engines": len(snap["engines"]),
            "serving": 0,
        }
        snap["final"] = True
        return snap

    def _restore_pause(self, serving: Sequence[str]) -> None:
        """A front that restarted in the middle of a refit pause comes back open: requests would pile up
        on the paused engines without the router's bounds, and the trainer's resume would release nothing
        it counts. If any serving engine is paused, close the restarted front's gate again."""
        answers = fan_out_now(serving, lambda e, u: e.is_paused(u), self.probe_timeout_s, self._engine_key)
        paused = [a.url for a in answers if a.value]
        if not paused:
            return
        try:
            if self.gateway.restore_pause():
                self.job.log_event(
                    "router_pause_restored",
                    f"{len(paused)}/{len(serving)} engines paused: the restarted front holds requests again",
                )
        except Exception as exc:
            self.job.log_event("router_unreachable", f"could not restore the pause: {exc!r}")

    def _current_instance(self) -> str | None:
        try:
            return self.gateway.instance()
        except Exception:  # the front is restarting: no identity this tick
            return None

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.tick()
            except Exception as exc:  # one bad tick must not end health management
                self.job.log_event("fleet_error", f"health tick failed: {exc!r}")

    # -- one tick ---------------------------------------------------------------------------------------
    def tick(self) -> None:
        with self._lock:
            self._tick()

    def _tick(self) -> None:
        self._check_hosts()
        self._collect_restarts()
        self._expire_restarts()
        targets = self.fleet.probe_targets()
        urls = list(targets.values())
        probes = dict(zip(urls, fan_out_now(urls, _probe, self.probe_timeout_s), strict=True))
        try:
            outcomes = self.gateway.drain_outcomes()
        except Exception:  # the gateway is restarting: probes alone this tick
            outcomes = {}
        stale = self._front_stale()
        result = self.fleet.observe(TickInput(probes=probes, outcomes=outcomes, stale=stale))
        push = list(result.serving_urls)
        if self.gateway.guards_weight_version:
            push += result.stale_urls  # held out by the front itself, listed for the trainer
        if result.to_restart:
            self._move_off_restarting(result.to_restart)
        timed_out = False
        try:
            self.gateway.set_serving(push)
            self.pushes += 1
        except Exception as exc:
            timed_out = isinstance(exc, TimeoutError)  # a Ray actor mid-restart: asking again waits again
            self.job.log_event("router_unreachable", f"could not push the serving set: {exc!r}")
        # Apart from the push: a push refused while the front was down must not hide that it came back
        # as a new process (the next push then succeeds against the new one with nothing to compare).
        instance = None if timed_out else self._current_instance()
        if instance is not None:
            if self._gateway_instance is not None and instance != self._gateway_instance:
                self.job.log_event(
                    "router_restarted",
                    f"{self.gateway.kind} gateway restarted ({self._gateway_instance} -> {instance})",
                )
                self._restore_pause(result.serving_urls)
            self._gateway_instance = instance
        self._ticks += 1
        if self._ticks % self.view_every == 1 or self.view_every == 1:
            # The front's own view, beside ours in `rl-launch status` (every few ticks: for an external
            # front it is one more HTTP call).
            self.state.update(gateway=self.gateway.view().to_json())
        for eid in result.to_restart:
            self._request_restart(eid)
        self._restart_hosts(result.to_restart)
        for event in result.events:
            if event.get("level") in ("warning", "error") or event["to_state"] in ("DEAD", "RETIRED"):
                # Loudly, in the driver's own log too: a shrinking fleet must not go unnoticed.
                self.say(
                    f"engine {event['engine_id']} on {event.get('node')}: {event['from_state']} -> "
                    f"{event['to_state']}: {event['reason']}"
                )
            self.job.log_event(
                "fleet",
                f"engine {event['engine_id']}: {event['from_state']} -> "
                f"{event['to_state']} ({event['reason']})",
                **dict(event),
            )
        if not self._stop.is_set():  # stop() writes the final snapshot; a late tick must not undo it
            self.state.update(fleet=self.snapshot())
        if result.fatal and self.fatal is None:
            self.fatal = result.fatal

    def _front_stale(self) -> dict[str, str] | None:
        """The engines the front holds out as stale (``{url: why}``), after re-seeding a front that forgot
        the fleet's version; ``None`` when the front did not answer (no evidence this tick)."""
        self._reseed_version()
        try:
            return dict(self.gateway.stale_engines())
        except Exception:  # the gateway is restarting: STALE engines stay STALE this tick
            return None

    def _reseed_version(self) -> None:
        """The front (``router.fleet.api.FleetApi``) is the one judge of weight versions; this loop never
        compares them. It keeps the last version the front reported only to give it back to a front that
        restarted and forgot it (a router actor restart): without it the restarted front would admit
        every engine that joins, stale ones included, until the trainer's next stamp."""
        try:
            version = self.gateway.weight_version()
            if version is None and self.last_version is not None and self.gateway.guards_weight_version:
                self.gateway.restore_weight_version(self.last_version)
                version = self.last_version
        except Exception:  # the gateway is restarting: keep the last known version
            return
        self.last_version = version

    def snapshot(self) -> dict[str, Any]:
        """The fleet's snapshot for the job state, with the fleet's weight version as the front last
        reported it (for the dashboard; nothing here judges by it)."""
        return {**self.fleet.snapshot(), "current_version": self.last_version}

    # -- membership (``launcher.fleet.elastic``) -------------------------------------------------------------
    def add_node(self, node_index: int, reason: str) -> list[str]:
        """The engines node ``node_index``'s host published join the fleet (HEALTHY; the front judges
        their weight version when the next tick pushes them). Returns their ids."""
        listing = self.job.read_listing(node_index)
        if listing is None or listing.error:
            raise RuntimeError(f"no engine listing for generation node {node_index}")
        with self._lock:
            records = []
            for entry in listing.engines:
                eid = engine_id(node_index, entry.index)
                records.append(EngineRecord(id=eid, node=entry.node, url=canonical_backend_url(entry.url)))
            self.fleet.add(records, reason)
            for entry, rec in zip(listing.engines, records, strict=True):
                self.where[rec.id] = (node_index, entry.index)
                self.generation[rec.id] = entry.generation
            self.nodes.append(node_index)
            if not self._stop.is_set():  # the dashboard shows them now, not at the next tick
                self.state.update(fleet=self.snapshot())
            return [r.id for r in records]

    def drain_node(self, node_index: int, reason: str) -> list[str]:
        """Node ``node_index``'s engines leave the serving set now (the next push drops them; their
        requests in flight go on), and its host's exit is no longer a failure. Returns the URLs to wait
        on."""
        with self._lock:
            self.draining_nodes.add(node_index)
            self.hosts_down.pop(node_index, None)
            urls = []
            for eid in self._engines_of(node_index):
                self.fleet.drain(eid, reason)
                self.restart_since.pop(eid, None)
                urls.append(self.fleet.engine(eid).url)
            return urls

    def remove_node(self, node_index: int, reason: str) -> None:
        """A drained node's engines are stopped: they leave the fleet's records."""
        with self._lock:
            for eid in self._engines_of(node_index):
                self.fleet.remove(eid, reason)
                del self.where[eid]
                self.generation.pop(eid, None)
            if node_index in self.nodes:
                self.nodes.remove(node_index)
            self.draining_nodes.discard(node_index)
            if not self._stop.is_set():
                self.state.update(fleet=self.snapshot())

    def serving_engines_of(self, node_index: int) -> int:
        """How many of the node's engines are in a serving state now."""
        with self._lock:
            return sum(1 for eid in self._engines_of(node_index) if self.fleet.state(eid) in SERVING_STATES)

    def serving_engines(self) -> int:
        with self._lock:
            return sum(1 for eid in self.where if self.fleet.state(eid) in SERVING_STATES)

    def _engines_of(self, node_index: int) -> list[str]:
        return [eid for eid, (n, _) in self.where.items() if n == node_index]

    def _check_hosts(self) -> None:
        """A host step that ended condemns its engines now (their probes would take several ticks, and a
        restart request to a dead host would never be answered)."""
        if self.hosts is None or self._stop.is_set():  # stopping: the teardown ends the hosts
            return
        for node_index in self.nodes:
            if node_index in self.hosts_down or node_index in self.draining_nodes:
                continue
            code = self.hosts.exited(node_index)
            if code is None:
                continue
            self.hosts_down[node_index] = _HostDown(time.monotonic(), code)
            reason = f"engine host on generation node {node_index} exited with {code}"
            self.say(f"{reason}; {self.hosts.describe(node_index)}")
            self.job.log_event(
                "engine_host_died",
                reason,
                node_index=node_index,
                exit_code=code,
                engines=self._engines_of(node_index),
            )
            for eid in self._engines_of(node_index):
                if self.fleet.state(eid) is EngineState.RESTARTING:
                    self.fleet.restart_failed(eid, reason)
                    self.restart_since.pop(eid, None)
                else:
                    self.fleet.mark_dead(eid, reason)

    def _restart_hosts(self, restarting: list[str]) -> None:
        if self.hosts is None or self._stop.is_set():
            return
        for node_index in sorted({self.where[eid][0] for eid in restarting} & set(self.hosts_down)):
            del self.hosts_down[node_index]
            self.job.log_event(
                "engine_host_restart",
                f"starting generation node {node_index}'s engine host again",
                node_index=node_index,
            )
            self.say(f"starting the engine host of generation node {node_index} again")
            self.hosts.restart(node_index)

    def _move_off_restarting(self, eids: list[str]) -> None:
        """Before the push that drops them: the front moves the requests in flight on engines about to
        restart to other engines (``Gateway.move_off``, "restarted"; a front that continues requests
        resumes each from its tokens so far), instead of losing them with the process."""
        urls = [self.fleet.engine(eid).url for eid in eids]
        try:
            self.gateway.move_off(urls, "restarted")
        except Exception as exc:  # the front is restarting too: the engines' requests break and retry
            self.job.log_event("router_unreachable", f"moving requests off restarting engines: {exc!r}")

    def _request_restart(self, eid: str) -> None:
        node_index, index = self.where[eid]
        self.generation[eid] += 1
        self.restart_since[eid] = time.monotonic()
        requests = self.job.read_control(node_index)  # this controller is the file's only writer
        requests.restart[index] = self.generation[eid]
        self.job.write_control(node_index, requests)
        self.job.log_event("engine_restart", f"engine {eid}: restart requested", engine_id=eid)

    def _expire_restarts(self) -> None:
        now = time.monotonic()
        for eid, since in list(self.restart_since.items()):
            if self.fleet.state(eid) is not EngineState.RESTARTING:
                self.restart_since.pop(eid)
            elif now - since > self.restart_timeout_s:
                self.restart_since.pop(eid)
                self.fleet.restart_failed(eid, f"no replacement within {self.restart_timeout_s:g} s")

    def _collect_restarts(self) -> None:
        """Tell the state machine about replacements the engine hosts finished (new URL or error)."""
        listings = {}
        for eid, (node_index, index) in self.where.items():
            if self.fleet.state(eid) is not EngineState.RESTARTING:
                continue
            if node_index not in listings:
                listings[node_index] = self.job.read_listing(node_index)
            listing = listings[node_index]
            if listing is None:
                continue
            entry = next((e for e in listing.engines if e.index == index), None)
            if entry is None or entry.generation < self.generation[eid]:
                continue  # not answered yet (a restarted host that fails exits: _check_hosts sees it)
            self.restart_since.pop(eid, None)
            if entry.error:
                self.fleet.restart_failed(eid, str(entry.error)[-2000:])
            else:
                self.fleet.restarted(eid, canonical_backend_url(entry.url))
                self.job.log_event(
                    "engine_restarted", f"engine {eid} back on {entry.url}", engine_id=eid, url=entry.url
                )
