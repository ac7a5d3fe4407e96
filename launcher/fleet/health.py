"""Fleet health: one state machine per engine, fed each tick by probes and the router's outcomes.

The driver owns every side effect (probing ``GET /health``, draining the router, restarting processes,
pushing the serving set); this module only decides. Keeping it pure (no I/O, time injected through a
clock callable) is what lets every transition below be unit-tested deterministically, and lets the
same object be replayed from an event log when a failure needs explaining. It judges the engines the job
started; those a trainer registers (``generation.owner: trainer``) are not ours to restart, and the router
judges them with its own probes (``launcher.fleet.registered`` names their states for the dashboard).

Engine identity is separate from its URL: an ``EngineRecord`` keeps its ``id`` and ``node`` for the
whole run while ``url`` changes on every restart (the replacement listens on a new port). Probe results
and router outcomes are keyed by URL, never by id, so evidence about a previous incarnation (a late
probe of the old port, the router's last failures against it) can never count for the replacement.

States
======

=============  =======  ==================================================================================
State          Serving  Meaning
=============  =======  ==================================================================================
HEALTHY        yes      Passing. Every engine starts here: the engine host publishes a URL only after
                        that engine passed its own startup health check.
SUSPECT        yes*     Failed recently; not yet condemned. It keeps its traffic so the router's
                        outcomes can confirm or clear the suspicion: an engine out of rotation gets no
                        requests, so a wedged engine that still passes probes could never be condemned.
                        (*) Held out of rotation while its latest probe failed (an engine that cannot
                        answer ``/health`` would make requests hang until the backend timeout), unless
                        that would leave the router with no backend at all. The hold-out applies to any
                        serving state (``hold_out_failed_probe``); with the default ``suspect_after=1``
                        only a SUSPECT can have a failed latest probe.
DEAD           no       Condemned. Resolved at the next ``observe()`` into RESTARTING or RETIRED.
RESTARTING     no       The driver is replacing the process on the same node (same GPUs). Waits for the
                        driver's ``restarted()`` or ``restart_failed()``; no timer here, because only the
                        driver can cancel an attempt it started.
RECOVERING     no       The replacement is up on its new URL but not readmitted yet. Only probes count
                        (the router sends it nothing, and anything the router reports for that URL
                        belongs to a previous owner of the port).
RETIRED        no       Terminal: a restart budget is spent. The run continues with fewer engines.
DRAINING       no       Leaving the fleet (``rl-launch fleet shrink`` or the tail policy): the router sends
                        it nothing new, its requests in flight finish, then the driver stops it and
                        ``remove``s it. Not probed, never restarted, never fatal: a node on its way back
                        to Slurm is not a failure (``launcher.fleet.elastic``).
STALE          no       Up and answering, but held out by the front because it serves another weight
                        version than the fleet's current one: a restarted engine comes back with the
                        checkpoint's weights while the rest serve newer ones, and rollouts from it would
                        silently come from a stale policy. The front is the one judge of that
                        (``router.fleet.api.FleetApi``: it knows the version the trainer stamped and
                        checks every engine that joins); this state only follows its verdict
                        (``TickInput.stale``), so the controller and the front never disagree on which
                        engines are stale. Left when the front no longer holds it out (the trainer refit
                        and stamped it). Still probed, and may die like any other.
=============  =======  ==================================================================================

Transitions (thresholds are ``HealthPolicy`` fields; defaults in brackets)
=========================================================================

==========================  ===========  =====================================================================
From                        To           When
==========================  ===========  =====================================================================
HEALTHY                     SUSPECT      ``suspect_after`` [1] consecutive failing ticks
SUSPECT                     HEALTHY      ``healthy_after`` [2] consecutive passing ticks
SUSPECT                     DEAD         ``dead_after`` [3] failing ticks since it was last HEALTHY. A lone
                                         passing tick does not reset the count (only a return to HEALTHY
                                         does), so an engine flapping pass/fail cannot stay SUSPECT forever.
HEALTHY/SUSPECT/RECOVERING  DEAD         ``mark_dead(id, reason)``: the driver saw the process exit
DEAD                        RESTARTING   next ``observe()``, if the engine used fewer than
                                         ``restarts_per_engine`` [3] restarts and the run fewer than
                                         ``restarts_per_run`` [2 x initial engines]; consumes one of each;
                                         the id is in ``TickResult.to_restart``
DEAD                        RETIRED      next ``observe()``, when either budget is spent; an event at level
                                         ``error`` names the budget and the cause of death; the id is in
                                         ``TickResult.retired`` (the driver stops what is left of it)
RESTARTING                  RECOVERING   ``restarted(id, new_url)``: the replacement is ready on ``new_url``
RESTARTING                  DEAD         ``restart_failed(id, reason)``
RECOVERING                  HEALTHY      ``recovered_after`` [2] consecutive passing probes: readmitted
                                         (pushed to the front, which checks its weight version on admission)
HEALTHY/SUSPECT             STALE        the front holds it out as stale (``TickInput.stale`` names it)
STALE                       HEALTHY      the front answered and no longer holds it out (refit and stamped)
STALE                       DEAD         ``dead_after`` [3] failing probes, or ``mark_dead``, or the front
                                         says a reload cannot bring its weights back
                                         (``router.fleet.restore.needs_restart``); never for STALE alone
RECOVERING                  DEAD         ``dead_after`` [3] failing probes since the restart, or
                                         ``recovery_timeout_s`` [300] without readmission
any but RETIRED             DRAINING     ``drain(id, reason)``: the fleet is shrinking
DRAINING                    (removed)    ``remove(id)``: drained and stopped; the record is gone
(new)                       HEALTHY      ``add(records)``: engines on a node the fleet grew by; the front
                                         judges their weight version on admission (STALE until refit)
==========================  ===========  =====================================================================

The tick rule
=============

Each tick the two sources are judged separately, because each misses failures the other sees: a wedged
engine can pass ``/health`` while failing every request, and an idle engine gets no requests at all.

* **Probe** (``GET /health`` with a short timeout, done by the driver): passed, failed (a hung probe is a
  failure: the driver reports it as one), or absent (no evidence).
* **Router window** ``(successes, failures)`` drained for the engine's URL over the same window: it
  *fails* when ``failures >= window_min_failures`` [3] **and** ``failures / (successes + failures) >=
  window_failure_fraction`` [0.5]; it *passes* when the fraction is below the threshold; otherwise (no
  traffic, or too few failures to condemn but too many to vouch) it is no evidence. So 3 failures among
  3,000 successes pass (a bad shard or a client's malformed request), 3 failures and no success fail.

A tick **fails** if either source fails, **passes** if neither fails and at least one passes, and is
otherwise no evidence: it leaves every counter alone, so a quiet tick neither condemns nor clears.

Fatal: when no engine is HEALTHY or SUSPECT and none is DEAD (about to restart), RESTARTING or
RECOVERING, nothing can ever serve again; ``TickResult.fatal`` carries the reason and the driver fails
the job with it instead of hanging with a router that answers "no backend" forever.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any, TypedDict

from router.fleet.restore import needs_restart
from router.state.backends import canonical_backend_url


class EngineState(StrEnum):
    HEALTHY = "HEALTHY"
    SUSPECT = "SUSPECT"
    DEAD = "DEAD"
    RESTARTING = "RESTARTING"
    RECOVERING = "RECOVERING"
    RETIRED = "RETIRED"
    STALE = "STALE"
    DRAINING = "DRAINING"


#: States whose engine is in the router's serving set (SUSPECT subject to the probe hold-out).
SERVING_STATES = frozenset({EngineState.HEALTHY, EngineState.SUSPECT})
#: States from which an engine may still serve again: while any engine is in one, the run is not lost.
PENDING_STATES = frozenset(
    {EngineState.DEAD, EngineState.RESTARTING, EngineState.RECOVERING, EngineState.STALE}
)


class Verdict(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    NONE = "none"  # no evidence either way: counters untouched


@dataclass(frozen=True)
class HealthPolicy:
    """Every threshold of the state machine (see the module docstring for where each one acts)."""

    suspect_after: int = 1
    dead_after: int = 3
    healthy_after: int = 2
    recovered_after: int = 2
    recovery_timeout_s: float = 300.0
    window_min_failures: int = 3
    window_failure_fraction: float = 0.5
    hold_out_failed_probe: bool = True
    restarts_per_engine: int = 3
    restarts_per_run: int | None = None  # None: 2 x the fleet's initial size

    def __post_init__(self) -> None:
        if not 1 <= self.suspect_after < self.dead_after:
            raise ValueError(
                f"need 1 <= suspect_after < dead_after, got suspect_after={self.suspect_after}, "
                f"dead_after={self.dead_after}"
            )
        for name in ("healthy_after", "recovered_after", "window_min_failures"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.window_failure_fraction <= 1.0:
            raise ValueError(f"window_failure_fraction must be in (0, 1], got {self.window_failure_fraction}")
        if self.recovery_timeout_s <= 0:
            raise ValueError(f"recovery_timeout_s must be > 0, got {self.recovery_timeout_s}")
        if self.restarts_per_engine < 0:
            raise ValueError(f"restarts_per_engine must be >= 0, got {self.restarts_per_engine}")
        if self.restarts_per_run is not None and self.restarts_per_run < 0:
            raise ValueError(f"restarts_per_run must be >= 0, got {self.restarts_per_run}")

    def run_budget(self, engines: int) -> int:
        return 2 * engines if self.restarts_per_run is None else self.restarts_per_run


@dataclass(frozen=True)
class ProbeResult:
    """One ``GET /health``: ``ok`` for a 2xx in time; ``detail`` says why not ("timeout after 2 s")."""

    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class Evidence:
    """One engine's judged tick."""

    verdict: Verdict
    reason: str
    probe_ok: bool | None = None


