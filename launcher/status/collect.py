"""Gather one job's status as a plain, JSON-able dict: the job directory, Slurm, and ``/metrics`` scrapes.

Everything the dashboard shows comes from here, and ``rl-launch status --json`` prints exactly this dict,
so scripts and the screen can never disagree. Sources, in order of trust:

* the job directory (``state.json``, ``events.jsonl``, ``engines/node-*.urls.json``, ``result.json``),
  written by the driver and, once it exists, the fleet-health controller (``state.json["fleet"]``);
* Slurm (``squeue``/``sacct``), only for Slurm jobs, cached for a few seconds because it is the one
  source that can be slow on a busy controller;
* the router's and every engine's Prometheus ``/metrics``, scraped concurrently with a short timeout.

Credentials go only to addresses the job's own files name, and never on through a redirect: the job's API
key to its engines (the rows come from ``state.json``/the engine listings; engines may require the key on
``/metrics``), the admin token only to the job's ``fleet_url`` (recorded by the driver: the builtin
router's own URL, or the driver's fleet endpoint beside vllm-router), never to ``router_url``, which may be
a front the job does not own (an external vllm-router) whose ``/metrics`` could mimic ours.

Rates (req/s, error rate) and windowed latencies need two scrapes: a ``StatusCollector`` keeps the
previous scrape of every endpoint in memory, so a live dashboard gets them from consecutive frames and
``collect_snapshot`` (``--once``/``--json``) scrapes twice, one interval apart. An endpoint that refuses,
errs or does not answer within the timeout marks its own row and is never waited on longer, so one
wedged engine (or 256 slow ones) cannot freeze the frame.

This module puts the pieces together: ``samples`` fetches and reads one scrape, ``figures`` does the
two-scrape arithmetic, ``sources`` reads the refit window, a standing fleet and the rollouts,
``engine_rows`` turns the job directory's fleet and gateway snapshots
(``launcher.jobdir.records``) into rows, and ``refit`` adds the refit window.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from launcher.fleet.registered import SILENT as REGISTERED_SILENT
from launcher.gateways.kinds import GATEWAY_KINDS
from launcher.jobdir import FINAL_PHASES, LOST, FleetSnapshot, GatewaySnapshot, JobDir, lost_detail, read_json
from launcher.status.elastic import elastic_view
from launcher.status.engine_rows import EXPECTED_SILENT, final_rows, fleet_engines, gateway_view
from launcher.status.figures import (
    bucket_delta,
    counter_rate,
    finite,
    lowest_bucket_bound,
    rounded,
    windowed_ratio,
)
from launcher.status.registered_rows import JUDGED_SOURCE, judge_registered_rows
from launcher.status.samples import EngineSample, RouterSample, Scrape, canonical_url, fetch_metrics
from launcher.status.sources import JobSources
from router.fleet.engine import EngineClient
from router.prometheus import histogram_quantile

SNAPSHOT_VERSION = 1

CONDITIONS = ("queued", "starting", "running", "unreachable", "finished")


# -- the collector --------------------------------------------------------------------------------------
def default_slurm_state(job_id: str) -> str:
    """Slurm's word on the job ('?' without Slurm tools); the same lookup ``rl-launch list`` uses."""
    from launcher.slurm.queue import describe_state

    return describe_state(job_id)


def _final_slurm_states() -> frozenset[str]:
    from launcher.slurm.queue import FINAL_STATES

    return FINAL_STATES


