"""The job directory's view of a gateway that owns its engines (``FrontKind.owns_engines``, e.g.
ray-serve). Such a gateway starts, checks and replaces its engines itself, so the driver runs no fleet
controller for it; without this watcher ``rl-launch status`` would show neither the gateway nor its
engines, and the refit window beside the front (``Gateway.sync_owned_engines``) would never hear of an
engine that replaced another."""

from __future__ import annotations

import threading

from launcher.gateways import Gateway
from launcher.jobdir import JobDir, StateWriter


class GatewayFleetWatcher:
    """For a gateway that owns its engines: every ``period_s`` it is handed its engines as they are now
    (``Gateway.sync_owned_engines``), then its own view and its engines (as listings) go to the job
    directory, where ``rl-launch status`` reads them; the last view is kept, marked stopped, when the job
    ends."""

    def __init__(self, job: JobDir, state: StateWriter, gateway: Gateway, period_s: float = 2.0) -> None:
        self.job, self.state, self.gateway, self.period_s = job, state, gateway, period_s
        self._stop = threading.Event()
        self._sync_failed: str | None = None
        self._thread = threading.Thread(target=self._loop, name="gateway-fleet-watcher", daemon=True)

    def start(self) -> GatewayFleetWatcher:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as exc:  # a view that fails this tick is retried on the next
                view = {"kind": self.gateway.kind, "reachable": False, "detail": repr(exc)}
                self.state.update(gateway=view)
            self._stop.wait(self.period_s)

    def tick(self) -> None:
        self._sync()
        self.state.update(gateway=self.gateway.view().to_json())
        for listing in self.gateway.engine_listings():
            self.job.write_listing(listing)

    def _sync(self) -> None:
        """``Gateway.sync_owned_engines``, apart from the view: a sync that fails this tick (Serve's
        controller restarting) must not also hide the gateway's view. Logged once per distinct reason, not
        every tick."""
        try:
            self.gateway.sync_owned_engines()
        except Exception as exc:
            why = repr(exc)
            if why != self._sync_failed:
                self.job.log_event(
                    "gateway_sync_failed", f"{self.gateway.kind}: {why}", level="warning", why=why
                )
            self._sync_failed = why
            return
        self._sync_failed = None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        last = self.state.snapshot().get("gateway") or {}
        if isinstance(last, dict) and last:  # not the kind string of the router_serving event
            self.state.update(gateway={**last, "reachable": False, "detail": "stopped"})
