"""Tiny aiohttp engines of the bench's own tests: OpenAI chat completions and vLLM-style ``/metrics``, with
scripted failures, served from one background event-loop thread on OS-chosen 127.0.0.1 ports (usable from
synchronous and async tests alike)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


# ----------------------------------------------------------------------------------------------------
# A tiny engine: OpenAI chat completions + vLLM-style /metrics, with scripted failures
# ----------------------------------------------------------------------------------------------------
@dataclass
class TinyEngine:
    name: str
    statuses: list[int] = field(default_factory=list)  # consumed one per chat request; then 200
    always: int | None = None  # answer this status to every chat request
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    port: int = 0
    in_flight: int = 0
    peak: int = 0
    delay_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        status = self.always if self.always is not None else (self.statuses.pop(0) if self.statuses else 200)
        if status != 200:
            return web.json_response({"error": "scripted"}, status=status)
        n = len(self.bodies)
        return web.json_response(
            {
                "id": f"{self.name}-{n}",
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": f"{self.name} reply {n}"}}
                ],
                "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny-model", "object": "model"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        ok = sum(1 for _ in self.bodies)
        text = (
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            f'vllm:prefix_cache_queries_total{{model_name="tiny model"}} {100.0 * ok}\n'
            f'vllm:prefix_cache_hits_total{{model_name="tiny model"}} {75.0 * ok}\n'
            f'vllm:request_success_total{{finished_reason="length",model_name="m"}} {ok}\n'
            f'vllm:request_success_total{{finished_reason="stop",model_name="m"}} 0\n'
            f'vllm:request_success_created{{finished_reason="stop",model_name="m"}} 1.7e9\n'
        )
        return web.Response(text=text)


class TinyFleet:
    """Engines served from one background event-loop thread; usable from sync and async tests."""

    def __init__(self, engines: list[TinyEngine]) -> None:
        self.engines = engines
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runners: list[web.AppRunner] = []

    def __enter__(self) -> TinyFleet:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    async def _start(self) -> None:
        for e in self.engines:
            app = web.Application()
            app.router.add_post("/v1/chat/completions", e.chat)
            app.router.add_get("/v1/models", e.models)
            app.router.add_get("/metrics", e.metrics)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            e.port = runner.addresses[0][1]
            self._runners.append(runner)

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            for r in self._runners:
                await r.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]
