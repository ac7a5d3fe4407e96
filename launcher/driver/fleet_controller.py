"""The fleet-health loop of the driver: probe, drain, judge, push the whole serving set, restart.

Every tick (1 s by default) it gathers the two kinds of evidence separately — an active ``GET /health``
per engine with a short timeout (a hung probe is a failure), and the router's drained per-backend
outcomes of the same window — hands them to ``launcher.fleet.FleetHealth``, and pushes the **whole**
serving set to the router (never a delta: a restarted router actor converges on the next tick). Engines
the state machine condemns are restarted in place by their node's engine host (a control file in the job
directory; the replacement comes back on a new port and is readmitted only after passing probes).
State changes, restarts and router restarts go to ``events.jsonl``; the fleet snapshot goes to
``state.json`` for ``rl-launch status``. When nothing can serve any more, ``fatal`` is set and the driver
fails the job with that reason instead of hanging.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from launcher.driver.jobdir import JobDir, write_json_atomic
from launcher.fleet import EngineRecord, FleetHealth, HealthPolicy, ProbeResult, TickInput
from router.backends import canonical_backend_url


def probe(url: str, timeout_s: float) -> ProbeResult:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as resp:
            return ProbeResult(200 <= resp.status < 300, f"HTTP {resp.status}")
    except Exception as exc:  # refused, reset, timeout: all failures of this probe
        return ProbeResult(False, f"probe failed: {exc}")


class FleetController:
    def __init__(
        self,
        job: JobDir,
        router: Any,
        listings: dict[int, Path],
        policy: HealthPolicy | None = None,
        tick_s: float = 1.0,
        probe_timeout_s: float = 1.0,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.job = job
        self.say = say or (lambda message: None)
        self.router = router
        self.listings = listings  # node index -> engines/node-<i>.urls.json
        self.tick_s = tick_s
        self.probe_timeout_s = probe_timeout_s
        self.where: dict[str, tuple[int, int]] = {}  # engine id -> (node index, engine index)
        self.generation: dict[str, int] = {}
        records = []
        for node_index, path in sorted(listings.items()):
            for entry in json.loads(path.read_text())["engines"]:
                engine_id = f"node{node_index}-{entry['index']}"
                self.where[engine_id] = (node_index, int(entry["index"]))
                self.generation[engine_id] = int(entry.get("generation", 0))
                records.append(
                    EngineRecord(id=engine_id, node=entry["node"], url=canonical_backend_url(entry["url"]))
                )
        self.fleet = FleetHealth(records, policy)
        self.fatal: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=min(32, max(1, len(records))))
        self._router_pid: int | None = None

    def start(self) -> FleetController:
        self._thread = threading.Thread(target=self._loop, name="fleet-health", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.tick()
            except Exception as exc:  # one bad tick must not end health management
                self.job.log_event("fleet_error", f"health tick failed: {exc!r}")

    # -- one tick ---------------------------------------------------------------------------------------
    def tick(self) -> None:
        import ray

        targets = self.fleet.probe_targets()
        results = list(self._pool.map(lambda u: probe(u, self.probe_timeout_s), targets.values()))
        probes = dict(zip(targets.values(), results, strict=True))
        try:
            outcomes = ray.get(self.router.drain_backend_outcomes.remote(), timeout=5)
        except Exception:  # the router actor is restarting: probes alone this tick
            outcomes = {}
        self._collect_restarts()
        result = self.fleet.observe(TickInput(probes=probes, outcomes=outcomes))
        try:
            ray.get(self.router.set_serving_backends.remote(result.serving_urls), timeout=5)
            pid = ray.get(self.router.pid.remote(), timeout=5)
            if self._router_pid is not None and pid != self._router_pid:
                self.job.log_event(
                    "router_restarted", f"router actor restarted (pid {self._router_pid} -> {pid})"
                )
            self._router_pid = pid
        except Exception as exc:
            self.job.log_event("router_unreachable", f"could not push the serving set: {exc!r}")
        for engine_id in result.to_restart:
            self._request_restart(engine_id)
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
        self.job.update_state(fleet=self.fleet.snapshot())
        if result.fatal and self.fatal is None:
            self.fatal = result.fatal

    def _request_restart(self, engine_id: str) -> None:
        node_index, index = self.where[engine_id]
        self.generation[engine_id] += 1
        control = self.listings[node_index].with_name(f"node-{node_index}.control.json")
        try:
            requests = json.loads(control.read_text())
        except (OSError, ValueError):
            requests = {"restart": {}}
        requests["restart"][str(index)] = self.generation[engine_id]
        write_json_atomic(control, requests)
        self.job.log_event("engine_restart", f"engine {engine_id}: restart requested", engine_id=engine_id)

    def _collect_restarts(self) -> None:
        """Tell the state machine about replacements the engine hosts finished (new URL or error)."""
        for engine_id, (node_index, index) in self.where.items():
            if self.fleet.state(engine_id) != "RESTARTING":
                continue
            try:
                listing = json.loads(self.listings[node_index].read_text())
            except (OSError, ValueError):
                continue
            entry = next((e for e in listing.get("engines", []) if int(e["index"]) == index), None)
            if entry is None or int(entry.get("generation", 0)) < self.generation[engine_id]:
                continue
            if entry.get("error"):
                self.fleet.restart_failed(engine_id, str(entry["error"])[-2000:])
            else:
                self.fleet.restarted(engine_id, canonical_backend_url(entry["url"]))
                self.job.log_event(
                    "engine_restarted",
                    f"engine {engine_id} back on {entry['url']}",
                    engine_id=engine_id,
                    url=entry["url"],
                )
