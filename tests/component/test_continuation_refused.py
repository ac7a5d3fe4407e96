"""A front that refuses the fields continuation adds gets the client's own bytes (issue 41, Dynamo finding).

With continuation on, the router sends an eligible request's first part as the client's bytes with
``stream``, ``stream_options.include_usage`` and ``return_token_ids`` appended. A Dynamo frontend behind
the builtin router refused that body (400: a field it does not know), and the client got the 400 of a
request it never sent. The front here is a real aiohttp server on 127.0.0.1 that does what such a front
does: any top-level field it does not know is answered 400 naming the field; a body it knows is answered
200 (a JSON completion, or an event stream when ``stream`` is true). What must hold: the client's answer
is byte for byte the front's answer to the client's own bytes, streamed and not; the front saw the
augmented body once, then only the client's bytes (the router remembers it); a request the front refuses
for the client's own reason gets the front's own 400 and teaches the router nothing.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from router import GenerationRouter
from tests.support.http_backends import router_factory

KNOWN = {"model", "prompt", "max_tokens", "temperature", "stream", "stream_options", "messages"}


class StrictFront:
    """A front that refuses unknown top-level fields (400), as Dynamo's OpenAI frontend does."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.bodies.append(raw)
        body = json.loads(raw)
        unknown = sorted(set(body) - KNOWN)
        if unknown or not isinstance(body.get("max_tokens", 1), int):
            why = f"unknown field `{unknown[0]}`" if unknown else "max_tokens: invalid type"
            return web.json_response({"error": {"message": why, "type": "invalid_request_error"}}, status=400)
        words = ["one", " two", " three", " four"][: body.get("max_tokens", 16)]
        if not body.get("stream"):
            choice = {"index": 0, "text": "".join(words), "finish_reason": "length"}
            return web.json_response({"id": "cmpl-front", "object": "text_completion", "choices": [choice]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, word in enumerate(words):
            done = "length" if i == len(words) - 1 else None
            chunk = {"id": "cmpl-front", "choices": [{"index": 0, "text": word, "finish_reason": done}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def start(self) -> StrictFront:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def front() -> AsyncIterator[StrictFront]:
    made = await StrictFront().start()
    yield made
    await made.stop()


@pytest.fixture
def routers() -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(probe_interval_s=0, continuation_max_moves=3) as make:
        yield make


async def _post(url: str, raw: bytes) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", data=raw, headers=headers) as r:
        return r.status, await r.read()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_front_that_refuses_the_added_fields_answers_the_clients_own_bytes(
    stream: bool, front: StrictFront, routers: Callable[..., GenerationRouter]
) -> None:
    router = routers([front.url])
    body: dict[str, Any] = {"model": "m", "prompt": "count", "max_tokens": 4, "temperature": 0}
    if stream:
        body["stream"] = True
    raw = json.dumps(body).encode()
    direct = await _post(front.url, raw)
    assert direct[0] == 200
    front.bodies.clear()

    got = await _post(router.base_url(), raw)
    assert got == direct, got  # byte for byte the front's answer to the client's bytes
    assert len(front.bodies) == 2 and b"return_token_ids" in front.bodies[0] and front.bodies[1] == raw

    front.bodies.clear()
    again = await _post(router.base_url(), raw)
    assert again == direct and front.bodies == [raw]  # remembered: the client's bytes at once


async def test_a_request_the_front_refuses_for_its_own_reason_gets_the_fronts_answer(
    front: StrictFront, routers: Callable[..., GenerationRouter]
) -> None:
    router = routers([front.url])
    bad = json.dumps({"model": "m", "prompt": "count", "max_tokens": 4, "best_effort": True}).encode()
    direct = await _post(front.url, bad)
    assert direct[0] == 400
    front.bodies.clear()
    assert await _post(router.base_url(), bad) == direct
    assert front.bodies[-1] == bad  # its answer to the client's bytes, not to the router's
    good = json.dumps({"model": "m", "prompt": "count", "max_tokens": 4}).encode()
    front.bodies.clear()
    status, _ = await _post(router.base_url(), good)
    assert status == 200 and b"return_token_ids" in front.bodies[0]  # nothing was remembered
