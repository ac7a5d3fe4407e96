"""A generation request for an adapter, made ready for dispatch: who may, which version, which engines.

The forwarder calls ``AdapterRequests.prepare`` for every generation request when the fleet serves
adapters, whatever the table holds (an empty table too: a restarted router's engines may hold every
adapter). A body the router cannot read is refused (``UnreadableBody``), never forwarded unread. A
request whose ``model`` names no adapter is left alone (``None``): the base model's requests, and plain
names the engines judge (an unknown model is their 404, as without adapters).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.adapters.body import requested_model, with_model
from router.adapters.table import AdapterRoute, AdapterTable, BaseModelNotServed, TableRebuilding
from router.state.versions import VersionRefused, VersionWant


@dataclass(frozen=True)
class AdapterRequest:
    route: AdapterRoute
    body: bytes
    """The body to send: its ``model`` is the served name of the version chosen."""
    exclude: frozenset[str]
    """Serving engines that do not hold that version."""


class AdapterRequests:
    def __init__(self, table: AdapterTable, serving: Callable[[], Sequence[str]], max_wait_s: float) -> None:
        """``serving``: the serving engines now; ``max_wait_s``: how long a request gated on a version
        a refit in progress is loading waits for it (the router's ``version_max_wait_s``)."""
        self.table = table
        self.serving = serving
        self.max_wait_s = max_wait_s

    async def prepare(
        self, body: bytes, caller: str, want: VersionWant | None, large: bool = False
    ) -> AdapterRequest | None:
        """Raises ``UnreadableBody``, ``AdapterForbidden``, ``AdapterUnavailable``, ``UnknownVersion``
        (a gate on a version the adapter never had), ``VersionRefused`` (one still loading past the wait)
        and, on a fleet serving adapters only, ``BaseModelNotServed``. ``large``: the body is parsed and
        rewritten off the loop, as the forwarder hashes a large one (parsed on the loop, ~1 ms per MB holds
        every other request that long)."""
        table = self.table
        serves_base = table.plan.base_model
        loop = asyncio.get_running_loop()
        model = await loop.run_in_executor(None, requested_model, body) if large else requested_model(body)
        try:
            route = table.resolve(model, caller) if model is not None else None
        except TableRebuilding:  # a restarted router: what the engines hold is being read
            if not await table.until_rebuilt(self.max_wait_s):
                raise
            route = table.resolve(model, caller) if model is not None else None
        if route is None:
            if not serves_base:
                raise BaseModelNotServed(
                    f"this fleet serves its LoRA adapters only (generation.lora.base_model: false), and "
                    f'{model!r} names none: name your adapter in "model"'
                )
            return None
        if want is not None:
            until = time.monotonic() + self.max_wait_s
            narrowed = table.satisfies(route, want)
            while narrowed is None:
                left = until - time.monotonic()
                if left <= 0:
                    raise VersionRefused(
                        f"adapter {route.adapter.name!r} did not reach version {want.version!r} within "
                        f"{self.max_wait_s:g} s"
                    )
                await table.changed(left)
                route = table.resolve(model, caller) or route
                narrowed = table.satisfies(route, want)
            route = narrowed
        route.adapter.requests += 1  # once per request, however long its gate waited
        served = route.served
        if model != served:
            if large:
                body = await loop.run_in_executor(None, with_model, body, model, served)
            else:
                body = with_model(body, model, served)
        engines = route.target.engines
        exclude = frozenset(u for u in self.serving() if u not in engines)
        return AdapterRequest(route, body, exclude)
