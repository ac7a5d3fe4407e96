"""The router's ``/fleet/*`` admin routes: the refit window for the whole fleet through one front.

Between RL steps a trainer pauses every engine, updates weights, flushes caches, stamps a new weight
version and resumes. Each route fans one engine call out to every engine (``router.fleet.ops``) and
answers 200 only when every engine complied, else 500 with the per-engine report: a trainer must never
go on believing the fleet was paused, stamped or resumed when one engine was not.

The router's own part:

* **Pause** closes the ``PauseGate`` *before* pausing the engines (no request slips in between), so new
  generation requests are held in the router; **resume** resumes the engines first and then releases
  the held requests in arrival order.
* **Weight version**: the router remembers the fleet's current version once the trainer stamped one.
  From then on an engine that joins the serving set (a restarted engine comes back on the checkpoint's
  weights and version) is held out as *stale* until its ``/weight_info`` shows the current version;
  ``GET /fleet/stale`` tells the trainer which engines need a refit, and stamping them
  (``POST /fleet/weight_version`` with ``engines``) readmits them. Before the first stamp nothing is held
  out (every engine serves the checkpoint). When the fleet's weights are in a directory it verified, it
  restores such an engine itself (``router.fleet.restore``), as it does the engines a refit quarantined.
* **Step metrics**: ``POST /fleet/step/begin`` snapshots the engines' counters, ``GET /fleet/step``
  answers the delta since then (``router.fleet.engine_counters``). Each caller (the owner, each
  consumer's account) has its own step: on a fleet of LoRA tenants one trainer's new step reset the
  step another trainer was measuring. The counters are the engines', so a step's figures are the whole
  fleet's, every tenant's requests included.

All routes are registered as admin routes (``router.http.auth.Access.ADMIN``). Every call to an engine
goes through ``router.fleet.engine.EngineClient``, which presents the engine key (``backend_api_key``).
What the routes, the refit transaction and the restores share (backends, engine key, current version,
the fan-out) is one ``router.fleet.fleet.Fleet`` view, which each of them takes: nothing below calls back
into this class.

This is the fleet's one judge of staleness: the fleet controller (``launcher.fleet.controller``) does not
compare versions itself; its STALE state follows what this API holds out (``BackendSet.stale``), read
through the front (``Gateway.stale_engines``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import orjson
from aiohttp import web

from router.fleet.adapter_refit import AdapterRefits
from router.fleet.control_session import ControlSession
from router.fleet.engine import PAUSE_MODES, EngineClient
from router.fleet.engine_counters import Snapshot, delta, step_dict
from router.fleet.fleet import ENGINE_TIMEOUT_S, Fleet
from router.fleet.ops import FleetOpReport, compare_checksums, fan_out
from router.fleet.refit import RefitCoordinator
from router.fleet.refit_routes import RefitRoutes
from router.fleet.restore import Restorer
from router.fleet.vllm_control import ControlApi
from router.http.auth import Access, RouteTable, account_of, holder_of
from router.state.backends import BackendSet, canonical_backend_url
from router.state.pause_gate import PauseGate

log = logging.getLogger(__name__)


COUNTERS_TIMEOUT_S = 15.0
"""How long a read of the engines' counters waits (a step's metrics must not stall the trainer long)."""
MAX_STEP_CALLERS = 1024
"""Callers whose steps are kept (one per consumer account and the owner; a consumers file lists fewer)."""


@dataclass(frozen=True, slots=True)
class StepMark:
    """Where one caller's step began: its number, when, the engines' counters, the straddlers' count."""

    number: int
    started: float
    snapshot: Snapshot
    straddled: int


def _json(status: int, payload: object) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


def _answer(report: FleetOpReport) -> web.Response:
    return _json(200 if report.ok else 500, report.to_json())


def _bad(message: str) -> web.Response:
    return _json(400, {"ok": False, "error": message})


