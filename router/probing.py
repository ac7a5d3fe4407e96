"""Optional active probing for a standalone router (no launcher controller feeding it).

Every ``interval_s`` each configured backend gets ``GET /health`` with a short timeout; a probe that hangs
counts as a failure. ``failures_to_remove`` consecutive failures take a backend out of the serving set,
one success brings it back. Under the launcher the fleet controller does this with more evidence (the
router's drained outcomes too), so probing is off by default there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp

from router.backends import BackendSet


class HealthProber:
    def __init__(
        self,
        backends: BackendSet,
        configured: Callable[[], tuple[str, ...]],
        session: Callable[[], aiohttp.ClientSession],
        interval_s: float,
        timeout_s: float = 2.0,
        failures_to_remove: int = 2,
    ) -> None:
        self.backends = backends
        self._configured = configured
        self._session = session
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.failures_to_remove = failures_to_remove
        self._failures: dict[str, int] = {}

    async def _probe(self, url: str) -> bool:
        try:
            async with self._session().get(url + "/health", timeout=self.timeout, allow_redirects=False) as r:
                return 200 <= r.status < 300
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def tick(self) -> None:
        urls = self._configured()
        results = await asyncio.gather(*(self._probe(u) for u in urls))
        serving = []
        for url, ok in zip(urls, results, strict=True):
            n = 0 if ok else self._failures.get(url, 0) + 1
            self._failures[url] = n
            in_set = url in self.backends.load
            if ok or (in_set and n < self.failures_to_remove):
                serving.append(url)
        self._failures = {u: self._failures[u] for u in urls}
        self.backends.replace(serving)

    async def run(self) -> None:
        while True:
            await self.tick()
            await asyncio.sleep(self.interval_s)