def judge_window(successes: int, failures: int, policy: HealthPolicy) -> Verdict:
    """The router window's verdict: a minimum count *and* a fraction, so neither a handful of failures
    in heavy traffic nor a single failure in light traffic condemns an engine."""
    total = successes + failures
    if total <= 0:
        return Verdict.NONE
    fraction = failures / total
    if failures >= policy.window_min_failures and fraction >= policy.window_failure_fraction:
        return Verdict.FAIL
    if fraction < policy.window_failure_fraction:
        return Verdict.PASS
    return Verdict.NONE


def judge_tick(probe: ProbeResult | None, window: tuple[int, int] | None, policy: HealthPolicy) -> Evidence:
    """Either source failing fails the tick; it passes only if neither fails and one passes."""
    bad: list[str] = []
    good: list[str] = []
    if probe is not None:
        if probe.ok:
            good.append("health probe passed")
        else:
            bad.append("health probe failed" + (f": {probe.detail}" if probe.detail else ""))
    if window is not None:
        s, f = window
        verdict = judge_window(s, f, policy)
        if verdict is Verdict.FAIL:
            bad.append(
                f"router saw {f} failure(s) and {s} success(es) in the window "
                f"({f / (s + f):.0%} >= {policy.window_failure_fraction:.0%}, "
                f">= {policy.window_min_failures} failures)"
            )
        elif verdict is Verdict.PASS:
            good.append(f"router saw {s} success(es), {f} failure(s)")
    probe_ok = None if probe is None else probe.ok
    if bad:
        return Evidence(Verdict.FAIL, "; ".join(bad), probe_ok)
    if good:
        return Evidence(Verdict.PASS, "; ".join(good), probe_ok)
    return Evidence(Verdict.NONE, "no evidence this tick", probe_ok)


