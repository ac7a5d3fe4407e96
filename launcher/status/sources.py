"""The job sources a status snapshot reads beyond the scrapes: the refit window, a standing fleet, rollouts.

Split out of ``collect.py`` (issue 29: one job a module) as a mixin of ``StatusCollector``: each reader
takes what the collector already read (the job directory, its state, the router's metrics) and asks the
job's own ``fleet_url`` (with the admin token) or the request record for the rest, on the collector's one
HTTP session, so the credential rules of ``collect``'s docstring hold here unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp

from launcher.jobdir import JobDir
from launcher.jobdir.paths import record_dir as record_dir_of
from launcher.record.tail import read_tail
from launcher.record.view import rollouts_view
from launcher.status.adapters import fetch_adapters
from launcher.status.refit import fetch_refit, fetch_step, pause_view
from launcher.status.standing import fetch_consumers, fetch_version


class JobSources:
    """``StatusCollector``'s readers of the refit window, the standing fleet and the rollouts."""

    timeout_s: float
    _http: Callable[[], aiohttp.ClientSession]

    async def _refit_view(
        self, jd: JobDir | None, router_url: str | None, fleet_url: str | None, router_metrics: str | None
    ) -> dict[str, Any] | None:
        """While the job serves: pause figures from the router's metrics and the current step's counters
        (see ``launcher.status.refit``); None when neither is known.

        The step comes from the job's ``fleet_url`` with the admin token, and the pause figures count
        only when the front is that same URL (the builtin router): a front the job does not own never
        gets the token, however much its ``/metrics`` looks like ours, nor says the fleet is paused."""
        if jd is None:
            return None
        ours = bool(fleet_url and router_url and router_url.rstrip("/") == fleet_url.rstrip("/"))
        pause = pause_view(router_metrics) if ours else None
        step = txn = adapters = None
        if fleet_url is not None:
            try:
                # a job attached to a standing fleet (an admin consumer) uses its own admin token there,
                # which the fleet registered as its admin key (router.consumers)
                token = jd.read_admin_token()
            except (OSError, ValueError):
                token = None
            if token:
                step, txn, adapters = await asyncio.gather(
                    fetch_step(self._http(), fleet_url, token, self.timeout_s),
                    fetch_refit(self._http(), fleet_url, token, self.timeout_s),
                    fetch_adapters(self._http(), fleet_url, token, self.timeout_s),
                )
        if pause is None and step is None and txn is None and adapters is None:
            return None
        return {"pause": pause, "step": step, "transaction": txn, "adapters": adapters}

    async def _rollouts_view(
        self, jd: JobDir, state: dict[str, Any], refit: dict[str, Any] | None, now: float
    ) -> dict[str, Any] | None:
        """The current step's slowest sessions and timeline from the request record
        (``launcher.record.view``): since the trainer's last ``begin_step`` when there is one, else the
        whole record's tail. A job on a standing fleet reads the fleet's record, its own requests only."""
        step = (refit or {}).get("step") or {}
        since = step.get("started_at") if isinstance(step, dict) else None
        record_dir, consumer = record_dir_of(jd.path), None
        attached = state.get("attached_to") or {}
        if attached.get("job_dir"):
            record_dir, consumer = record_dir_of(attached["job_dir"]), attached.get("consumer")
        records = await asyncio.to_thread(read_tail, record_dir, since, consumer)
        return rollouts_view(records, now)

    async def _standing_view(
        self, jd: JobDir | None, state: dict[str, Any], fleet_url: str | None, scrape: bool
    ) -> dict[str, Any] | None:
        """A standing fleet's consumers and version (``launcher.status.standing``), or the fleet a job is
        attached to; None for a job with its own fleet."""
        if state.get("attached_to"):
            return {"attached_to": state["attached_to"]}
        record = state.get("fleet_record")
        if not record or jd is None:
            return None
        view: dict[str, Any] = {"name": record.get("name"), "version": None, "consumers": None}
        if scrape and fleet_url:
            try:
                token = jd.read_admin_token()
            except (OSError, ValueError):
                return view
            view["consumers"], view["version"] = await asyncio.gather(
                fetch_consumers(self._http(), fleet_url, token, self.timeout_s),
                fetch_version(self._http(), fleet_url, token, self.timeout_s),
            )
        return view
