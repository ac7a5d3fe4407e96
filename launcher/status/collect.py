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
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from launcher.gateways.kinds import GATEWAY_KINDS
from launcher.http_call import bearer
from launcher.jobdir import FINAL_PHASES, STOPPED, JobDir, engine_id

SNAPSHOT_VERSION = 1

# Engine states the fleet-health controller writes; "HEALTHY?" marks an engine whose health nobody has
# judged (no controller state yet): it is listed from engines/node-*.urls.json and only looks healthy.
UNKNOWN_STATE = "HEALTHY?"

EXPECTED_SILENT = frozenset({"DEAD", "RETIRED", "RESTARTING"})

CONDITIONS = ("queued", "starting", "running", "unreachable", "finished")

Metrics = dict[str, list[tuple[dict[str, str], float]]]

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')

# Only these families are parsed from an engine's /metrics: a real vLLM exposes ~100 KB per engine, and
# at 256 engines a full parse every second would cost more CPU than the rest of the dashboard together.
# Older vLLM names (gpu_cache_usage_perc, gpu_prefix_cache_*) are read as fallbacks.
ENGINE_PREFIXES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_hits_total",
    "vllm:request_success_total",
    "vllm:e2e_request_latency_seconds_bucket",
)
ROUTER_PREFIXES = ("rl_router_",)


# -- Prometheus text ------------------------------------------------------------------------------------
def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return value.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")


def parse_metrics(text: str, prefixes: tuple[str, ...] | None = None) -> Metrics:
    """``{sample name: [(labels, value), ...]}`` from Prometheus text, keeping only lines that start with
    one of ``prefixes`` (all when None). A tolerant parser on purpose: a line it cannot read is skipped,
    because a status view that crashes on one odd metric helps nobody."""
    out: Metrics = {}
    for line in text.splitlines():
        if not line or line[0] == "#" or (prefixes is not None and not line.startswith(prefixes)):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels_text, raw = m.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        labels = {k: _unescape(v) for k, v in _LABEL.findall(labels_text)} if labels_text else {}
        out.setdefault(name, []).append((labels, value))
    return out


def metric_sum(metrics: Metrics, name: str, **match: str) -> float | None:
    """Sum of the samples of ``name`` whose labels include ``match``; None when the family is absent
    (so "no such metric" and "zero" stay distinguishable)."""
    samples = metrics.get(name)
    if samples is None:
        return None
    return sum(v for labels, v in samples if all(labels.get(k) == want for k, want in match.items()))


def metric_by_label(metrics: Metrics, name: str, label: str) -> dict[str, float]:
    """``{label value: summed value}`` over the other labels."""
    out: dict[str, float] = {}
    for labels, v in metrics.get(name, ()):
        key = labels.get(label)
        if key is not None:
            out[key] = out.get(key, 0.0) + v
    return out


def histogram_buckets(metrics: Metrics, name: str) -> list[tuple[float, float]]:
    """Cumulative ``(le, count)`` of histogram ``name`` (without ``_bucket``), summed over other labels
    (routes, model names), sorted by bound."""
    sums: dict[float, float] = {}
    for labels, v in metrics.get(f"{name}_bucket", ()):
        try:
            le = float(labels.get("le", "nan"))
        except ValueError:
            continue
        if not math.isnan(le):
            sums[le] = sums.get(le, 0.0) + v
    return sorted(sums.items())


