"""A real aiohttp server on 127.0.0.1 (OS-chosen port) that records what reaches it, for the tests of where
the launcher's credentials go: a front whose ``/metrics`` mimics ours, a redirect's target, a proxy.

``answers`` maps a path to ``(status, body, headers)``; any other path answers 404. Every request is
recorded as ``(method, path or absolute URL as sent, Authorization header or None)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class RecordingServer:
    answers: dict[str, tuple[int, str, dict[str, str]]] = field(default_factory=dict)
    seen: list[tuple[str, str, str | None]] = field(default_factory=list)
    runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def authorizations(self) -> list[str]:
        return [auth for _, _, auth in self.seen if auth is not None]

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append((request.method, str(request.rel_url), request.headers.get("Authorization")))
        status, body, headers = self.answers.get(request.path, (404, "not here", {}))
        return web.Response(status=status, text=body, headers=headers)

    async def start(self) -> RecordingServer:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = int(self.runner.addresses[0][1])
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