class FleetEvent(TypedDict):
    """One state change, as the driver appends it to ``events.jsonl``."""

    time: float
    engine_id: str
    node: str
    url: str
    from_state: str
    to_state: str
    reason: str
    restarts: int
    level: str  # "info" | "warning" | "error": how loudly the driver and dashboard should say it


_LEVELS = {
    EngineState.SUSPECT: "warning",
    EngineState.DEAD: "warning",
    EngineState.RESTARTING: "warning",
    EngineState.RETIRED: "error",
    EngineState.STALE: "warning",
    EngineState.DRAINING: "info",
}


@dataclass
class EngineRecord:
    """One engine for the whole run: ``id`` and ``node`` never change, ``url`` does on every restart.

    ``strikes`` counts failing ticks since the engine was last clean (a passing tick while HEALTHY,
    readmission, or a restart); DEAD is decided on it rather than on ``consecutive_failures`` so that
    pass/fail flapping still ends in a restart.
    """

    id: str
    node: str
    url: str
    state: EngineState = EngineState.HEALTHY
    restarts: int = 0
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    strikes: int = 0
    last_reason: str = ""
    since: float = 0.0
    last_probe_ok: bool | None = None
    last_window: tuple[int, int] = (0, 0)
    previous_urls: list[str] = field(default_factory=list)