def bucket_delta(
    current: list[tuple[float, float]], previous: list[tuple[float, float]] | None
) -> list[tuple[float, float]]:
    """The observations between two scrapes; the current (lifetime) buckets when there is no usable
    previous scrape (first frame, different bounds, or a counter reset after a restart)."""
    if not previous:
        return current
    prev = dict(previous)
    if set(prev) != {le for le, _ in current}:
        return current
    delta = [(le, c - prev[le]) for le, c in current]
    if any(d < 0 for _, d in delta):
        return current
    return delta


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile``: linear interpolation inside the bucket holding rank ``q*n``.

    The lowest bucket interpolates from 0; a rank in the ``+Inf`` bucket returns the highest finite
    bound (nothing better is known). None when the histogram holds no observation."""
    if not buckets or not 0.0 <= q <= 1.0:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank and count > 0:
            if math.isinf(le):
                return lower_le
            if count == lower_count:
                return le
            return lower_le + (le - lower_le) * (rank - lower_count) / (count - lower_count)
        lower_le, lower_count = (le if not math.isinf(le) else lower_le), count
    return lower_le


def lowest_bucket_bound(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The lowest bucket's bound when quantile ``q`` falls inside it, else None.

    Interpolating from 0 there is pure guesswork: vLLM's e2e histogram starts at 0.3 s, so every fast
    engine would read "150 ms" whatever its real latency. The dashboard shows "<300 ms" instead."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    le, count = buckets[0]
    return le if not math.isinf(le) and count >= q * buckets[-1][1] else None


def _finite(value: float | None) -> float | None:
    """JSON has no NaN or infinity: such a figure is simply unknown."""
    if value is None or math.isnan(value) or math.isinf(value):
        return None
    return value


def _round(value: float | None, digits: int = 4) -> float | None:
    value = _finite(value)
    return None if value is None else round(value, digits)


def canonical_url(url: str) -> str:
    """The router keys backends by ``http://host:port`` (no ``/v1``); engine listings may carry either."""
    try:
        from router.state.backends import canonical_backend_url

        return canonical_backend_url(url)
    except (ImportError, ValueError):
        url = url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url


# -- one scrape of each kind ----------------------------------------------------------------------------
@dataclass
class RouterSample:
    """The router's counters at one instant (cumulative; rates come from two of these)."""

    t: float
    requests: float
    by_status: dict[str, float]
    errors: dict[str, float]
    latency: list[tuple[float, float]]
    backend_in_flight: dict[str, float]
    successes: dict[str, float]
    failures: dict[str, float]
    in_flight: float | None
    serving: float | None

    @classmethod
    def parse(cls, text: str, t: float) -> RouterSample:
        m = parse_metrics(text, ROUTER_PREFIXES)
        by_status = metric_by_label(m, "rl_router_requests_total", "status")
        return cls(
            t=t,
            requests=sum(by_status.values()),
            by_status=by_status,
            errors=metric_by_label(m, "rl_router_errors_total", "kind"),
            latency=histogram_buckets(m, "rl_router_request_duration_seconds"),
            backend_in_flight=metric_by_label(m, "rl_router_backend_in_flight", "backend"),
            successes=metric_by_label(m, "rl_router_backend_successes_total", "backend"),
            failures=metric_by_label(m, "rl_router_backend_failures_total", "backend"),
            in_flight=metric_sum(m, "rl_router_in_flight"),
            serving=metric_sum(m, "rl_router_serving_backends"),
        )