class StatusCollector(JobSources):
    """Builds snapshots of one job, remembering the previous scrape of every endpoint for rates.

    ``job_dir`` may be None for a Slurm job that is still queued: its directory does not exist until
    the driver starts on the allocation, and Slurm is then the only source. Use as an async context
    manager (or call ``aclose``) so the HTTP session's connections are closed.
    """

    def __init__(
        self,
        job_dir: Path | None,
        *,
        name: str | None = None,
        slurm_job_id: str | None = None,
        timeout_s: float = 1.0,
        history: int = 120,
        events: int = 8,
        slurm_state_fn: Callable[[str], str] | None = None,
        slurm_ttl_s: float = 10.0,
    ) -> None:
        self.job_dir = Path(job_dir) if job_dir is not None else None
        self.name = name or (self.job_dir.name if self.job_dir is not None else str(slurm_job_id))
        if slurm_job_id is None and self.job_dir is not None:
            slurm_job_id = JobDir(self.job_dir).slurm_job_id()
        self.slurm_job_id = slurm_job_id
        self.timeout_s = timeout_s
        self.events = events
        self.history: deque[float] = deque(maxlen=history)
        self._slurm_state_fn = slurm_state_fn or default_slurm_state
        self._slurm_ttl_s = slurm_ttl_s
        self._slurm_cache: tuple[float, str] | None = None
        self._prev_router: RouterSample | None = None
        self._prev_engines: dict[str, EngineSample] = {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> StatusCollector:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No connection limit: every engine is scraped at once, and keep-alive connections make the
            # next frame's scrapes cheap. trust_env off: a login node's HTTP proxy must not see (or
            # break) scrapes of cluster-internal addresses.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                trust_env=False,
            )
        return self._session

    async def _fetch_router(self, base_url: str) -> Scrape:
        """The front's ``GET /metrics`` on the shared session (``samples.fetch_metrics``: never raises)."""
        return await fetch_metrics(self._http(), base_url, self.timeout_s)

    async def _fetch_engine(self, engines: EngineClient, url: str) -> Scrape:
        """An engine's ``GET /metrics`` through the engine client (the job's key, no redirect, a short
        reason when nothing came back)."""
        got = await engines.metrics_text(url.rstrip("/"))
        return got.value, got.error or None, time.monotonic()

    async def _slurm_state(self) -> str | None:
        if self.slurm_job_id is None:
            return None
        now = time.monotonic()
        if self._slurm_cache is not None and now - self._slurm_cache[0] < self._slurm_ttl_s:
            return self._slurm_cache[1]
        try:
            state = await asyncio.to_thread(self._slurm_state_fn, self.slurm_job_id)
        except Exception as exc:  # Slurm trouble must not take the dashboard down
            state = f"? ({type(exc).__name__})"
        state = (state or "?").strip() or "?"
        self._slurm_cache = (now, state)
        return state

    async def _nothing(self) -> Scrape:
        return None, None, time.monotonic()

    async def collect(self) -> dict[str, Any]:
        """One snapshot (see the module docstring for its sources). Rates are None on the first call."""
        now = time.time()
        jd = JobDir(self.job_dir) if self.job_dir is not None else None
        state = jd.read_state() if jd is not None else {}
        submitted = jd.read_submitted() if jd is not None else None
        result = read_json(jd.result_file) if jd is not None else None
        start_t, events = jd.read_event_tail(self.events) if jd is not None else (None, [])
        fleet = FleetSnapshot.from_state(state)
        engines, source, problems = fleet_engines(fleet, self.job_dir)
        gateway_snapshot = GatewaySnapshot.from_state(state)
        registered = source == "listing" and jd is not None and bool(jd.read_registration_capability())
        judged = judge_registered_rows(engines, gateway_snapshot) if registered else []
        source = JUDGED_SOURCE if judged else source
        router_url = state.get("router_url") or None
        fleet_url = state.get("fleet_url") or None
        phase = str(state.get("phase") or ("queued" if not state else "?"))
        done = result is not None or phase in FINAL_PHASES

        # Scrape only while the job can be serving: a finished job's addresses may belong to someone
        # else's job by now, and a queued one has none.
        scrape = not done
        key, key_problem = self._engine_key(jd) if scrape and engines and jd is not None else (None, None)
        router_task = self._fetch_router(router_url) if scrape and router_url else self._nothing()
        client = EngineClient(self._http(), key, self.timeout_s) if scrape and engines else None
        engine_tasks = [
            self._fetch_engine(client, e["url"]) if client is not None and e["url"] else self._nothing()
            for e in engines
        ]
        slurm, router_got, *engine_got = await asyncio.gather(self._slurm_state(), router_task, *engine_tasks)

        slurm_word = slurm.split()[0] if slurm else ""
        lost: str | None = None  # the job's driver is gone without a result: shown as LOST, not its phase
        if not done and self.slurm_job_id is None and jd is not None and jd.driver_alive() is False:
            # A local driver killed before it could record its result: nothing of it serves any more.
            lost = lost_detail(self.name, f"its driver (pid {state.get('driver_pid')}) is gone", phase)
            done, scrape = True, False
            router_got = await self._nothing()
            engine_got = [router_got] * len(engines)
        if not done and slurm_word and slurm_word in _final_slurm_states():
            # Slurm ended the job before the driver could say so; its processes went with it, and anything
            # still answering on those addresses belongs to someone else now.
            lost = lost_detail(self.name, f"Slurm says {slurm}", phase)
            done, scrape = True, False
            router_got = await self._nothing()
            engine_got = [router_got] * len(engines)
        phase = LOST if lost is not None else phase
        condition, message = self._condition(state, phase, result, slurm, done, router_url, router_got)
        if done:
            final_rows(engines)

        refit = await self._refit_view(jd, router_url, fleet_url, router_got[0]) if scrape else None
        standing = await self._standing_view(jd, state, fleet_url, scrape)
        rollouts = await self._rollouts_view(jd, state, refit, now) if jd is not None else None
        router = self._router_view(router_url, router_got, scrape)
        prev_router = self._prev_router
        cur_router: RouterSample | None = router.pop("_sample", None)
        for row, got in zip(engines, engine_got, strict=True):
            self._engine_view(row, got, scrape, cur_router, prev_router)
        if cur_router is not None:
            self._prev_router = cur_router
        # An engine the fleet state calls DEAD, RETIRED or RESTARTING is expected to be silent; one that
        # should be serving and is not is news, even when its row is scrolled off the screen.
        silent = EXPECTED_SILENT | REGISTERED_SILENT  # a registered engine held out is its row's news
        unreachable = [e for e in engines if e.get("reachable") is False and e["state"] not in silent]
        if unreachable:
            problems.append(
                f"{len(unreachable)} of {len(engines)} engine(s) that should serve did not answer /metrics "
                f"(first: {unreachable[0]['url']}: {unreachable[0]['error']})"
            )

        if key_problem is not None and scrape:
            problems.append(key_problem)
        gateway = gateway_view(gateway_snapshot, engines)
        for row, routed in judged:
            row["in_gateway"] = routed  # a member the router holds out is not routed to
        front = GATEWAY_KINDS.get(str(gateway["kind"])) if gateway is not None else None
        foreign = gateway["extra"] if gateway is not None and front and front.forwards_client_key else []
        if foreign and not done and not gateway["final"]:  # type: ignore[index]
            # A front that passes each client's Authorization on to the worker it picks
            # (``FrontKind.forwards_client_key``): a worker the job does not own receives its rollouts and
            # its API key (a managed front removes such workers on the next fleet tick; an external one is
            # its owner's to clean up).
            problems.append(
                f"{gateway['kind']} routes to {len(foreign)} worker(s) this job does not own "  # type: ignore[index]
                f"({', '.join(foreign[:3])}): rollouts sent there carry the job's API key"
            )

        summary: dict[str, int] = {}
        for e in engines:
            summary[e["state"]] = summary.get(e["state"], 0) + 1
        started = float(start_t) if start_t is not None else None
        ended = None
        if done:  # the clock stops at the driver's last word, not at whenever someone looks
            last = state.get("updated", events[-1].get("t") if events else None)
            ended = float(last) if isinstance(last, int | float) else None
        elapsed = ((ended or now) - started) if started is not None else None
        job = {
            "name": self.name,
            "dir": str(self.job_dir) if self.job_dir is not None else None,
            "slurm_job_id": self.slurm_job_id,
            "slurm_state": slurm if self.slurm_job_id is not None else "local",
            "phase": phase,
            "detail": lost or str(state.get("detail") or ""),
            "nodes": state.get("nodes") or {},
            "started": started,
            "elapsed_s": rounded(elapsed, 1),
            "router_url": router_url,
            "policy": state.get("policy"),
            "front": state.get("front") or (submitted.front if submitted is not None else None),
            "engines": state.get("engines") or (submitted.engines if submitted is not None else None),
        }
        return {
            "version": SNAPSHOT_VERSION,
            "t": now,
            "job": job,
            "condition": condition,
            "message": message,
            "problems": problems,
            "result": result,
            "router": router,
            "gateway": gateway,
            "cache_reset": jd.read_cache_reset() if jd is not None else None,
            "refit": refit,
            "standing": standing,
            "elastic": elastic_view(state, now),
            "rollouts": rollouts,
            "engines": engines,
            "engine_source": source,
            "fleet": fleet.figures if fleet is not None else None,
            "summary": summary,
            "history": [round(x, 3) for x in self.history],
            "events": events,
        }

    @staticmethod
    def _engine_key(jd: JobDir) -> tuple[str | None, str | None]:
        """``(key, problem)``: the job's engine key for its engines' ``/metrics``, or None and why when the
        key file cannot be read (the engines are scraped without it: the dashboard shows the rest). None
        for engines the trainer owns: they never take the job's key, and it is not theirs to see."""
        if jd.read_registration_capability():
            return None, None
        try:
            return jd.read_engine_key() or None, None
        except (OSError, ValueError) as exc:
            return None, (
                f"the job's API key is unreadable ({type(exc).__name__}: {exc}); engine /metrics scraped "
                "without it (engines that require it answer 401)"
            )

    def _condition(
        self,
        state: dict[str, Any],
        phase: str,
        result: dict[str, Any] | None,
        slurm: str | None,
        done: bool,
        router_url: str | None,
        router_got: Scrape,
    ) -> tuple[str, str]:
        """Which of ``CONDITIONS`` the job is in, and the sentence that says so on screen."""
        if done:
            if result is not None:
                code = result.get("exit_code")
                word = result.get("outcome") or ("finished" if code == 0 else "failed")
                return "finished", f"job {word}: exit {code} ({result.get('reason') or 'no reason given'})"
            if phase in FINAL_PHASES:
                return "finished", f"job {phase}: {state.get('detail') or 'no detail'}"
            if self.slurm_job_id is None:
                return "finished", (
                    f"the driver is gone and wrote no result.json (killed before it could; "
                    f"rl-launch logs {self.name} shows how far it got; rl-launch cancel {self.name} ends "
                    "what it left)"
                )
            return "finished", (
                f"Slurm says {slurm}; the driver wrote no result.json (killed before it could; "
                f"rl-launch logs {self.name} shows how far it got)"
            )
        if not state:
            where = f"Slurm: {slurm}" if slurm else "the driver has written nothing yet"
            return "queued", f"job queued ({where}): no router or engines yet"
        if phase == "queued" or (slurm or "").startswith("PENDING"):
            return "queued", f"job queued (Slurm: {slurm or '?'}): no router or engines yet"
        if not router_url:
            return "starting", f"job starting (phase {phase}: {state.get('detail') or '-'}); no router yet"
        if router_got[1] is not None:
            return "unreachable", f"router {router_url} unreachable: {router_got[1]}"
        return "running", ""

    def _router_view(self, url: str | None, got: Scrape, scraped: bool) -> dict[str, Any]:
        body, error, t = got
        view: dict[str, Any] = {
            "url": url,
            "reachable": None if not (scraped and url) else error is None,
            "error": error,
            "req_per_s": None,
            "in_flight": None,
            "p50_s": None,
            "p99_s": None,
            "p50_below_s": None,
            "p99_below_s": None,
            "latency_window": None,
            "requests_total": None,
            "http_500": None,
            "no_backend": None,
            "serving_backends": None,
        }
        if body is None:
            return view
        cur = RouterSample.parse(body, t)
        prev = self._prev_router
        rate = counter_rate(cur.requests, prev.requests, cur.t - prev.t) if prev is not None else None
        if rate is not None:
            self.history.append(rate)
        window = bucket_delta(cur.latency, prev.latency if prev is not None else None)
        windowed = prev is not None and window is not cur.latency and window and window[-1][1] > 0
        buckets = window if windowed else cur.latency
        no_backend = cur.errors.get("no_backend")
        if no_backend is None:
            no_backend = cur.by_status.get("409", 0.0)
        view.update(
            req_per_s=rounded(rate, 3),
            in_flight=finite(cur.in_flight),
            p50_s=rounded(histogram_quantile(0.5, buckets), 5),
            p99_s=rounded(histogram_quantile(0.99, buckets), 5),
            p50_below_s=lowest_bucket_bound(0.5, buckets),
            p99_below_s=lowest_bucket_bound(0.99, buckets),
            latency_window="interval" if windowed else "lifetime",
            requests_total=cur.requests,
            http_500=cur.by_status.get("500", 0.0),
            no_backend=no_backend,
            serving_backends=finite(cur.serving),
            _sample=cur,
        )
        return view

    def _engine_view(
        self,
        row: dict[str, Any],
        got: Scrape,
        scraped: bool,
        router: RouterSample | None,
        prev_router: RouterSample | None,
    ) -> None:
        """Fill one engine row in place: the router's view of it (in-flight, req/s, error rate) and its
        own /metrics (latency, prefix cache, KV, queue)."""
        body, error, t = got
        key = canonical_url(row["url"]) if row["url"] else ""
        row.update(
            reachable=None if not (scraped and row["url"]) else error is None,
            error=error,
            in_rotation=None,
            in_flight=None,
            req_per_s=None,
            error_rate=None,
            p50_s=None,
            p50_below_s=None,
            prefix_hit_pct=None,
            kv_usage_pct=None,
            running=None,
            waiting=None,
        )
        if router is not None:
            row["in_rotation"] = key in router.backend_in_flight
            row["in_flight"] = finite(router.backend_in_flight.get(key))
            if prev_router is not None:
                # The router's own outcome counts for this backend over the interval: the same figures
                # the health controller judges by, so the dashboard shows what condemns an engine.
                ok = router.successes.get(key, 0.0) - prev_router.successes.get(key, 0.0)
                bad = router.failures.get(key, 0.0) - prev_router.failures.get(key, 0.0)
                dt = router.t - prev_router.t
                known = key in router.successes or key in router.failures
                if known and ok >= 0 and bad >= 0 and dt > 0:
                    row["req_per_s"] = rounded((ok + bad) / dt, 3)
                    row["error_rate"] = rounded(bad / (ok + bad), 4) if ok + bad > 0 else None
        if body is None:
            self._prev_engines.pop(key, None)
            return
        cur = EngineSample.parse(body, t)
        prev = self._prev_engines.get(key)
        self._prev_engines[key] = cur
        if row["req_per_s"] is None and prev is not None:
            row["req_per_s"] = rounded(counter_rate(cur.successes, prev.successes, cur.t - prev.t), 3)
        window = bucket_delta(cur.e2e, prev.e2e if prev is not None else None)
        buckets = window if window and window[-1][1] > 0 else cur.e2e
        hit = windowed_ratio(
            cur.prefix_hits,
            cur.prefix_queries,
            prev.prefix_hits if prev else None,
            prev.prefix_queries if prev else None,
        )
        row.update(
            p50_s=rounded(histogram_quantile(0.5, buckets), 5),
            p50_below_s=lowest_bucket_bound(0.5, buckets),
            prefix_hit_pct=rounded(hit * 100 if hit is not None else None, 2),
            kv_usage_pct=rounded(cur.kv_usage * 100 if cur.kv_usage is not None else None, 2),
            running=finite(cur.running),
            waiting=finite(cur.waiting),
        )


async def _collect_twice(collector: StatusCollector, window_s: float) -> dict[str, Any]:
    first = await collector.collect()
    if first["condition"] not in ("running", "starting", "unreachable") or window_s <= 0:
        return first
    if first["condition"] == "unreachable" and not any(e.get("reachable") for e in first["engines"]):
        return first  # nothing answered: a second try would only double the wait
    await asyncio.sleep(window_s)
    return await collector.collect()


async def acollect_snapshot(collector: StatusCollector, window_s: float = 1.0) -> dict[str, Any]:
    """A complete snapshot for ``--once``/``--json``: two scrapes ``window_s`` apart, so rates exist.
    A job with nothing to scrape (queued, finished) answers at once."""
    try:
        return await _collect_twice(collector, window_s)
    finally:
        await collector.aclose()


def collect_snapshot(job_dir: Path | None, window_s: float = 1.0, **collector_kwargs: Any) -> dict[str, Any]:
    """Synchronous ``acollect_snapshot`` for scripts and tests (runs its own event loop)."""
    return asyncio.run(acollect_snapshot(StatusCollector(job_dir, **collector_kwargs), window_s))
