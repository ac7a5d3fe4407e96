"""What every engine kind offers the launcher: start, wait until healthy, stop, and where it serves.

One interface for real vLLM and the simulator, so the driver, the fleet-health controller and the tests
treat them alike; the simulator exists precisely to stand in for vLLM where GPUs are missing.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field


class EngineStartError(RuntimeError):
    """An engine died or missed its deadline while starting; the message carries its log tail."""


@dataclass
class EngineSpec:
    """How to start one engine instance (one OpenAI-compatible server)."""

    model: str
    served_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = None
    key_guard: bool = True
    """With ``api_key``: every route but ``/health`` takes the key (``launcher.engines.key_guard``), not
    only vLLM's ``/v1`` routes; the dev routes (``/pause``, ``/collective_rpc``...) are open otherwise."""
    tensor_parallel_size: int = 1
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_path: str | None = None
    startup_timeout_s: float = 600.0

    @property
    def name(self) -> str:
        return self.served_name or self.model


class Engine(ABC):
    """A running (or startable) engine. ``url`` is ``http://host:port``; ``api_url`` adds ``/v1``."""

    spec: EngineSpec

    @property
    @abstractmethod
    def port(self) -> int: ...

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/v1"

    @abstractmethod
    def start(self) -> None:
        """Begin starting; returns without waiting for readiness."""

    @abstractmethod
    def wait_ready(self, deadline: float | None = None) -> None:
        """Block until ``GET /health`` answers 200; raise ``EngineStartError`` (with the log tail) on
        death or when ``deadline`` (a ``time.monotonic()`` value) passes."""

    @abstractmethod
    def stop(self, grace_s: float = 10.0) -> None:
        """Stop and reap everything the engine started; idempotent."""

    @abstractmethod
    def is_alive(self) -> bool: ...

    def log_tail(self, lines: int = 40) -> str:
        return ""

    def start_and_wait(self) -> None:
        self.start()
        try:
            self.wait_ready(time.monotonic() + self.spec.startup_timeout_s)
        except BaseException:
            self.stop()
            raise


def start_all(engines: Sequence[Engine], timeout_s: float) -> None:
    """Start every engine at once and wait for all of them (a fleet's start is its slowest engine's, not
    the sum); if any fails or ``timeout_s`` passes, every one is stopped before the error propagates, so
    nothing half-started is left behind."""
    deadline = time.monotonic() + timeout_s
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready(deadline)
    except BaseException:
        for e in engines:
            e.stop()
        raise