@dataclass
class EngineSample:
    """One engine's vLLM metrics at one instant."""

    t: float
    running: float | None
    waiting: float | None
    kv_usage: float | None
    prefix_queries: float | None
    prefix_hits: float | None
    successes: float | None
    e2e: list[tuple[float, float]] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str, t: float) -> EngineSample:
        m = parse_metrics(text, ENGINE_PREFIXES)

        def first(*names: str) -> float | None:
            for n in names:
                v = metric_sum(m, n)
                if v is not None:
                    return v
            return None

        return cls(
            t=t,
            running=first("vllm:num_requests_running"),
            waiting=first("vllm:num_requests_waiting"),
            kv_usage=first("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
            prefix_queries=first("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
            prefix_hits=first("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
            successes=first("vllm:request_success_total"),
            e2e=histogram_buckets(m, "vllm:e2e_request_latency_seconds"),
        )


def _rate(cur: float | None, prev: float | None, dt: float) -> float | None:
    if cur is None or prev is None or dt <= 0 or cur < prev:
        return None
    return (cur - prev) / dt


def _windowed_ratio(
    num: float | None, den: float | None, prev_num: float | None, prev_den: float | None
) -> float | None:
    """``num/den`` over the last interval when it saw any ``den``, else since the start: a busy engine
    shows what it does now, an idle one still shows something meaningful."""
    if num is None or den is None:
        return None
    if prev_num is not None and prev_den is not None and den > prev_den and num >= prev_num:
        return (num - prev_num) / (den - prev_den)
    return num / den if den > 0 else None


# -- the job directory ----------------------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _parse_lines(lines: Iterable[str]) -> list[dict[str, Any]]:
    out = []
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line being appended right now, or a torn tail
        if isinstance(record, dict):
            out.append(record)
    return out


def read_event_log(path: Path, last: int, tail_bytes: int = 256 * 1024) -> tuple[float | None, list[dict]]:
    """``(start time, last events)`` from ``events.jsonl`` without reading it whole: a multi-day run with
    a fleet controller appends for days, and the dashboard re-reads it every frame. The start time is the
    first ``starting`` event, which sits in the file's first lines."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head_bytes = f.read(64 * 1024)
            if size <= len(head_bytes):
                tail_bytes_read = head_bytes
            else:
                f.seek(max(0, size - tail_bytes))
                tail_bytes_read = f.read()
    except OSError:
        return None, []
    head = head_bytes.decode(errors="replace").splitlines()
    lines = tail_bytes_read.decode(errors="replace").splitlines()
    if size > tail_bytes:
        lines = lines[1:]  # the first line of a tail read is most likely cut
    start = next((e.get("t") for e in _parse_lines(head) if e.get("phase") == "starting"), None)
    events = _parse_lines(lines)
    return (float(start) if isinstance(start, int | float) else None), events[-last:] if last > 0 else []


def listed_engines(job_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Engines from the engine listings in fleet order (numeric node order, then engine index: the
    order ``rl-launch logs --engine N`` counts), with the ids ``logs --engine`` takes (``node0-1``) and
    an unknown state, plus the start errors those listings record."""
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    for listing in JobDir(job_dir).listings():
        if listing.error:
            node = listing.node or f"generation node {listing.node_index}"
            problems.append(f"engines on {node} failed to start: {str(listing.error).strip()[:300]}")
        for e in sorted(listing.engines, key=lambda e: e.index):
            if not (e.url or e.api_url):
                continue
            rows.append(
                {
                    "id": engine_id(listing.node_index, e.index),
                    "node": e.node or listing.node,
                    "url": e.url or e.api_url,
                    "state": UNKNOWN_STATE,
                    "restarts": 0,
                    "last_reason": "",
                }
            )
    return rows, problems


def fleet_engines(state: dict[str, Any], job_dir: Path | None) -> tuple[list[dict[str, Any]], str, list[str]]:
    """The engine rows: the fleet controller's (``state.json["fleet"]``) when it has written them, else
    the engine listings with state ``HEALTHY?``. Returns ``(rows, source, problems)``."""
    fleet = state.get("fleet")
    if isinstance(fleet, dict) and isinstance(fleet.get("engines"), list):
        rows = []
        for i, e in enumerate(fleet["engines"]):
            if not isinstance(e, dict):
                continue
            rows.append(
                {
                    "id": e.get("id", i),
                    "node": str(e.get("node") or ""),
                    "url": str(e.get("url") or e.get("api_url") or ""),
                    "state": str(e.get("state") or UNKNOWN_STATE).upper(),
                    "restarts": int(e.get("restarts") or 0),
                    "last_reason": str(e.get("last_reason") or ""),
                }
            )
        problems = listed_engines(job_dir)[1] if job_dir is not None else []
        if fleet.get("fatal"):
            problems.insert(0, f"fleet: {fleet['fatal']}")
        return rows, "fleet", problems
    if job_dir is None:
        return [], "none", []
    rows, problems = listed_engines(job_dir)
    return rows, "listing", problems


# -- the collector --------------------------------------------------------------------------------------
def _describe(exc: BaseException, timeout_s: float) -> str:
    """A short reason for a failed scrape: the dashboard row has room for a few words, not a traceback."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(exc, aiohttp.ClientConnectorError):
        err = exc.os_error
        if isinstance(err, ConnectionRefusedError):
            return "cannot connect (connection refused)"
        if isinstance(err, socket.gaierror):
            return f"cannot connect (unknown host {exc.host})"
        return f"cannot connect ({getattr(err, 'strerror', None) or type(err).__name__})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "disconnected"
    return f"{type(exc).__name__}: {exc}"[:120]


def default_slurm_state(job_id: str) -> str:
    """Slurm's word on the job ('?' without Slurm tools); the same lookup ``rl-launch list`` uses."""
    from launcher.slurm.queue import describe_state

    return describe_state(job_id)


def _final_slurm_states() -> frozenset[str]:
    from launcher.slurm.queue import FINAL_STATES

    return FINAL_STATES


def final_rows(engines: list[dict[str, Any]]) -> None:
    """A finished job serves nothing: every engine row says STOPPED (keeping the state the fleet
    controller last saw in ``state_at_end``), whether or not the driver lived to write the final
    snapshot itself."""
    for e in engines:
        if e["state"] != STOPPED:
            e.setdefault("state_at_end", e["state"])
            e["state"] = STOPPED


class StatusCollector:
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

    async def _fetch(self, base_url: str, key: str | None = None) -> tuple[str | None, str | None, float]:
        """``(body, error, time)`` of ``GET base_url/metrics`` (with ``key`` as a bearer token: only ever
        the job's API key to the job's own engines); never raises, never outlasts the timeout, never
        follows a redirect (a 3xx shows as the row's error)."""
        url = f"{base_url.rstrip('/')}/metrics"
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._http().get(url, headers=bearer(key), allow_redirects=False) as resp:
                    if resp.status != 200:
                        return None, f"HTTP {resp.status} from /metrics", time.monotonic()
                    return await resp.text(errors="replace"), None, time.monotonic()
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            return None, _describe(exc, self.timeout_s), time.monotonic()

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

    async def _nothing(self) -> tuple[str | None, str | None, float]:
        return None, None, time.monotonic()

    async def collect(self) -> dict[str, Any]:
        """One snapshot (see the module docstring for its sources). Rates are None on the first call."""
        now = time.time()
        jd = JobDir(self.job_dir) if self.job_dir is not None else None
        state = jd.read_state() if jd is not None else {}
        submitted = jd.read_submitted() if jd is not None else None
        result = _read_json(jd.result_file) if jd is not None else None
        start_t, events = read_event_log(jd.events_file, self.events) if jd is not None else (None, [])
        engines, source, problems = fleet_engines(state, self.job_dir)
        router_url = state.get("router_url") or None
        fleet_url = state.get("fleet_url") or None
        phase = str(state.get("phase") or ("queued" if not state else "?"))
        done = result is not None or phase in FINAL_PHASES

        # Scrape only while the job can be serving: a finished job's addresses may belong to someone
        # else's job by now, and a queued one has none.
        scrape = not done
        key, key_problem = self._engine_key(jd) if scrape and engines and jd is not None else (None, None)
        router_task = self._fetch(router_url) if scrape and router_url else self._nothing()
        engine_tasks = [
            self._fetch(e["url"], key) if scrape and e["url"] else self._nothing() for e in engines
        ]
        slurm, router_got, *engine_got = await asyncio.gather(self._slurm_state(), router_task, *engine_tasks)

        slurm_word = slurm.split()[0] if slurm else ""
        if not done and self.slurm_job_id is None and jd is not None and jd.driver_alive() is False:
            # A local driver killed before it could record its result: nothing of it serves any more.
            done, scrape = True, False
            router_got = await self._nothing()
            engine_got = [router_got] * len(engines)
        if not done and slurm_word and slurm_word in _final_slurm_states():
            # Slurm ended the job before the driver could say so; its processes went with it, and anything
            # still answering on those addresses belongs to someone else now.
            done, scrape = True, False
            router_got = await self._nothing()
            engine_got = [router_got] * len(engines)
        condition, message = self._condition(state, phase, result, slurm, done, router_url, router_got)
        if done:
            final_rows(engines)

        refit = await self._refit_view(jd, router_url, fleet_url, router_got[0]) if scrape else None
        router = self._router_view(router_url, router_got, scrape)
        prev_router = self._prev_router
        cur_router: RouterSample | None = router.pop("_sample", None)
        for row, got in zip(engines, engine_got, strict=True):
            self._engine_view(row, got, scrape, cur_router, prev_router)
        if cur_router is not None:
            self._prev_router = cur_router
        # An engine the fleet state calls DEAD, RETIRED or RESTARTING is expected to be silent; one that
        # should be serving and is not is news, even when its row is scrolled off the screen.
        unreachable = [
            e for e in engines if e.get("reachable") is False and e["state"] not in EXPECTED_SILENT
        ]
        if unreachable:
            problems.append(
                f"{len(unreachable)} of {len(engines)} engine(s) that should serve did not answer /metrics "
                f"(first: {unreachable[0]['url']}: {unreachable[0]['error']})"
            )

        if key_problem is not None and scrape:
            problems.append(key_problem)
        gateway = _gateway_view(state.get("gateway"), engines)
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
            "detail": str(state.get("detail") or ""),
            "nodes": state.get("nodes") or {},
            "started": started,
            "elapsed_s": _round(elapsed, 1),
            "router_url": router_url,
            "policy": state.get("policy"),
            "front": state.get("front") or (submitted.front if submitted is not None else None),
            "engines": state.get("engines") or (submitted.engines if submitted is not None else None),
        }
        fleet_extra = state.get("fleet") if isinstance(state.get("fleet"), dict) else None
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
            "engines": engines,
            "engine_source": source,
            "fleet": {k: v for k, v in fleet_extra.items() if k != "engines"} if fleet_extra else None,
            "summary": summary,
            "history": [round(x, 3) for x in self.history],
            "events": events,
        }

    async def _refit_view(
        self, jd: JobDir | None, router_url: str | None, fleet_url: str | None, router_metrics: str | None
    ) -> dict[str, Any] | None:
        """While the job serves: pause figures from the router's metrics and the current step's counters
        (see ``launcher.status.refit``); None when neither is known.

        The step comes from the job's ``fleet_url`` with the admin token, and the pause figures count
        only when the front is that same URL (the builtin router): a front the job does not own never
        gets the token, however much its ``/metrics`` looks like ours, nor says the fleet is paused."""
        from launcher.status.refit import fetch_step, pause_view

        if jd is None:
            return None
        ours = bool(fleet_url and router_url and router_url.rstrip("/") == fleet_url.rstrip("/"))
        pause = pause_view(router_metrics) if ours else None
        step = None
        if fleet_url is not None:
            try:
                token = jd.read_admin_token()
            except (OSError, ValueError):
                token = None
            if token:
                step = await fetch_step(self._http(), fleet_url, token, self.timeout_s)
        if pause is None and step is None:
            return None
        return {"pause": pause, "step": step}

    @staticmethod
    def _engine_key(jd: JobDir) -> tuple[str | None, str | None]:
        """``(key, problem)``: the job's API key for its engines' ``/metrics``, or None and why when the
        key file cannot be read (the engines are scraped without it: the dashboard shows the rest)."""
        try:
            return jd.read_api_key() or None, None
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
        router_got: tuple[str | None, str | None, float],
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
                    f"rl-launch logs {self.name} shows how far it got)"
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

    def _router_view(
        self, url: str | None, got: tuple[str | None, str | None, float], scraped: bool
    ) -> dict[str, Any]:
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
        rate = _rate(cur.requests, prev.requests, cur.t - prev.t) if prev is not None else None
        if rate is not None:
            self.history.append(rate)
        window = bucket_delta(cur.latency, prev.latency if prev is not None else None)
        windowed = prev is not None and window is not cur.latency and window and window[-1][1] > 0
        buckets = window if windowed else cur.latency
        no_backend = cur.errors.get("no_backend")
        if no_backend is None:
            no_backend = cur.by_status.get("409", 0.0)
        view.update(
            req_per_s=_round(rate, 3),
            in_flight=_finite(cur.in_flight),
            p50_s=_round(histogram_quantile(0.5, buckets), 5),
            p99_s=_round(histogram_quantile(0.99, buckets), 5),
            p50_below_s=lowest_bucket_bound(0.5, buckets),
            p99_below_s=lowest_bucket_bound(0.99, buckets),
            latency_window="interval" if windowed else "lifetime",
            requests_total=cur.requests,
            http_500=cur.by_status.get("500", 0.0),
            no_backend=no_backend,
            serving_backends=_finite(cur.serving),
            _sample=cur,
        )
        return view

    def _engine_view(
        self,
        row: dict[str, Any],
        got: tuple[str | None, str | None, float],
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
            row["in_flight"] = _finite(router.backend_in_flight.get(key))
            if prev_router is not None:
                # The router's own outcome counts for this backend over the interval: the same figures
                # the health controller judges by, so the dashboard shows what condemns an engine.
                ok = router.successes.get(key, 0.0) - prev_router.successes.get(key, 0.0)
                bad = router.failures.get(key, 0.0) - prev_router.failures.get(key, 0.0)
                dt = router.t - prev_router.t
                known = key in router.successes or key in router.failures
                if known and ok >= 0 and bad >= 0 and dt > 0:
                    row["req_per_s"] = _round((ok + bad) / dt, 3)
                    row["error_rate"] = _round(bad / (ok + bad), 4) if ok + bad > 0 else None
        if body is None:
            self._prev_engines.pop(key, None)
            return
        cur = EngineSample.parse(body, t)
        prev = self._prev_engines.get(key)
        self._prev_engines[key] = cur
        if row["req_per_s"] is None and prev is not None:
            row["req_per_s"] = _round(_rate(cur.successes, prev.successes, cur.t - prev.t), 3)
        window = bucket_delta(cur.e2e, prev.e2e if prev is not None else None)
        buckets = window if window and window[-1][1] > 0 else cur.e2e
        hit = _windowed_ratio(
            cur.prefix_hits,
            cur.prefix_queries,
            prev.prefix_hits if prev else None,
            prev.prefix_queries if prev else None,
        )
        row.update(
            p50_s=_round(histogram_quantile(0.5, buckets), 5),
            p50_below_s=lowest_bucket_bound(0.5, buckets),
            prefix_hit_pct=_round(hit * 100 if hit is not None else None, 2),
            kv_usage_pct=_round(cur.kv_usage * 100 if cur.kv_usage is not None else None, 2),
            running=_finite(cur.running),
            waiting=_finite(cur.waiting),
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


def _gateway_view(view: Any, engines: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The front's own view of the fleet (written by the fleet controller), beside ours: each engine row
    gets ``in_gateway`` (does the front route to it?), and the view lists what the front routes to that
    the fleet does not know (``extra``)."""
    if not isinstance(view, dict):
        return None
    members = [m for m in view.get("members") or [] if isinstance(m, dict) and m.get("url")]
    keys = {canonical_url(str(m["url"])) for m in members}
    ours = set()
    for row in engines:
        key = canonical_url(row["url"]) if row.get("url") else ""
        ours.add(key)
        row["in_gateway"] = (key in keys) if key and view.get("reachable") else None
    return {
        "kind": view.get("kind"),
        "base_url": view.get("base_url"),
        "reachable": view.get("reachable"),
        "detail": view.get("detail") or "",
        "final": bool(view.get("final")),
        "members": len(members),
        "healthy": sum(1 for m in members if m.get("healthy") is True),
        "extra": sorted(k for k in keys if k not in ours),
    }

