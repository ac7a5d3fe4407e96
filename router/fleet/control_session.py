"""vLLM's control calls, one after another, as one refit transaction of the whole fleet.

A trainer written for one vLLM (NeMo-RL's ``remote_vllm``, SkyRL, TRL, prime-rl) refits it in pieces:
``/pause``, then its weights (``/collective_rpc`` ``reload_weights`` from a directory, or the streamed
``/start_weight_update`` ... ``/finish_weight_update``), ``/reset_prefix_cache``, maybe
``/update_weight_version``, ``/resume``. Sent to every engine of a fleet as they come (NeMo-RL's own
fan-out proxy does that), one bad checkpoint empties the fleet (vLLM 0.32 leaves an engine whose reload
failed without weights), an engine that missed a call serves on old weights under no version, and a
trainer that dies after ``/pause`` leaves every engine paused. Here the calls are the steps of one
``router.fleet.refit.RefitCoordinator`` transaction instead, through its public methods only:

=============================  =======================================================================
control call                   transaction step
=============================  =======================================================================
``/pause?mode=``               ``begin`` (the mode's vLLM meaning) under a lease of ``lease_s``; every
                               later call below renews it (``renew``); the reads (``/health``,
                               ``/is_paused``...) do not: a monitor polling them must not keep a dead
                               trainer's pause alive
``/collective_rpc``            the checkpoint check before any engine reads it (the ``/fleet/refit``
``reload_weights``             route's ``CheckpointGuard``), then ``load``: canary, every engine
``/reset_prefix_cache``        recorded; the reset runs at ``/resume``, after the verify (a reset before
                               the verify would let an engine that fails it serve its stale prefixes)
``/update_weight_version``     the version the transaction stamps
``/start_weight_update``       recorded (nothing is sent: the engines start each round in ``receive``)
``/update_weights``            ``receive``: one streamed round on every engine of the transfer group
``/finish_weight_update``      recorded (``weight_version`` in its body: the version)
``/resume``                    ``commit``: verify, reset, stamp, resume; with no weights loaded since
                               ``/pause``: ``abort`` (every engine resumes on the version it had)
=============================  =======================================================================

* **Out of order** (a load with no ``/pause`` before it, a second ``/pause``, a ``/resume`` of a pause
  someone else made) is refused 409 with the reason, and nothing reaches the engines.
* **A failure ends the transaction at once**: a load with no directory or one the check refuses (400),
  a canary that fails (500, vLLM's error JSON), a load or a streamed round no engine took (500) aborts
  it, so the fleet serves on its version without waiting for a trainer whose client has just raised
  (NeMo-RL sends no ``/resume`` after a failed reload). A ``/resume`` after that finds nothing paused
  (200, as vLLM answers a resume of a running engine; prime-rl resumes in a ``finally``), a load names
  the failure (409); a ``/pause`` starts afresh.
* **A trainer that dies between ``/pause`` and ``/resume``** stops renewing: the coordinator's lease
  watchdog ends the transaction and the fleet serves on (engines that loaded unverified weights are
  held out and restored from the fleet's verified directory). A trainer that was only slow learns it
  at its next call: 409 naming the transaction, how it ended and the version the fleet serves.

**The version.** A trainer that never sends one (NeMo-RL keeps its version on its side) still gets one
on every answer and every generation. The rule (``derived_version``): ``<name>-c<n>``, where ``<name>``
is the weights directory's last path component (characters other than letters, digits, ``.``, ``_``,
``-`` become ``_``; at most 64), ``stream`` for streamed weights, and ``<n>`` counts the control URL's
transactions, starting above every ``-c<n>`` version the fleet already knows (so a restarted router
does not reuse one). Until the weights arrive the pending version is ``control-c<n>``. A version given
by ``/update_weight_version`` or ``/finish_weight_update``'s ``weight_version`` wins over the derived
one, whenever in the transaction it comes.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from router.fleet.cache_reset import CacheResetReport, reset_engines
from router.fleet.checkpoint import CheckpointRefused
from router.fleet.engine import VLLM_RESET_PATH
from router.fleet.fleet import Fleet
from router.fleet.refit import RefitCoordinator, RefitRefused
from router.fleet.refit_routes import RefitRoutes
from router.fleet.txn import RefitTxn
from router.state.pause_gate import PauseGate

log = logging.getLogger(__name__)

DEFAULT_CONTROL_LEASE_S = 120.0
"""How long a control transaction waits for the trainer's next call. NeMo-RL exports its checkpoint
between refits, not between ``/pause`` and ``/resume``, so its calls follow each other within seconds;
two minutes covers a slow shared filesystem's directory listing, and a trainer that died holds the
fleet paused for no longer than that."""
_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_NUMBERED = re.compile(r"-c(\d+)$")


class ControlError(Exception):
    """A control call refused or failed: ``status``, the message, vLLM's error ``kind`` and ``param``."""

    def __init__(self, status: int, message: str, kind: str = "Conflict", param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.param = param


def derived_version(weights: str | None, number: int) -> str:
    """The version of a transaction the trainer named none for (module doc): ``<name>-c<number>``."""
    if weights is None:
        return f"stream-c{number}"
    name = os.path.basename(os.path.normpath(weights)) or "weights"
    return f"{_NAME_CHARS.sub('_', name)[:64]}-c{number}"


@dataclass
class _Open:
    """The transaction ``/pause`` began and what the trainer did in it since."""

    txn_id: str
    number: int
    named: bool = False
    """The trainer gave the version (it is not derived)."""
    loaded: bool = False
    """Weights reached the engines (a directory load or a streamed round that succeeded)."""
    started: bool = False
    """``/start_weight_update`` came (and no ``/finish_weight_update`` since)."""
    reset_asked: bool = False


class ControlSession:
    """The control URL's state for one fleet: at most one transaction it opened, and its steps."""

    def __init__(
        self,
        fleet: Fleet,
        refit: RefitCoordinator,
        routes: RefitRoutes,
        gate: PauseGate,
        lease_s: float = DEFAULT_CONTROL_LEASE_S,
    ) -> None:
        self.fleet = fleet
        self.refit = refit
        self.routes = routes
        self.gate = gate
        self.lease_s = lease_s
        self.open: _Open | None = None
        self.failed: RefitTxn | None = None
        """The last transaction of this URL that ended without moving the fleet: named in the refusals
        of calls that came after it (prime-rl retries a 500 ``/update_weights``: the retry learns why)."""
        self._number = 0

    # -- state ------------------------------------------------------------------------------------
    def version(self) -> str | None:
        """What every answer shows: the open transaction's target, else the fleet's version."""
        txn = self.refit.active
        if self.open is not None and txn is not None and txn.id == self.open.txn_id and not txn.ended:
            return txn.version
        return self.fleet.current_version

    def paused(self) -> bool:
        return self.gate.paused or self.refit.busy() is not None

    def _next_number(self) -> int:
        known = [*self.fleet.backends.versions.known(), self.fleet.current_version or ""]
        seen = [int(m.group(1)) for v in known if (m := _NUMBERED.search(v))]
        self._number = max([self._number, *seen]) + 1
        return self._number

    def _current(self, call: str) -> tuple[_Open, RefitTxn]:
        """The open transaction, its lease renewed; else 409 saying why there is none."""
        if self.open is None:
            raise ControlError(409, f"{call} needs a paused fleet: call POST /pause first{self._since()}")
        state = self.open
        try:
            txn = self.refit.renew(state.txn_id)
        except RefitRefused:  # the lease or the deadline ended it, or the holder's key was revoked
            self.open = None
            last = self.refit.last
            if last is not None and last.id == state.txn_id:
                self.failed = last
                raise ControlError(409, f"{call}: {_ended(last, self.fleet.current_version)}") from None
            raise ControlError(409, f"{call}: the refit begun by /pause is no longer open") from None
        return state, txn

    def _since(self) -> str:
        """What the last failed transaction of this URL was (or that none is open)."""
        if self.failed is None:
            return " (no refit is open on this URL)"
        return f" ({_ended(self.failed, self.fleet.current_version)})"

    def _retarget(self, txn: RefitTxn, version: str) -> None:
        """Point the open transaction at ``version`` (what it stamps at ``/resume``): gated requests for
        it are held, not refused, meanwhile."""
        if txn.version != version:
            txn.version = version
            self.fleet.backends.versions.announce(version)

    def _finished(self, txn: RefitTxn) -> None:
        """The open transaction ended in this call (answered here: not reported again)."""
        self.open = None
        self.failed = None if txn.moved else txn
        log.info("control refit %s ended (%s): %s", txn.id, txn.phase, txn.error or txn.version)

    # -- the calls ----------------------------------------------------------------------------------
    async def pause(self, mode: str, holder: str | None) -> RefitTxn:
        if self.open is not None:
            try:
                txn = self.refit.find(self.open.txn_id)
            except RefitRefused:
                self.open = None
            else:
                raise ControlError(
                    409,
                    f"the fleet is already paused by /pause (refit {txn.id}, {txn.phase}): call /resume "
                    "first",
                )
        if (busy := self.refit.busy()) is not None:
            raise ControlError(409, f"{busy}; /pause waits for it to end")
        if self.gate.paused:
            raise ControlError(
                409, "the fleet is paused by POST /fleet/pause: resume it with POST /fleet/resume"
            )
        number = self._next_number()
        source = "stream" if self.routes.plan is not None else "directory"
        try:
            txn = await self.refit.run(
                self.refit.begin(f"control-c{number}", source, mode, lease_s=self.lease_s, holder=holder)
            )
        except RefitRefused as exc:
            raise ControlError(exc.status, str(exc)) from None
        self.open = _Open(txn.id, number)
        return txn

    async def reload(self, weights_path: str | None, holder: str | None) -> RefitTxn:
        """``reload_weights``: the check (nothing read by an engine yet), then canary and every engine.
        ``weights_path`` None: the served model's own directory (vLLM reloads the model it started with)."""
        state, txn = self._current("reload_weights")
        path = weights_path or await self.routes.served_root()
        if not path or not os.path.isabs(path):
            why = (
                "reload_weights needs kwargs.weights_path: an absolute checkpoint directory every engine "
                f"reads (got {weights_path!r}; the served model's root is {path!r})"
            )
            await self._abort(state, why)
            raise ControlError(400, why, "BadRequestError", "kwargs.weights_path")
        try:
            _, _, checked = await self.routes._directories({"from": path})
        except (CheckpointRefused, ValueError) as exc:
            why = f"the checkpoint check refused {path}: {exc}"
            await self._abort(state, why)
            raise ControlError(400, why, "BadRequestError", "kwargs.weights_path") from None
        if not state.named:
            self._retarget(txn, derived_version(path, state.number))
        if txn.source != "directory":  # begun as a stream (a transfer group exists): a directory after all,
            txn.source = "directory"  # and a directory is tried on a canary first
        load = self.refit.load(state.txn_id, path, records=checked.records)
        return await self._weights(state, "reload_weights", load, path)

    async def reset_prefix_cache(self) -> bool:
        """Within the transaction: recorded (the reset step runs at ``/resume``); outside: every serving
        engine's and the router's prefix index, as ``POST /fleet/reset_prefix_cache`` does
        (``router.fleet.cache_reset``)."""
        if self.open is not None:
            state, _ = self._current("reset_prefix_cache")
            state.reset_asked = True
            return True
        if (busy := self.refit.busy()) is not None:
            raise ControlError(409, busy)
        urls = list(self.fleet.backends.serving)
        report = CacheResetReport(await reset_engines(urls, VLLM_RESET_PATH, self.fleet.engine_key))
        report.router_entries_dropped = self.fleet.backends.policy.reset_cache_state()
        if not report.ok:
            failed = {e.url: e.detail for e in report.failures()} or "no engine is serving"
            raise ControlError(500, f"reset_prefix_cache failed: {failed}", "InternalServerError")
        return True

    def update_weight_version(self, version: str) -> str:
        if self.open is None:
            if version == self.fleet.current_version:
                return version
            raise ControlError(
                409,
                f"the fleet's version moves with its weights: /update_weight_version is taken between "
                f"/pause and /resume (the fleet is on {self.fleet.current_version!r}; to relabel it without "
                "new weights, POST /fleet/weight_version)",
            )
        state, txn = self._current("update_weight_version")
        state.named = True
        self._retarget(txn, version)
        return version

    async def resume(self) -> tuple[RefitTxn | None, str]:
        """End the transaction ``/pause`` began: commit it when weights were loaded, else abort it."""
        if self.open is None:
            if (busy := self.refit.busy()) is not None:
                raise ControlError(409, f"{busy}; /resume resumes only a pause made by /pause")
            if self.gate.paused:
                raise ControlError(
                    409, "the fleet is paused by POST /fleet/pause: resume it with POST /fleet/resume"
                )
            return None, "nothing was paused" + self._since()
        state, _ = self._current("resume")
        if state.started:
            raise ControlError(409, "resume: a weight update is open: call /finish_weight_update first")
        if not state.loaded:
            done = await self.refit.run(
                self.refit.abort(state.txn_id, "resumed with no new weights loaded since /pause")
            )
            self._finished(done)
            return done, f"no weights were loaded since /pause: the fleet stays on {done.previous_version!r}"
        done = await self.refit.run(self.refit.commit(state.txn_id, reset_cache=True))
        self._finished(done)
        if not done.moved:
            raise ControlError(500, done.error or "no engine verified the new weights", "InternalServerError")
        return done, "moved"

    # -- streamed weights --------------------------------------------------------------------------------
    def start_weight_update(self) -> RefitTxn:
        state, txn = self._current("start_weight_update")
        if self.routes.plan is None:
            raise ControlError(
                409, "start_weight_update: no weight-transfer group: call /init_weight_transfer_engine first"
            )
        if state.started:
            raise ControlError(409, "start_weight_update called while a weight update is already active")
        state.started = True
        return txn

    async def update_weights(self, update_info: Any) -> RefitTxn:
        state, txn = self._current("update_weights")
        if not state.started:
            raise ControlError(409, "start_weight_update must be called before update_weights")
        if not state.named:
            self._retarget(txn, derived_version(None, state.number))
        group = {e["url"] for e in (self.routes.plan or {}).get("engines", [])}
        receive = self.refit.receive(state.txn_id, update_info, group)
        return await self._weights(state, "update_weights", receive, "the streamed round")

    def finish_weight_update(self, version: str | None) -> RefitTxn:
        state, txn = self._current("finish_weight_update")
        if not state.started:
            raise ControlError(409, "finish_weight_update called without a matching start_weight_update")
        state.started = False
        if version is not None:
            state.named = True
            self._retarget(txn, version)
        return txn

    async def _weights(self, state: _Open, call: str, step: Awaitable[RefitTxn], what: str) -> RefitTxn:
        """Run a load or a streamed round of the open transaction; it ends here (the fleet serves on)
        when a canary failed or no engine took ``what``."""
        try:
            txn: RefitTxn = await self.refit.run(step)
        except RefitRefused as exc:  # it ended meanwhile (the lease, a revoked key)
            self.open = None
            raise ControlError(exc.status, f"{call}: {exc}") from None
        if txn.ended:  # its canary failed: nothing else was touched
            self._finished(txn)
            raise ControlError(500, txn.error or f"{call}: the canary failed", "InternalServerError")
        if not txn.live():
            why = f"no engine took {what}: {txn.to_json()['quarantined']}"
            await self._abort(state, why)
            raise ControlError(500, why, "InternalServerError")
        state.loaded = True
        return txn

    async def _abort(self, state: _Open, why: str) -> None:
        txn = await self.refit.run(self.refit.abort(state.txn_id, why))
        self._finished(txn)


def _ended(txn: RefitTxn, current: str | None) -> str:
    return (
        f"the refit begun by /pause ({txn.id}, towards {txn.version!r}) already ended ({txn.phase}: "
        f"{txn.error or 'no reason recorded'}); the fleet serves on {current!r}. Call /pause to begin again"
    )
