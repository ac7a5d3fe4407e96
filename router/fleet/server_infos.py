"""Each engine's ``/server_info`` answer, read once per serving period of the engine and kept.

vLLM answers its first ``GET /server_info`` only after collecting its system environment
(``vllm.collect_env.get_env_info``: ``pip list``, the compilers, ``nvidia-smi``...): 1.6 s on an idle 2-core
machine, over 5 s on a loaded one; later answers take milliseconds. A trainer's preflight reads the fleet's
``/control/server_info`` with a 5 s timeout (NeMo-RL's ``connect_timeout_s``): on a fleet nobody had
read yet it timed out (CI, 2026-12-05). The engines rl-launch starts are read once as they start
(``launcher.engines.vllm.engine.VllmEngine.wait_ready``); here the router keeps what each engine said, so
a caller is answered from what was read (an engine already read first), and callers that come together
share one read rather than each making the engine collect again (``functools.lru_cache`` does not hold a
second caller back). The router sends no read of its own accord: a backend that is not a vLLM in dev
mode never sees one. An engine that (re)enters serving is read afresh: a restarted engine at the same
address may run another configuration.
"""

from __future__ import annotations

import asyncio
from typing import Any

from router.fleet.engine import EngineAnswer, EngineClient
from router.state.backends import BackendSet

READ_TIMEOUT_S = 30.0
"""How long one read waits for the engine (the environment is collected on the engine's first read)."""


class ServerInfos:
    """``/server_info`` per engine and ``config_format``, kept for the engine's serving period."""

    def __init__(
        self, backends: BackendSet, engine_key: str | None, timeout_s: float = READ_TIMEOUT_S
    ) -> None:
        self.backends = backends
        self.engine_key = engine_key
        self.timeout_s = timeout_s
        self._reads: dict[tuple[str, str], asyncio.Task[EngineAnswer]] = {}
        backends.serving_listeners.append(self._entered)

    def _entered(self, url: str) -> None:
        """A URL (re)entered serving: forget what it said before."""
        for key in [k for k in self._reads if k[0] == url]:
            del self._reads[key]

    async def _read(self, url: str, fmt: str) -> EngineAnswer:
        async with EngineClient.open(self.engine_key, self.timeout_s) as engines:
            return await engines.server_info_answer(url, fmt)

    async def of(self, url: str, fmt: str = "json") -> EngineAnswer:
        """The engine's answer for ``fmt``: the kept one, the read in flight, or a new read (after any
        read of the engine in flight: its environment is collected once). A failed read is not kept
        (the next ask reads again); an engine that left the members is forgotten."""
        for key in [k for k in self._reads if k[0] not in self.backends.members]:
            del self._reads[key]
        loop = asyncio.get_running_loop()
        task = self._reads.get((url, fmt))
        if task is None or task.get_loop() is not loop or (task.done() and not _kept(task)):
            collecting = [
                t for k, t in self._reads.items() if k[0] == url and t.get_loop() is loop and not t.done()
            ]
            if collecting:
                await asyncio.wait(collecting)
                return await self.of(url, fmt)  # a read of this format may have started meanwhile
            task = loop.create_task(self._read(url, fmt))
            self._reads[(url, fmt)] = task
        return await asyncio.shield(task)

    async def close(self) -> None:
        """Cancel the reads in flight (the router's shutdown): a pending one would be destroyed with the
        loop."""
        pending = [t for t in self._reads.values() if not t.done()]
        self._reads.clear()
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def read_first(self, urls: list[str], fmt: str) -> list[str]:
        """``urls`` with those whose ``fmt`` answer is already kept first (they answer at once)."""
        return sorted(urls, key=lambda u: not _kept(self._reads.get((u, fmt))))


def _kept(task: asyncio.Task[EngineAnswer] | None) -> bool:
    if task is None or not task.done() or task.cancelled() or task.exception() is not None:
        return False
    return task.result().ok


def config_of(answer: EngineAnswer) -> dict[str, Any] | None:
    """The answer's ``vllm_config`` when it is an object (``json`` format), else None."""
    config = answer.body.get("vllm_config") if answer.ok and isinstance(answer.body, dict) else None
    return config if isinstance(config, dict) else None
