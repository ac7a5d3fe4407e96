"""A mid-step refit window during a replay (``rl-launch bench replay --url ... --refit-at 0.5``).

A real RL step ends in a weight update while Gym's last sessions are still running; the local job shows
that window by pausing the fleet (``keep``) once a fraction of the replay's sessions has ended, holding
it for ``hold_s`` (the weight transfer stands in), flushing the caches, stamping a version and resuming,
all through the trainer's client (``launcher.fleet.client``: one refit transaction, the weights moved by
"the trainer's own means", here a sleep). The replay's sessions must all still
complete: requests sent during the pause are held by the router, in-flight ones frozen by the engines.
The figures (pause->resume time, requests held, their longest wait) are printed and kept in ``result``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class MidStepRefit:
    def __init__(
        self,
        job_dir: Path,
        total_sessions: int,
        fraction: float,
        hold_s: float,
        say: Callable[[str], None],
        version: str = "replay-refit-1",
    ) -> None:
        self.job_dir = job_dir
        self.at = max(1, int(total_sessions * fraction))
        self.hold_s = hold_s
        self.say = say
        self.version = version
        self.result: dict[str, Any] = {}
        self._ended = 0
        self._lock = threading.Lock()
        self._due = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mid-step-refit", daemon=True)

    def wrap(self, on_session_end: Callable[[Any], None]) -> Callable[[Any], None]:
        def counted(rec: Any) -> None:
            on_session_end(rec)
            with self._lock:
                self._ended += 1
                if self._ended >= self.at:
                    self._due.set()

        return counted

    def start(self) -> None:
        from launcher.fleet.client import FleetClient

        self.client = FleetClient.from_job_dir(self.job_dir)  # fail before the replay, not mid-way
        self._thread.start()

    def finish(self) -> dict[str, Any]:
        """Wait for a refit in progress; report one that never came due (the replay ended first)."""
        self._stop.set()
        self._due.set()
        self._thread.join(300)
        if not self.result:
            self.result = {"ok": False, "error": f"the replay ended before {self.at} sessions had"}
        return self.result

    def _run(self) -> None:
        self._due.wait()
        if self._stop.is_set():
            return
        client = self.client
        t0 = time.perf_counter()
        try:
            with client.refit(self.version, mode="keep") as handle:
                t_paused = time.perf_counter()
                time.sleep(self.hold_s)
                t_update = time.perf_counter()
            txn = client.last_refit
            assert txn is not None
            t1 = time.perf_counter()
            self.result = {
                "ok": bool(txn.get("ok")),
                "after_sessions": self.at,
                "engines": len(handle.begun["engines"]),
                "pause_s": round(t_paused - t0, 4),
                "hold_s": self.hold_s,
                "cache_reset_stamp_resume_s": round(t1 - t_update, 4),
                "pause_to_resume_s": round(t1 - t0, 4),
                "overhead_s": round(t1 - t0 - self.hold_s, 4),
                "held_released": txn["held"].get("released"),
                "held_longest_wait_s": txn["held"].get("longest_wait_s"),
                "version": self.version,
                "quarantined": txn.get("quarantined"),
                "router_holding": txn.get("router_holding", True),
            }
            r = self.result
            self.say(
                f"mid-step refit on {r['engines']} engines after {self.at} sessions: "
                f"pause {r['pause_s']:.3f} s, hold {self.hold_s:g} s, "
                f"cache reset + stamp + resume {r['cache_reset_stamp_resume_s']:.3f} s "
                f"(cycle {r['pause_to_resume_s']:.3f} s, {r['overhead_s']:.3f} s beyond the hold); "
                + (
                    f"{r['held_released']} requests held, longest wait {r['held_longest_wait_s']:.3f} s"
                    if r["router_holding"]
                    else "requests sent meanwhile were held by the engines (the front cannot hold them)"
                )
            )
        except Exception as exc:  # reported with the replay's results; the replay itself goes on
            self.result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            self.say(f"mid-step refit FAILED: {exc}")
