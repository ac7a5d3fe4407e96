"""The adapter table rebuilt from the engines: at the router's start, and for an engine that joins.

A restarted router (the Ray actor restarts with ``max_restarts=-1``) begins with an empty table while
the engines still hold every adapter version the router before it loaded. Until the table has taken in
what the serving engines hold (``router.adapters.adoption``), it is not ``rebuilt``: every adapter-looking
request, load and unload is refused with the reason. A router that starts before its engines (a fleet
coming up, a restarted actor whose controller pushes the engines a moment later) waits for the first
ones; an engine that enters while they are read is read too, and one that enters later has what it
holds adopted before its adapters are restored (``AdapterRefits.restore``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from router.adapters.adoption import adopt
from router.fleet.engine import EngineClient

if TYPE_CHECKING:
    from router.fleet.adapter_refit import AdapterRefits

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 30.0
"""How long the rebuild waits for one engine's ``/v1/models``; one that does not answer holds no
adapter for the router (none is routed there) until it rejoins."""


async def rebuild(refits: AdapterRefits) -> None:
    table, backends = refits.table, refits.fleet.backends
    while not backends.serving:
        refits.joined.clear()
        await refits.joined.wait()
    read: set[str] = set()
    async with EngineClient.open(refits.fleet.engine_key, READ_TIMEOUT_S) as engines:
        while todo := [u for u in backends.serving if u not in read]:
            listed = await asyncio.gather(*(engines.models(u) for u in todo))
            read.update(todo)
            for r in listed:
                if r.value is None:
                    log.warning("adapter table rebuild: %s did not list its models: %s", r.url, r.error)
            for stale in adopt(table, {r.url: r.value for r in listed if r.value is not None}):
                refits.drain_later(stale)
    table.rebuilt = True
    table.announce()
    held = [f"{a.current.served if a.current else a.name} ({a.owner})" for a in table.adapters.values()]
    log.info("adapter table rebuilt from %d engine(s): %s", len(read), ", ".join(held) or "no adapters")


async def rejoin(refits: AdapterRefits, url: str) -> None:
    """``url`` entered the serving set after the rebuild: adopt what it holds that the table does not
    know, then restore the table's adapters on it."""
    async with EngineClient.open(refits.fleet.engine_key, READ_TIMEOUT_S) as engines:
        listed = await engines.models(url)
    if listed.value is not None:
        for stale in adopt(refits.table, {url: listed.value}):
            refits.drain_later(stale)
    if refits.table.adapters and url in refits.fleet.backends.serving:
        await refits.restore(url)
