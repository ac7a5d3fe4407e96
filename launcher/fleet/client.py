"""The trainer's handle on the generation fleet: the refit window and per-step metrics, through the front.

A trainer imports this (no Ray; its calls are blocking urllib calls, so no event loop is needed, though the
report types it shares with the router import aiohttp), points it at a job directory or at the router's URL
plus the admin token, and drives the whole fleet with one call per operation::

    from launcher.fleet.client import FleetClient

    fleet = FleetClient.from_job_dir("~/rl-launch/jobs/1234")   # or FleetClient(url, admin_token)
    for step in range(steps):
        fleet.begin_step()
        ...                                      # rollouts through the router
        with fleet.refit(version=f"step-{step}"):  # pause(keep) ... reset caches, stamp, resume
            update_weights_on_every_engine()     # NCCL / IPC, outside rl-launch
        log(fleet.step_metrics())                # one dict: tokens, cache hits, finish reasons...
        for url in fleet.stale_engines():        # engines restarted meanwhile: refit, then stamp
            refit_engine(url); fleet.set_weight_version(fleet_version, engines=[url])

Every call fans out to every engine behind the router (``router.fleet.api``) and raises ``FleetOpError``
(carrying the per-engine ``FleetOpReport``) when any engine did not comply, so a half-paused or
half-stamped fleet never passes silently; ``check=False`` returns the report instead.
The builtin router serves these routes itself; for ``router.kind: vllm-router`` the driver serves them
beside it (``launcher.gateways.vllm_router.fleet_endpoint``: same routes, but the engines, not the front,
hold the requests that arrive during a pause). ``from_job_dir`` finds the right URL in the job state
(``fleet_url``) and refuses fronts without these routes (Dynamo, Ray Serve) with the reason.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from launcher.http_call import bearer, open_url
from router.fleet.engine import PAUSE_MODES
from router.fleet.ops import FleetOpReport


class FleetOpError(RuntimeError):
    """A fleet operation that some engine did not comply with; ``report`` says which and why."""

    def __init__(self, report: FleetOpReport) -> None:
        super().__init__(f"fleet {report.op} failed: {report.why()}")
        self.report = report


class FleetClient:
    def __init__(self, url: str, admin_token: str | None, timeout_s: float = 300.0) -> None:
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        self._token = admin_token
        self.timeout_s = timeout_s
        self.last_resume: FleetOpReport | None = None
        """The resume report of the last ``refit`` (released requests, their longest wait)."""

    @classmethod
    def from_job_dir(cls, path: str | Path, timeout_s: float = 300.0) -> FleetClient:
        """The router URL and admin token of a running job (its job directory)."""
        from launcher.jobdir import JobDir

        jd = JobDir(Path(path).expanduser())
        state = jd.read_state()
        if not state.get("router_url") or state.get("torn_down"):
            raise ValueError(f"job directory {jd.path}: no serving router (phase: {state.get('phase')})")
        url = state.get("fleet_url")
        if not url:
            from launcher.gateways.kinds import GATEWAY_KINDS

            kind = jd.read_spec().router.kind
            having = " and ".join(name for name, front in GATEWAY_KINDS.items() if front.has_fleet_routes)
            raise ValueError(
                f"job directory {jd.path}: router.kind {kind!r} has no /fleet routes (router.kind {having} "
                "have them; rl-launch fleet reset-cache works for every front)"
            )
        return cls(url, jd.read_admin_token(), timeout_s)

    # -- transport ----------------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: Any = None, query: dict[str, str] | None = None) -> Any:
        url = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        headers = {"Content-Type": "application/json", **bearer(self._token)}
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            # Never a redirect: the admin token goes to the fleet URL and nowhere else.
            with open_url(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            text = exc.read()
            if exc.code == 500:  # the report of an operation some engine did not comply with
                try:
                    return json.loads(text)
                except ValueError:
                    pass
            raise RuntimeError(f"{method} {url}: HTTP {exc.code} ({exc.reason}): {text[:300]!r}") from None
        except OSError as exc:
            raise RuntimeError(f"{method} {url}: router unreachable: {exc}") from None

    def _op(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: dict[str, str] | None = None,
        check: bool = True,
    ) -> FleetOpReport:
        report = FleetOpReport.from_json(self._call(method, path, body, query))
        if check and not report.ok:
            raise FleetOpError(report)
        return report

    # -- operations -----------------------------------------------------------------------------------
    def pause(self, mode: str = "keep", check: bool = True) -> FleetOpReport:
        """Pause every engine (``keep``: freeze in-flight requests until resume; ``wait``: let them
        finish; ``abort``: abort them); the router holds new requests until ``resume``."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode={mode!r}: choose one of {', '.join(PAUSE_MODES)}")
        return self._op("POST", "/fleet/pause", query={"mode": mode}, check=check)

    def resume(self, check: bool = True) -> FleetOpReport:
        """Resume every engine, then release the held requests in arrival order; ``result`` holds
        ``released`` and ``held_longest_wait_s``."""
        return self._op("POST", "/fleet/resume", check=check)

    def is_paused(self) -> bool:
        """True when the router holds requests and every engine reports paused."""
        return bool(self._op("GET", "/fleet/is_paused").result["paused"])

    def abort(self, request_ids: list[str] | None = None, check: bool = True) -> FleetOpReport:
        """Abort the named requests (vLLM's external ids, e.g. ``chatcmpl-<X-Request-Id>``), or all."""
        return self._op("POST", "/fleet/abort", {"request_ids": request_ids or []}, check=check)

    def set_weight_version(
        self, version: str, engines: list[str] | None = None, check: bool = True
    ) -> FleetOpReport:
        """Stamp every serving engine (the fleet moves to ``version``), or only ``engines`` (refit stale
        ones, which are then readmitted)."""
        body: dict[str, Any] = {"version": version}
        if engines is not None:
            body["engines"] = engines
        return self._op("POST", "/fleet/weight_version", body, check=check)

    def weight_version(self, check: bool = True) -> FleetOpReport:
        """Each engine's version (``result["engines"]``) and the fleet's (``result["current"]``)."""
        return self._op("GET", "/fleet/weight_version", check=check)

    def stale_engines(self) -> dict[str, str]:
        """``{engine url: why}`` for engines held out until they are refit and stamped."""
        return dict(self._call("GET", "/fleet/stale")["stale"])

    def checksum(self, check: bool = True) -> FleetOpReport:
        """Compare the serving engines' weight checksums; fails when they do not all agree."""
        return self._op("POST", "/fleet/checksum", check=check)

    def reset_prefix_cache(self, check: bool = True) -> dict[str, Any]:
        """Flush every engine's prefix cache and the router's prefix index (``router.fleet.cache_reset``)."""
        data = self._call("POST", "/fleet/reset_prefix_cache")
        if check and not data.get("ok"):
            bad = [e for e in data.get("engines", []) if not e.get("ok")]
            raise FleetOpError(
                FleetOpReport("reset_prefix_cache", error=f"engines did not flush: {bad or 'none serving'}")
            )
        return dict(data)

    @contextmanager
    def refit(self, version: str, mode: str = "keep", reset_cache: bool = True) -> Iterator[FleetOpReport]:
        """Pause; (the body updates the weights); flush caches, stamp ``version``, resume. The fleet is
        resumed even when the body raises, so a failed update never leaves rollouts hanging."""
        done = False
        try:
            # Inside the try: a pause that failed on some engine has still closed the router's gate and
            # paused the others, so the fleet must be resumed either way.
            report = self.pause(mode)
            yield report
            if reset_cache:
                self.reset_prefix_cache()
            self.set_weight_version(version)
            done = True
        finally:
            resumed = self.resume(check=done)
            self.last_resume = resumed

    # -- per-step metrics -------------------------------------------------------------------------------
    def begin_step(self) -> int:
        """Snapshot every engine's counters; ``step_metrics`` answers the delta since. Returns the step."""
        data = self._call("POST", "/fleet/step/begin")
        if data.get("errors"):
            raise RuntimeError(f"engines' counters unreadable: {data['errors']}")
        return int(data["step"])

    def step_metrics(self) -> dict[str, Any]:
        """``{"step", "seconds", "fleet": {...}, "engines": {url: {...}}, "prefix_hit_rate"}``: the
        engines' own counters since ``begin_step`` (``router.fleet.engine_counters`` names the keys)."""
        data = dict(self._call("GET", "/fleet/step"))
        if data.get("errors"):
            raise RuntimeError(f"engines' counters unreadable: {data['errors']}")
        return data

    def counters(self) -> dict[str, Any]:
        """The engines' counters now (totals since they started)."""
        return dict(self._call("GET", "/fleet/counters"))


def flatten(step: dict[str, Any], prefix: str = "generation") -> dict[str, float]:
    """A step dict as flat ``{"generation/prompt_tokens": ..., "generation/engine0/...": ...}`` for a
    metrics logger (engines numbered in URL order)."""
    out: dict[str, float] = {f"{prefix}/{k}": v for k, v in step.get("fleet", {}).items()}
    if step.get("prefix_hit_rate") is not None:
        out[f"{prefix}/prefix_hit_rate"] = step["prefix_hit_rate"]
    for i, url in enumerate(sorted(step.get("engines", {}))):
        for k, v in step["engines"][url].items():
            out[f"{prefix}/engine{i}/{k}"] = v
    return out