@dataclass
class TickInput:
    """What the driver gathered this tick, both keyed by URL (any form ``canonical_backend_url``
    accepts). URLs that name no current engine (an old port, a retired engine) are ignored."""

    probes: Mapping[str, ProbeResult | bool] = field(default_factory=dict)
    outcomes: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    stale: Mapping[str, str] | None = None
    """``{url: why}`` for the engines the front holds out as stale (``Gateway.stale_engines``; a front
    that does not guard weight versions holds none). ``None``: the front did not answer this tick, which
    is no evidence: no engine enters or leaves STALE on it (a restarting front must not readmit them)."""


@dataclass
class TickResult:
    """What the driver must do now.

    ``serving_urls`` is always the whole serving set (canonical, in registration order), never a delta:
    pushing it every tick lets a restarted router converge at once, and a stable order avoids needless
    policy rebuilds (the router compares the tuple).
    """

    serving_urls: list[str]
    to_restart: list[str]
    retired: list[str]
    events: list[FleetEvent]
    fatal: str | None
    stale_urls: list[str] = field(default_factory=list)
    """STALE engines: up, awaiting a refit (a front that guards versions itself may be told them)."""


class FleetHealth:
    """The fleet's state machines. Thread-safe: the driver's restart threads report outcomes while
    its health loop ticks."""

    RECENT_EVENTS = 50

    def __init__(
        self,
        engines: Iterable[EngineRecord],
        policy: HealthPolicy | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.policy = policy or HealthPolicy()
        self._clock = clock
        self._lock = threading.RLock()
        self._engines: dict[str, EngineRecord] = {}
        now = clock()
        for rec in engines:
            if rec.id in self._engines:
                raise ValueError(f"duplicate engine id {rec.id!r}")
            self._engines[rec.id] = replace(
                rec, url=canonical_backend_url(rec.url), since=now, previous_urls=list(rec.previous_urls)
            )
        if not self._engines:
            raise ValueError("a fleet needs at least one engine")
        self._check_unique_urls()
        self.run_budget = self.policy.run_budget(len(self._engines))
        self.run_restarts = 0
        self._pending: list[FleetEvent] = []
        self._recent: deque[FleetEvent] = deque(maxlen=self.RECENT_EVENTS)

    # -- reading -------------------------------------------------------------------------------------
    def engine(self, engine_id: str) -> EngineRecord:
        """A copy of one engine's record (the machine's own record is never handed out)."""
        with self._lock:
            rec = self._get(engine_id)
            return replace(rec, previous_urls=list(rec.previous_urls))

    def state(self, engine_id: str) -> EngineState:
        with self._lock:
            return self._get(engine_id).state

    def probe_targets(self) -> dict[str, str]:
        """``{engine id: url}`` the driver should probe this tick (``url + "/health"``)."""
        probed = (*SERVING_STATES, EngineState.RECOVERING, EngineState.STALE)
        with self._lock:
            return {r.id: r.url for r in self._engines.values() if r.state in probed}

    def serving_urls(self) -> list[str]:
        with self._lock:
            return self._serving()

    # -- the tick ------------------------------------------------------------------------------------
    def observe(self, tick: TickInput) -> TickResult:
        """Judge one tick for every engine and say what to do. Events include those of the driver's
        reports (``restarted``, ``restart_failed``, ``mark_dead``) since the previous tick."""
        with self._lock:
            now = self._clock()
            probes = _by_url_probes(tick.probes)
            outcomes = _by_url_outcomes(tick.outcomes)
            stale = _by_url_stale(tick.stale)
            for rec in self._engines.values():
                held_out = stale.get(rec.url) if stale is not None else None
                if rec.state in SERVING_STATES:
                    window = outcomes.get(rec.url, (0, 0))
                    rec.last_window = window
                    self._judge_serving(rec, judge_tick(probes.get(rec.url), window, self.policy), now)
                    if rec.state in SERVING_STATES and held_out is not None:
                        self._move(rec, EngineState.STALE, f"held out by the front: {held_out}", now)
                elif rec.state is EngineState.RECOVERING:
                    self._judge_recovering(rec, judge_tick(probes.get(rec.url), None, self.policy), now)
                elif rec.state is EngineState.STALE:
                    evidence = judge_tick(probes.get(rec.url), None, self.policy)
                    self._judge_stale(rec, evidence, stale is not None and held_out is None, held_out, now)
            to_restart: list[str] = []
            retired: list[str] = []
            for rec in self._engines.values():
                if rec.state is EngineState.DEAD:
                    if self._restart_or_retire(rec, now):
                        to_restart.append(rec.id)
                    else:
                        retired.append(rec.id)
            events, self._pending = self._pending, []
            stale = [r.url for r in self._engines.values() if r.state is EngineState.STALE]
            return TickResult(self._serving(), to_restart, retired, events, self._fatal(), stale)

    # -- the driver's reports ------------------------------------------------------------------------
    def restarted(self, engine_id: str, new_url: str) -> None:
        """The replacement is ready on ``new_url`` (report it once the new process passed its own
        startup check, as the engine host does at first start). Readmission waits for the fleet's
        own ``recovered_after`` passing probes."""
        with self._lock:
            rec = self._get(engine_id)
            self._require(rec, EngineState.RESTARTING, "restarted")
            url = canonical_backend_url(new_url)
            live = (*SERVING_STATES, EngineState.RECOVERING)  # a DEAD engine's old port may be reused
            for other in self._engines.values():
                if other.id != rec.id and other.url == url and other.state in live:
                    raise ValueError(f"engine {rec.id!r} restarted on {url}, which engine {other.id!r} uses")
            old = rec.url
            if old != url:
                rec.previous_urls.append(old)
            rec.url = url
            rec.last_probe_ok = None
            rec.last_window = (0, 0)
            self._reset_counters(rec)
            self._move(
                rec,
                EngineState.RECOVERING,
                f"restarted on {url} (was {old}); readmitted after "
                f"{self.policy.recovered_after} passing health checks",
                self._clock(),
            )

    def restart_failed(self, engine_id: str, reason: str) -> None:
        """The restart did not produce a ready engine. The next tick restarts it again (one more unit
        of budget) or retires it."""
        with self._lock:
            rec = self._get(engine_id)
            self._require(rec, EngineState.RESTARTING, "restart_failed")
            self._move(rec, EngineState.DEAD, f"restart failed: {reason}", self._clock())

    def mark_dead(self, engine_id: str, reason: str) -> bool:
        """Condemn at once on certain knowledge (the driver saw the process exit) instead of waiting
        ``dead_after`` ticks. False, and nothing changes, when the engine is not HEALTHY, SUSPECT,
        RECOVERING or STALE: an exit while RESTARTING belongs to ``restart_failed``."""
        with self._lock:
            rec = self._get(engine_id)
            if rec.state not in (*SERVING_STATES, EngineState.RECOVERING, EngineState.STALE):
                return False
            self._move(rec, EngineState.DEAD, reason, self._clock())
            return True

    # -- the fleet's size (``launcher.fleet.elastic``) -----------------------------------------------------
    def add(self, engines: Iterable[EngineRecord], reason: str) -> None:
        """Engines that join a running fleet (a node it grew by), HEALTHY like every engine at start (the
        engine host published them after their own startup check). Checked whole before anything joins: a
        refused add changes nothing. A URL may be one a DEAD or RETIRED engine had (its port was freed),
        never one a live engine uses. The run's restart budget grows by what the new engines would have
        brought at start, so a bigger fleet is not on a smaller per-engine budget."""
        with self._lock:
            now = self._clock()
            added = [
                replace(
                    rec,
                    url=canonical_backend_url(rec.url),
                    state=EngineState.HEALTHY,
                    since=now,
                    previous_urls=list(rec.previous_urls),
                )
                for rec in engines
            ]
            gone = (EngineState.DEAD, EngineState.RETIRED)
            live_urls = {r.url: r.id for r in self._engines.values() if r.state not in gone}
            ids: set[str] = set()
            for rec in added:
                if rec.id in self._engines or rec.id in ids:
                    raise ValueError(f"duplicate engine id {rec.id!r}")
                if rec.url in live_urls:
                    raise ValueError(f"engines {live_urls[rec.url]!r} and {rec.id!r} share the URL {rec.url}")
                ids.add(rec.id)
                live_urls[rec.url] = rec.id
            for rec in added:
                self._engines[rec.id] = rec
            if self.policy.restarts_per_run is None:
                self.run_budget += self.policy.run_budget(len(added))
            for rec in added:
                self._event(rec, "(new)", EngineState.HEALTHY, reason, now)

    def drain(self, engine_id: str, reason: str) -> bool:
        """Take the engine out of the serving set for good (it is leaving the fleet). False, and nothing
        changes, when it is DRAINING already or RETIRED (a retired engine has nothing left to drain)."""
        with self._lock:
            rec = self._get(engine_id)
            if rec.state in (EngineState.DRAINING, EngineState.RETIRED):
                return False
            self._move(rec, EngineState.DRAINING, reason, self._clock())
            return True

    def remove(self, engine_id: str, reason: str) -> None:
        """Forget a drained (or retired) engine: it is stopped and its node went back to Slurm."""
        with self._lock:
            rec = self._get(engine_id)
            if rec.state not in (EngineState.DRAINING, EngineState.RETIRED):
                raise ValueError(f"remove({engine_id!r}) while the engine is {rec.state}, not DRAINING")
            self._event(rec, str(rec.state), None, reason, self._clock())
            del self._engines[engine_id]

    def _event(
        self, rec: EngineRecord, from_state: str, to: EngineState | None, reason: str, now: float
    ) -> None:
        """A membership event (joined: ``from_state`` "(new)"; left: ``to`` None, "(removed)")."""
        event: FleetEvent = {
            "time": now,
            "engine_id": rec.id,
            "node": rec.node,
            "url": rec.url,
            "from_state": from_state,
            "to_state": str(to) if to is not None else "(removed)",
            "reason": reason,
            "restarts": rec.restarts,
            "level": "info",
        }
        self._pending.append(event)
        self._recent.append(event)

    # -- for the status endpoint ---------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Everything the status endpoint and dashboard show, JSON-serialisable as is."""
        with self._lock:
            serving = set(self._serving())
            run_left = self.run_budget - self.run_restarts
            engines = [
                {
                    "id": r.id,
                    "node": r.node,
                    "url": r.url,
                    "state": str(r.state),
                    "serving": r.url in serving and r.state in SERVING_STATES,
                    "since": r.since,
                    "restarts": r.restarts,
                    "restarts_left": max(0, min(self.policy.restarts_per_engine - r.restarts, run_left)),
                    "consecutive_failures": r.consecutive_failures,
                    "consecutive_successes": r.consecutive_successes,
                    "strikes": r.strikes,
                    "last_reason": r.last_reason,
                    "last_probe_ok": r.last_probe_ok,
                    "last_window": {"successes": r.last_window[0], "failures": r.last_window[1]},
                    "previous_urls": list(r.previous_urls),
                }
                for r in self._engines.values()
            ]
            totals: dict[str, int] = {str(s): 0 for s in EngineState}
            for r in self._engines.values():
                totals[str(r.state)] += 1
            totals["engines"] = len(self._engines)
            totals["serving"] = len(serving)
            return {
                "time": self._clock(),
                "fatal": self._fatal(),
                "engines": engines,
                "totals": totals,
                "budget": {
                    "per_engine": self.policy.restarts_per_engine,
                    "run_total": self.run_budget,
                    "run_used": self.run_restarts,
                    "run_left": run_left,
                },
                "policy": asdict(self.policy),
                "recent_events": [dict(e) for e in self._recent],
            }

    # -- internals -----------------------------------------------------------------------------------
    def _get(self, engine_id: str) -> EngineRecord:
        try:
            return self._engines[engine_id]
        except KeyError:
            raise ValueError(f"unknown engine id {engine_id!r}") from None

    @staticmethod
    def _require(rec: EngineRecord, state: EngineState, call: str) -> None:
        if rec.state is not state:
            raise ValueError(f"{call}({rec.id!r}) while the engine is {rec.state}, not {state}")

    def _check_unique_urls(self) -> None:
        seen: dict[str, str] = {}
        for rec in self._engines.values():
            if rec.url in seen:
                raise ValueError(f"engines {seen[rec.url]!r} and {rec.id!r} share the URL {rec.url}")
            seen[rec.url] = rec.id

    @staticmethod
    def _reset_counters(rec: EngineRecord) -> None:
        rec.consecutive_failures = rec.consecutive_successes = rec.strikes = 0

    def _move(self, rec: EngineRecord, to: EngineState, reason: str, now: float) -> None:
        event: FleetEvent = {
            "time": now,
            "engine_id": rec.id,
            "node": rec.node,
            "url": rec.url,
            "from_state": str(rec.state),
            "to_state": str(to),
            "reason": reason,
            "restarts": rec.restarts,
            "level": _LEVELS.get(to, "info"),
        }
        rec.state = to
        rec.since = now
        rec.last_reason = reason
        self._pending.append(event)
        self._recent.append(event)

    @staticmethod
    def _count(rec: EngineRecord, evidence: Evidence) -> None:
        if evidence.probe_ok is not None:
            rec.last_probe_ok = evidence.probe_ok
        if evidence.verdict is Verdict.FAIL:
            rec.consecutive_failures += 1
            rec.consecutive_successes = 0
            rec.strikes += 1
            rec.last_reason = evidence.reason
        elif evidence.verdict is Verdict.PASS:
            rec.consecutive_successes += 1
            rec.consecutive_failures = 0

    def _judge_serving(self, rec: EngineRecord, evidence: Evidence, now: float) -> None:
        p = self.policy
        self._count(rec, evidence)
        if evidence.verdict is Verdict.FAIL:
            if rec.state is EngineState.HEALTHY and rec.consecutive_failures >= p.suspect_after:
                self._move(rec, EngineState.SUSPECT, evidence.reason, now)
            elif rec.state is EngineState.SUSPECT and rec.strikes >= p.dead_after:
                self._move(
                    rec,
                    EngineState.DEAD,
                    f"{rec.strikes} failing ticks since last healthy; last: {evidence.reason}",
                    now,
                )
        elif evidence.verdict is Verdict.PASS:
            if rec.state is EngineState.HEALTHY:
                rec.strikes = 0
            elif rec.consecutive_successes >= p.healthy_after:
                rec.strikes = 0
                self._move(
                    rec,
                    EngineState.HEALTHY,
                    f"{rec.consecutive_successes} passing ticks: {evidence.reason}",
                    now,
                )

    def _judge_stale(
        self, rec: EngineRecord, evidence: Evidence, readmitted: bool, held_out: str | None, now: float
    ) -> None:
        """``readmitted``: the front answered and no longer holds it out; ``held_out``: its reason now
        (the front's verdict replaces "not verified yet" once it checked the engine's version)."""
        self._count(rec, evidence)
        if evidence.verdict is Verdict.FAIL and rec.strikes >= self.policy.dead_after:
            self._move(rec, EngineState.DEAD, f"stale engine failed {rec.strikes} health checks", now)
        elif held_out is not None and needs_restart(held_out):
            self._move(rec, EngineState.DEAD, f"held out by the front: {held_out}", now)
        elif readmitted:
            self._reset_counters(rec)
            self._move(rec, EngineState.HEALTHY, "readmitted by the front: refit to the fleet's version", now)
        elif held_out is not None and evidence.verdict is not Verdict.FAIL:
            rec.last_reason = f"held out by the front: {held_out}"

    def _judge_recovering(self, rec: EngineRecord, evidence: Evidence, now: float) -> None:
        p = self.policy
        self._count(rec, evidence)
        if evidence.verdict is Verdict.PASS and rec.consecutive_successes >= p.recovered_after:
            rec.strikes = 0
            self._move(
                rec,
                EngineState.HEALTHY,
                f"readmitted on {rec.url} after {rec.consecutive_successes} passing health checks",
                now,
            )
        elif evidence.verdict is Verdict.FAIL and rec.strikes >= p.dead_after:
            self._move(
                rec,
                EngineState.DEAD,
                f"replacement on {rec.url} failed {rec.strikes} health checks; last: {evidence.reason}",
                now,
            )
        elif now - rec.since >= p.recovery_timeout_s:
            self._move(
                rec,
                EngineState.DEAD,
                f"replacement on {rec.url} not readmitted within {p.recovery_timeout_s:g} s "
                f"({rec.consecutive_successes}/{p.recovered_after} passing checks)",
                now,
            )

    def _restart_or_retire(self, rec: EngineRecord, now: float) -> bool:
        """DEAD -> RESTARTING (consuming budget) or RETIRED; True when the driver must restart it."""
        p = self.policy
        cause = rec.last_reason
        if rec.restarts >= p.restarts_per_engine:
            self._move(
                rec,
                EngineState.RETIRED,
                f"restart budget spent: engine restarted {rec.restarts}/{p.restarts_per_engine} times; "
                f"the run continues without it. It died: {cause}",
                now,
            )
            return False
        if self.run_restarts >= self.run_budget:
            self._move(
                rec,
                EngineState.RETIRED,
                f"run restart budget spent: {self.run_restarts}/{self.run_budget} restarts used by the "
                f"fleet; the run continues without it. It died: {cause}",
                now,
            )
            return False
        rec.restarts += 1
        self.run_restarts += 1
        self._reset_counters(rec)
        self._move(
            rec,
            EngineState.RESTARTING,
            f"restart {rec.restarts}/{p.restarts_per_engine} (run {self.run_restarts}/{self.run_budget}) "
            f"on {rec.node}; it died: {cause}",
            now,
        )
        return True

    def _serving(self) -> list[str]:
        candidates = [r for r in self._engines.values() if r.state in SERVING_STATES]
        if not self.policy.hold_out_failed_probe:
            return [r.url for r in candidates]
        answering = [r.url for r in candidates if r.last_probe_ok is not False]
        # An empty set makes the router refuse every request; an engine that failed one probe may still
        # answer (a driver too busy to probe in time fails every probe at once).
        return answering or [r.url for r in candidates]

    def _fatal(self) -> str | None:
        states = [r.state for r in self._engines.values()]
        if any(s in SERVING_STATES or s in PENDING_STATES for s in states):
            return None
        retired = [r for r in self._engines.values() if r.state is EngineState.RETIRED]
        shown = "; ".join(f"{r.id} on {r.node}: {r.last_reason}" for r in retired[:3])
        more = f"; and {len(retired) - 3} more" if len(retired) > 3 else ""
        draining = len(states) - len(retired)
        what = f"all {len(states)} engine(s) are RETIRED"
        if draining:
            what = f"{len(retired)} engine(s) are RETIRED and {draining} DRAINING (leaving the fleet)"
        return (
            f"no engine can serve: {what} "
            f"({self.run_restarts}/{self.run_budget} run restarts used). {shown}{more}"
        )


def _by_url_probes(probes: Mapping[str, ProbeResult | bool]) -> dict[str, ProbeResult]:
    out: dict[str, ProbeResult] = {}
    for url, probe in probes.items():
        result = probe if isinstance(probe, ProbeResult) else ProbeResult(bool(probe))
        key = canonical_backend_url(url)
        previous = out.get(key)
        # Two spellings of one URL (".../v1" and bare): a failure on either is a failure.
        out[key] = result if previous is None or previous.ok else previous
    return out


def _by_url_outcomes(outcomes: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for url, (s, f) in outcomes.items():
        key = canonical_backend_url(url)
        ps, pf = out.get(key, (0, 0))
        out[key] = (ps + int(s), pf + int(f))
    return out


def _by_url_stale(stale: Mapping[str, str] | None) -> dict[str, str] | None:
    return None if stale is None else {canonical_backend_url(u): why for u, why in stale.items()}
