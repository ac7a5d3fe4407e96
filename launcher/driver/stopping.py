"""How a job stops, and why it says so: the driver's stop signals, the allocation's end time, and the
exceptions that unwind the phases into the driver's one teardown.

Every way a job stops goes through that teardown (training, router, engine hosts, which stop their engines'
process groups, Ray workers, Ray head; nothing of the job is left running on any node):

* the job ends by itself (training exits, the fleet is gone, a phase fails): ``finished`` / ``failed``;
* SIGTERM (``scancel``, ``rl-launch cancel``, Slurm at the time limit) or SIGINT (Ctrl-C): ``cancelled``,
  or ``time limit`` when the SIGTERM comes at the allocation's end time;
* SIGUSR2, Slurm's warning before the time limit (``--signal=B:USR2@<s>``, sent to the batch step
  only): ``time limit``, torn down while there is still time to do it in order;
* the allocation's end time (``squeue %e``) minus a margin (``stop_margin_s``), even when no warning
  signal arrives: ``time limit``, exit 124.

``ray.init`` installs Ray's own SIGTERM handlers (a Python one that calls ``sys.exit`` and a C++ one that
prints a stack dump), which used to win over the driver's: the driver is why the handlers are installed
again right after ``ray.init`` (``StopSignals.install``). On a signal the result is recorded before the
teardown starts (Slurm sends SIGKILL ``KillWait`` seconds after SIGTERM, which may come before the teardown
ends) and again, with the teardown's duration, once it has ended.
"""

from __future__ import annotations

import signal
import time
from typing import Any

# The signals that stop a job; SIGUSR2 is Slurm's warning before the time limit.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)

# Exit status of a job the driver stopped itself before the time limit (as coreutils' ``timeout``).
TIME_LIMIT_EXIT = 124


class JobFailed(RuntimeError):
    """The job could not run; the message is the reason recorded in result.json and events.jsonl."""


class Terminated(BaseException):
    """A stop signal arrived (scancel, cancel, Ctrl-C, the time limit): unwind through teardown.

    A ``BaseException`` so no ``except Exception`` on the way (a phase's retry loop) swallows it."""

    def __init__(self, signum: int, outcome: str) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.outcome = outcome

    @property
    def reason(self) -> str:
        name = signal.Signals(self.signum).name
        if self.outcome == "time limit" and self.signum == signal.SIGUSR2:
            return f"time limit: Slurm's warning before the end of the allocation ({name})"
        if self.outcome == "time limit":
            return f"time limit: Slurm ended the allocation ({name} at its end time)"
        return f"cancelled by {name}"


class TimeLimitReached(Exception):
    """The allocation's end is near: stop in order now rather than be killed at the limit."""


def stop_margin_s(allocation_s: float) -> float:
    """How long before the allocation's end the driver starts its teardown on its own: enough for an
    orderly teardown (a few seconds) with room for a slow node, never more than a tenth of a short job."""
    return min(90.0, max(10.0, 0.1 * allocation_s))


def slurm_end_time(job_id: str | None) -> float | None:
    """The allocation's end time (epoch seconds) from ``squeue``, or None (no Slurm, unlimited)."""
    if not job_id:
        return None
    from launcher.slurm.queue import job_end_time

    return job_end_time(job_id)


class StopSignals:
    """The driver's handlers for every stop signal, and the allocation's end time they (and the training
    loop) judge a stop by: a SIGTERM at the end time is Slurm's time limit, not a scancel."""

    def __init__(self) -> None:
        self.end_time: float | None = None
        """The allocation's end (epoch seconds); None without Slurm or without a limit."""
        self.stop_at: float | None = None
        """When the driver stops on its own: ``end_time`` less ``stop_margin_s``."""
        self._previous: dict[int, Any] = {}

    def watch_allocation_end(self, job_id: str | None) -> None:
        """Read the allocation's end time once, and set when to stop before it."""
        self.end_time = slurm_end_time(job_id)
        if self.end_time is not None:
            self.stop_at = self.end_time - stop_margin_s(self.end_time - time.time())

    def take_over(self) -> None:
        """Keep the handlers in place (``restore`` puts them back) and install the driver's."""
        self._previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        self.install()

    def install(self) -> None:
        """The driver's handlers for every stop signal. Called again right after ``ray.init``, which
        replaces the SIGTERM handler with Ray's (``sys.exit`` plus a C++ stack dump, exit 134)."""

        def on_signal(signum: int, frame: object) -> None:
            raise Terminated(signum, self.outcome_of(signum))

        for s in STOP_SIGNALS:
            signal.signal(s, on_signal)

    def ignore(self) -> None:
        """From the teardown on: a second signal during teardown must not abort it half-way."""
        for s in self._previous:
            signal.signal(s, signal.SIG_IGN)

    def restore(self) -> None:
        """The handlers ``take_over`` found, back in place."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def outcome_of(self, signum: int) -> str:
        if signum == signal.SIGUSR2:
            return "time limit"
        if signum == signal.SIGTERM and self.end_time is not None and time.time() >= self.end_time - 10:
            return "time limit"  # Slurm's SIGTERM at the end of the allocation, not a scancel
        return "cancelled"

    def check_time_limit(self) -> None:
        """Raise ``TimeLimitReached`` once the allocation's end is within the stop margin."""
        if self.stop_at is not None and time.time() >= self.stop_at:
            # The warning signal may never reach this process (with --signal=B:USR2 it goes to the batch
            # shell, which must pass it on); the end time alone is reason enough.
            assert self.end_time is not None
            left = self.end_time - time.time()
            raise TimeLimitReached(
                f"time limit: the allocation ends in {left:.0f} s; stopped before Slurm kills it"
            ) from None
