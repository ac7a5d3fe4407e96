"""Active health probing for a standalone router (no fleet controller feeding it its serving set).

Without it a standalone router whose engines all died kept routing to them and answered 500 forever
(a status clients retry) instead of its no-healthy status. So ``rl-launch router`` probes by default:

* every ``interval_s`` (start to start; a slow round delays the next, never stacks them) each member gets
  ``GET /health`` bounded by ``timeout_s``: a probe that hangs is a failure, so a wedged engine is seen;
* ``failures_to_eject`` consecutive failures eject a member from rotation. Proxied attempts count too
  (``BackendSet.outcome_listener``): requests failing on a backend between two probes are the same
  evidence, and they eject it before the next probe comes round;
* ``successes_to_readmit`` consecutive successful probes re-admit it (one lucky answer from a flapping
  engine is not enough).

With the defaults (every 1 s, 2 s timeout, 3 failures) a refused engine leaves within ~3 s and a wedged
one (each probe waits out its timeout, which delays the next round) within ~7 s, so the router answers
its no-healthy status well inside 10 s of the last engine dying. Under the launcher the fleet controller
owns the serving set with more evidence, and this prober is not started (``RouterConfig.probing``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from router.state.backends import BackendSet

log = logging.getLogger(__name__)


class HealthProber:
    def __init__(
        self,
        backends: BackendSet,
        session: Callable[[], aiohttp.ClientSession],
        interval_s: float,
        timeout_s: float = 2.0,
        failures_to_eject: int = 3,
        successes_to_readmit: int = 2,
    ) -> None:
        self.backends = backends
        self._session = session
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.failures_to_eject = failures_to_eject
        self.successes_to_readmit = successes_to_readmit
        self._failures: dict[str, int] = {}
        self._successes: dict[str, int] = {}
        backends.outcome_listener = self.observe

    def observe(self, url: str, ok: bool) -> None:
        """One outcome, from a probe or a proxied attempt: update the streaks, eject or re-admit."""
        if url not in self.backends.members:
            return
        if ok:
            self._failures[url] = 0
            n = self._successes[url] = self._successes.get(url, 0) + 1
            if url in self.backends.ejected and n >= self.successes_to_readmit:
                self.backends.readmit(url)
                log.warning("backend %s re-admitted after %d successful health probes", url, n)
        else:
            self._successes[url] = 0
            n = self._failures[url] = self._failures.get(url, 0) + 1
            if n >= self.failures_to_eject and self.backends.eject(url):
                left = len(self.backends.serving)
                log.warning("backend %s ejected after %d consecutive failures (%d serving)", url, n, left)

    async def _probe(self, url: str) -> bool:
        try:
            async with self._session().get(url + "/health", timeout=self.timeout, allow_redirects=False) as r:
                return 200 <= r.status < 300
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def tick(self) -> None:
        urls = self.backends.members
        results = await asyncio.gather(*(self._probe(u) for u in urls))
        for url, ok in zip(urls, results, strict=True):
            self.observe(url, ok)
        members = set(self.backends.members)
        self._failures = {u: n for u, n in self._failures.items() if u in members}
        self._successes = {u: n for u, n in self._successes.items() if u in members}

    async def run(self) -> None:
        next_at = time.monotonic()
        while True:
            await self.tick()
            next_at = max(next_at + self.interval_s, time.monotonic())
            await asyncio.sleep(next_at - time.monotonic())


NO_BACKENDS_WARNING = (
    "the router has no backends: every request gets the no-healthy status and /readiness 503 until one "
    "is registered (POST /workers, or --backend)"
)


async def warn_while_empty(backends: BackendSet, every_s: float = 30.0) -> None:
    """Repeat ``NO_BACKENDS_WARNING`` (the router logs it once at construction) every ``every_s`` until
    a worker is registered: a router without backends serves nothing, and says so loudly."""
    while True:
        await asyncio.sleep(every_s)
        if backends.members:
            return
        log.warning(NO_BACKENDS_WARNING)
