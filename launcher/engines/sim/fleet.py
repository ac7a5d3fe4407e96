"""Many simulated engines in one process and one event loop, each on its own OS-chosen port.

Usable from async code (``await fleet.astart()``) or from synchronous code, which gets a background
thread running the loop (``fleet.start()``). URLs are returned only after every socket is bound, so a
caller can never hand out an address that refuses connections.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from .config import SimConfig
from .faults import FaultSpec
from .server import SimServer


class SimFleet:
    """``n`` engines sharing ``config`` (or one config each via ``configs``).

    Keyword arguments named after ``SimConfig`` fields override it (``SimFleet(16, speed=20)``), so
    callers that pass options by name (the replay bench) need not build a config; an unknown name is
    an error, since a silently ignored knob would make a benchmark measure something else. Every
    engine gets the same output seed (the same request yields the same text wherever it is routed)
    and its own fault dice.
    """

    def __init__(
        self,
        n: int = 1,
        config: SimConfig | None = None,
        *,
        configs: Sequence[SimConfig] | None = None,
        host: str = "127.0.0.1",
        ports: Sequence[int] | None = None,
        api_key: str | None = None,
        key_guard: bool = False,
        fault: FaultSpec | str | None = None,
        **config_overrides: Any,
    ) -> None:
        known = {f.name for f in dataclasses.fields(SimConfig)}
        unknown = sorted(set(config_overrides) - known)
        if unknown:
            raise TypeError(f"unknown SimConfig fields {unknown}; known: {sorted(known)}")
        if configs is not None:
            self.configs = [dataclasses.replace(c, **config_overrides) for c in configs]
        else:
            if n < 1:
                raise ValueError("a fleet needs at least one engine")
            base = config or SimConfig()
            self.configs = [dataclasses.replace(base, **config_overrides) for _ in range(n)]
        if ports is not None and len(ports) != len(self.configs):
            raise ValueError("ports must give one port per engine")
        self.servers = [
            SimServer(
                c,
                host=host,
                port=ports[i] if ports else 0,
                api_key=api_key,
                key_guard=key_guard,
                fault=fault,
                index=i,
            )
            for i, c in enumerate(self.configs)
        ]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self.servers)

    @property
    def urls(self) -> list[str]:
        """``http://127.0.0.1:port`` per engine (no ``/v1``); valid once started."""
        return [s.url for s in self.servers]

    # -- async use -------------------------------------------------------------------------------
    async def astart(self) -> list[str]:
        """Start every engine in the running loop; on any failure stop those started and re-raise."""
        try:
            for s in self.servers:
                await s.start()
        except BaseException:
            await self.astop()
            raise
        return self.urls

    async def astop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers), return_exceptions=True)

    async def aset_fault(
        self, index: int, fault: FaultSpec | str | dict[str, Any] | None, **params: Any
    ) -> FaultSpec:
        return await self.servers[index].set_fault(fault, **params)

    async def __aenter__(self) -> SimFleet:
        await self.astart()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.astop()

    # -- background-thread use ------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> list[str]:
        """Run the fleet on a daemon thread's event loop; returns the URLs once all are bound."""
        if self._thread is not None:
            raise RuntimeError("fleet already started")
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()
            loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=main, name="sim-fleet", daemon=True)
        self._thread.start()
        ready.wait(timeout)
        try:
            return self._call(self.astart(), timeout)
        except BaseException:
            self._shutdown_thread(timeout)
            raise

    def stop(self, timeout: float = 30.0) -> None:
        """Stop every engine and the thread. Idempotent."""
        if self._thread is None:
            return
        try:
            self._call(self.astop(), timeout)
        finally:
            self._shutdown_thread(timeout)

    def set_fault(
        self, index: int, fault: FaultSpec | str | dict[str, Any] | None, **params: Any
    ) -> FaultSpec:
        """Set engine ``index``'s fault from another thread (for a threaded fleet); in async code
        running on the fleet's own loop use ``aset_fault`` instead (this would deadlock there)."""
        return self._call(self.aset_fault(index, fault, **params), 30.0)

    def stats(self) -> list[dict[str, Any]]:
        """Per-engine counters and live state (see ``SimServer.stats_snapshot``)."""

        async def snap() -> list[dict[str, Any]]:
            return [s.stats_snapshot() for s in self.servers]

        if self._loop is None:
            return [s.stats_snapshot() for s in self.servers]
        return self._call(snap(), 30.0)

    def __enter__(self) -> SimFleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coro: Any, timeout: float) -> Any:
        if self._loop is None or self._thread is None:
            coro.close()
            raise RuntimeError("fleet not started with start(); use the async methods")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("called from the fleet's own loop; use the async methods")
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout)

    def _shutdown_thread(self, timeout: float) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout)
