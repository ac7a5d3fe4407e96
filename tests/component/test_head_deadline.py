"""A request's body that arrives while aiohttp hands the request to its handler must not arm the head
deadline (``router.http.connections.GuardedRequestHandler``): between ``start()`` taking the parsed
request off its queue and the handler task's first step, neither a request is in progress nor one queued,
and a body read in that window was taken for the start of a next head. Nothing cancelled that deadline, and
``head_timeout_s`` later the connection was closed in the middle of the answer (CI: two 800-token
generations through the router ended 499 at exactly 10.0 s). The window is a scheduling race on a real
socket, so it is reproduced here step by step on the handler itself, as the event loop orders it."""

from __future__ import annotations

import asyncio

from aiohttp import web

from router.http.connections import ConnectionGate, GuardedRequestHandler

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n"


class _Transport(asyncio.Transport):
    """A connection that goes nowhere (what the handler writes is dropped)."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


async def _ok(request: web.BaseRequest) -> web.Response:
    return web.Response(text="ok")


async def test_a_body_read_while_the_request_is_handed_over_arms_no_head_deadline() -> None:
    loop = asyncio.get_running_loop()
    handler = GuardedRequestHandler(web.Server(_ok), gate=ConnectionGate(16), head_timeout_s=30.0, loop=loop)
    transport = _Transport()
    handler.connection_made(transport)
    try:
        handler.data_received(HEAD)  # the whole head: its deadline is cancelled
        assert handler._head_timer is None and len(handler._messages) == 1
        handler._messages.popleft()  # what start() does before its handler task first runs
        handler.data_received(b"{}")  # the body, read in that window
        assert handler._head_timer is None, "the body armed the head deadline"
        # A next head begun on the kept-alive connection, once the body is whole, is still timed.
        handler.data_received(b"POST /v1/comp")
        assert handler._head_timer is not None
    finally:
        task = handler._task_handler
        if task is not None:
            task.cancel()
        handler.connection_lost(None)