class FleetApi:
    def __init__(
        self,
        backends: BackendSet,
        gate: PauseGate,
        backend_api_key: str | None = None,
        engine_timeout_s: float = ENGINE_TIMEOUT_S,
        holds_requests: bool = True,
    ) -> None:
        """``holds_requests``: False where no request passes through this process (the driver's fleet
        endpoint beside vllm-router): the engines then hold new requests during a pause, not the gate."""
        self.fleet = Fleet(backends, backend_api_key, engine_timeout_s)
        self.backends = backends
        self.holds_requests = holds_requests
        self.gate = gate
        self.pause_holder: str | None = None
        """The consumer whose key made the plain pause in force (None: the owner, or no pause): revoking
        that key resumes the fleet (``end_held_by``)."""
        self._verifying: set[asyncio.Task[None]] = set()
        self._steps: dict[str, StepMark] = {}
        """Each caller's current step (``account_of``), the most recently begun last."""
        backends.admission = self._on_new_member
        self.refit = RefitCoordinator(self.fleet, gate, holds_requests=holds_requests)
        self.refit_routes = RefitRoutes(self.fleet, self.refit)
        self.restorer = Restorer(self.fleet, self.refit)
        self.refit.on_held_out = self.restorer.request_all
        self.refit.restores_pending = lambda: bool(self.restorer.pending())
        self.adapter_refits: AdapterRefits | None = None
        """The fleet's adapter transactions (set where the router serves LoRA adapters): the control
        URL's ``/v1/load_lora_adapter`` runs them."""
        self.control = ControlApi(
            ControlSession(self.fleet, self.refit, self.refit_routes, gate), lambda: self.adapter_refits
        )

    @property
    def current_version(self) -> str | None:
        """The fleet's weight version (``Fleet.current_version``)."""
        return self.fleet.current_version

    @current_version.setter
    def current_version(self, version: str | None) -> None:
        self.fleet.current_version = version

    def add_routes(self, target: RouteTable | web.Application, tenants: bool = False) -> None:
        """Every route here is an admin route (``router.http.auth``). ``target``: the router's table, or an
        application of the driver's, whose table is then made on it. ``tenants``: a fleet of LoRA
        tenants (``router.adapters``), whose base weights every tenant's adapter is trained on: the
        routes that pause the fleet or change its base weights are then the fleet owner's alone
        (``Access.OWNER``); an admin consumer changes its own adapters (``/fleet/adapters``)."""
        table = target if isinstance(target, RouteTable) else RouteTable.of(target)
        base = Access.OWNER if tenants else Access.ADMIN
        for method, path, handler, access in (
            ("POST", "/fleet/pause", self.pause, base),
            ("POST", "/fleet/resume", self.resume, base),
            ("GET", "/fleet/is_paused", self.is_paused, Access.ADMIN),
            ("POST", "/fleet/abort", self.abort, base),
            ("GET", "/fleet/weight_version", self.get_version, Access.ADMIN),
            ("POST", "/fleet/weight_version", self.set_version, base),
            ("GET", "/fleet/stale", self.stale, Access.ADMIN),
            ("POST", "/fleet/checksum", self.checksum, Access.ADMIN),
            ("GET", "/fleet/counters", self.counters, Access.ADMIN),
            ("POST", "/fleet/step/begin", self.step_begin, Access.ADMIN),
            ("GET", "/fleet/step", self.step, Access.ADMIN),
        ):
            table.add(method, path, handler, access)
        self.refit_routes.add_routes(table, base)
        self.control.add_routes(table, base)  # vLLM's control API: /control/*
        table.app.on_cleanup.append(self._close)

    async def _close(self, app: web.Application) -> None:
        """At the application's cleanup (the router's shutdown): end the restores still running, which
        would otherwise be destroyed half-way when the loop closes, and the ``/server_info`` reads."""
        await self.restorer.close()
        await self.fleet.server_infos.close()

    # -- helpers ----------------------------------------------------------------------------------
    async def _snapshot(self) -> tuple[Snapshot, dict[str, str]]:
        """Every engine's counters now, and ``{url: why}`` for those that could not be read."""
        reads = await fan_out(
            self.fleet.all_engines(),
            lambda e, u: e.counters(u),
            api_key=self.fleet.engine_key,
            timeout_s=COUNTERS_TIMEOUT_S,
        )
        snapshot = {r.url: r.value for r in reads if r.value is not None}
        return snapshot, {r.url: r.error for r in reads if r.value is None}

    # -- pause / resume -----------------------------------------------------------------------------
    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "keep")
        if mode not in PAUSE_MODES:
            return _bad(f"mode={mode!r}: choose one of {', '.join(PAUSE_MODES)}")
        if (busy := self.refit.busy()) is not None:
            return _json(409, {"ok": False, "error": busy})
        self.gate.close(mode)
        self.pause_holder = holder_of(request)
        report = await self.fleet.fan("pause", self.fleet.all_engines(), lambda e, u: e.pause(u, mode))
        report.result = {"mode": mode, "router_holding": self.holds_requests}
        log.info("fleet pause (%s): ok=%s in %.3f s", mode, report.ok, report.took_s)
        return _answer(report)

    async def resume(self, request: web.Request) -> web.Response:
        if (busy := self.refit.busy()) is not None:
            return _json(409, {"ok": False, "error": busy})
        report = await self._resume()
        return _answer(report)

    async def end_held_by(self, holder: str, why: str) -> str | None:
        """``holder``'s key was revoked: abort the refit transaction it began, or resume the plain pause
        it made (nobody would resume it: the fleet would hold every consumer's requests until they time
        out). What was ended, in words, or None when it held nothing."""
        txn = await self.refit.abort_if_held_by(holder, why)
        if txn is not None:
            return f"refit {txn.id} to {txn.version!r} aborted"
        if self.pause_holder == holder and self.gate.stats().paused and self.refit.busy() is None:
            report = await self._resume()
            return f"pause resumed (ok={report.ok})"
        return None

    async def _resume(self) -> FleetOpReport:
        report = await self.fleet.fan("resume", self.fleet.all_engines(), lambda e, u: e.resume(u))
        # Released even when an engine failed to resume: holding every request forever is worse, and
        # the 500 below tells the trainer which engine is still paused.
        figures = self.gate.release()
        report.result = {
            "released": figures["released"],
            "held_longest_wait_s": figures["longest_wait_s"],
            "paused_for_s": figures["paused_for_s"],
        }
        self.pause_holder = None
        log.info("fleet resume: ok=%s, %d held requests released", report.ok, figures["released"])
        return report

    async def is_paused(self, request: web.Request) -> web.Response:
        report = await self.fleet.fan("is_paused", self.fleet.all_engines(), lambda e, u: e.paused_answer(u))
        engines = {a.url: bool(a.body.get("is_paused")) for a in report.engines if a.ok}
        s = self.gate.stats()
        report.result = {
            "router_paused": s.paused,
            "mode": s.mode,
            "engines_paused": engines,
            "paused": s.paused and bool(engines) and all(engines.values()),
            "held": s.held,
            "longest_wait_s": round(s.longest_wait_s, 4),
        }
        return _answer(report)

    async def abort(self, request: web.Request) -> web.Response:
        try:
            body = await self.fleet.read_body(request)
            ids = body.get("request_ids") or []
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                raise ValueError("request_ids must be a list of strings")
        except ValueError as exc:
            return _bad(str(exc))
        report = await self.fleet.fan("abort", self.fleet.all_engines(), lambda e, u: e.abort(u, ids))
        per_engine = {a.url: int(a.body.get("aborted", 0)) for a in report.engines if a.ok and a.body}
        report.result = {
            # Abort-all counts what each engine actually held; an abort by ids is acknowledged per id by
            # every engine (vLLM does not say which engine held it), so no fleet sum is claimed then.
            "aborted": sum(per_engine.values()) if not ids else None,
            "per_engine": per_engine,
            "request_ids": ids,
        }
        return _answer(report)

    # -- weight version ----------------------------------------------------------------------------
    async def get_version(self, request: web.Request) -> web.Response:
        report = await self.fleet.fan(
            "weight_version", self.fleet.all_engines(), lambda e, u: e.weight_info(u)
        )
        versions = {a.url: a.body["weight_version"] for a in report.engines if a.ok}
        report.result = {
            "current": self.current_version,
            "engines": versions,
            "stale": self.backends.stale,
        }
        serving = set(self.backends.serving)
        if self.current_version is not None:
            off = [u for u, v in versions.items() if u in serving and v != self.current_version]
            if off:
                report.error = f"serving engines not on version {self.current_version!r}: {off}"
        elif len(set(versions.values())) > 1:
            report.error = f"engines disagree on the weight version: {versions}"
        return _answer(report)

    async def set_version(self, request: web.Request) -> web.Response:
        """``{"version": v}`` stamps every serving engine and makes ``v`` the fleet's version;
        ``{"version": v, "engines": [url...]}`` stamps only those (refit stale engines), readmitting each
        whose ``/weight_info`` then shows the fleet's current version."""
        try:
            body = await self.fleet.read_body(request)
            version = body.get("version", self.current_version)
            if not isinstance(version, str) or not version:
                raise ValueError('body needs "version": a non-empty string')
            engines = body.get("engines")
            targets = [canonical_backend_url(u) for u in engines] if engines is not None else None
        except ValueError as exc:
            return _bad(str(exc))
        if (busy := self.refit.busy()) is not None:
            return _json(409, {"ok": False, "error": busy})
        if targets is not None:
            unknown = [u for u in targets if u not in self.backends.members]
            if unknown:
                return _bad(f"not members of the fleet: {unknown}")
            if self.current_version is not None and version != self.current_version:
                return _bad(
                    f"engines are stamped with the fleet's version ({self.current_version!r}); "
                    f"stamp the whole fleet to move it to {version!r}"
                )
        else:
            targets = list(self.backends.serving)
        report = await self.fleet.fan("set_weight_version", targets, lambda e, u: e.stamp(u, version))
        if not any(a.ok for a in report.engines):
            # No engine took it (e.g. none runs in dev mode): holding every engine out would take the
            # whole fleet down for a configuration error; nothing changes and the 500 says why.
            report.error = f"no engine accepted version {version!r}; the fleet's version is unchanged"
            report.result = {"current": self.current_version, "stale": self.backends.stale}
            return _answer(report)
        versions = self.backends.versions
        for a in report.engines:
            if a.ok:
                versions.stamped(a.url, version)
        if engines is None:
            self.current_version = version
            versions.fleet_moved_to(version)
        for a in report.engines:
            if a.ok:
                self.backends.clear_stale(a.url)
            else:
                self.backends.hold_out_stale(a.url, f"stamping version {version!r} failed: {a.detail}")
        report.result = {"current": self.current_version, "stale": self.backends.stale}
        log.info("fleet weight version %r: ok=%s", version, report.ok)
        return _answer(report)

    async def stale(self, request: web.Request) -> web.Response:
        restores = self.restorer.reports()  # each member's last restore attempt: its steps, why it failed
        return _json(
            200, {"current": self.current_version, "stale": self.backends.stale, "restores": restores}
        )

    def _on_new_member(self, url: str) -> bool:
        """An engine joining after the first stamp is held out until its version is checked."""
        if self.current_version is None:
            return False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not serving yet or any more: held out, checked when stamped
            return True
        task = loop.create_task(self._verify(url))
        self._verifying.add(task)
        task.add_done_callback(self._verifying.discard)
        return True

    async def _verify(self, url: str) -> None:
        wanted = self.current_version
        async with EngineClient.open(self.fleet.engine_key, self.fleet.engine_timeout_s) as engines:
            a = await engines.weight_info(url)
        if url not in self.backends.members:
            return
        if a.ok and a.body["weight_version"] is not None:
            self.backends.versions.stamped(url, str(a.body["weight_version"]))
        if a.ok and a.body["weight_version"] == wanted == self.current_version:
            self.backends.clear_stale(url)
            log.info("engine %s serves the current weight version %r: admitted", url, wanted)
        else:
            got = a.body.get("weight_version") if a.ok else a.detail
            self.backends.hold_out_stale(url, f"serves version {got!r}, the fleet is on {wanted!r}")
            log.warning("engine %s is stale (%r, fleet on %r): held out, to be restored", url, got, wanted)
            self.restorer.request(url)

    # -- checksums -----------------------------------------------------------------------------------
    async def checksum(self, request: web.Request) -> web.Response:
        report = await self.fleet.fan("checksum", list(self.backends.serving), lambda e, u: e.checksum(u))
        report.result, report.error = compare_checksums(report.engines)
        for a in report.engines:
            a.body = None  # the per-parameter tables are large; the groups say what matters
        return _answer(report)

    # -- counters and steps ----------------------------------------------------------------------------
    async def counters(self, request: web.Request) -> web.Response:
        snap, errors = await self._snapshot()
        return _json(200 if not errors else 500, {**step_dict(snap), "errors": errors})

    async def step_begin(self, request: web.Request) -> web.Response:
        caller = account_of(request)
        snap, errors = await self._snapshot()
        before = self._steps.pop(caller, None)
        mark = StepMark(
            number=(before.number if before else 0) + 1,
            started=time.time(),
            snapshot=snap,
            straddled=self.backends.versions.step_mark(),
        )
        self._steps[caller] = mark
        while len(self._steps) > MAX_STEP_CALLERS:  # revoked consumers' steps go, the oldest first
            self._steps.pop(next(iter(self._steps)))
        return _json(200 if not errors else 500, {"step": mark.number, "errors": errors})

    async def step(self, request: web.Request) -> web.Response:
        mark = self._steps.get(account_of(request))
        if mark is None:
            return _json(409, {"ok": False, "error": "no step begun: POST /fleet/step/begin first"})
        now, errors = await self._snapshot()
        out = step_dict(delta(mark.snapshot, now))
        out.update(step=mark.number, started_at=mark.started, seconds=time.time() - mark.started)
        # Requests that straddled a weight change this step (router.state.versions), by request id.
        out["straddled"] = self.backends.versions.straddlers_since(mark.straddled)
        return _json(200 if not errors else 500, {**out, "errors": errors})
