"""What a revoked consumer key held ends with it: its refit transaction, its plain pause.

A consumer's key is revoked by removing its entry from the consumers file (``router.consumers``): its job
ended, however it ended (the fleet's driver prunes the entries of ended jobs). Its requests stop at once
(every request is checked, and one held meanwhile is checked again when it is dispatched:
``router.http.auth.still_admitted``). But a pause or a refit transaction it began is the router's own
state, and before this nothing ended it: the transaction ran to its lease or deadline (both chosen by the
holder), a plain pause forever, and every other consumer's requests were held, then refused, meanwhile.

So the router's process that owns the fleet routes watches the file (``watch``): whenever the holder of
the transaction in progress, or of the plain pause in force, is no longer registered, it aborts that
transaction (touched engines stay out, the others resume on the old version, ``RefitCoordinator.abort``)
or resumes that pause (``FleetApi.end_held_by``). Level-triggered: it compares the holders with the file
as it is now, each period, so a revocation it was not looking at when it happened is still seen, and a
file that cannot be read keeps its last good table (``ConsumerKeys``): a damaged file revokes nothing.
"""

from __future__ import annotations

import asyncio
import logging

from router.consumers import ConsumerKeys
from router.fleet.api import FleetApi

log = logging.getLogger(__name__)


def holders(fleet: FleetApi) -> set[str]:
    """The consumers holding something now: the refit transaction's holder, the plain pause's."""
    out: set[str] = set()
    txn = fleet.refit.active
    if txn is not None and not txn.ended and txn.holder is not None:
        out.add(txn.holder)
    if fleet.pause_holder is not None:
        out.add(fleet.pause_holder)
    return out


async def end_revoked(keys: ConsumerKeys, fleet: FleetApi) -> dict[str, str]:
    """End what each revoked holder held; ``{holder: what was ended}``."""
    held = holders(fleet)
    if not held:
        return {}
    registered = keys.consumers()
    ended: dict[str, str] = {}
    for holder in sorted(held - set(registered)):
        what = await fleet.end_held_by(holder, f"consumer {holder}'s key was revoked")
        if what is not None:
            log.warning("consumer %s revoked: %s", holder, what)
            ended[holder] = what
    return ended


async def watch(keys: ConsumerKeys, fleet: FleetApi, period_s: float | None = None) -> None:
    """Run ``end_revoked`` every ``period_s`` (default: the file's own re-read period) until cancelled."""
    period = keys.reload_every_s if period_s is None else period_s
    while True:
        await asyncio.sleep(period)
        try:
            await end_revoked(keys, fleet)
        except Exception:  # the next period tries again; the watch itself must not die
            log.exception("ending what a revoked consumer held failed")
