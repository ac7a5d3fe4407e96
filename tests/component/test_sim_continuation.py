"""The simulator continues a request exactly, over HTTP, as real vLLM does with greedy decoding.

What the router's continuation (issue 41) relies on: ``return_token_ids`` gives the prompt's ids where
vLLM 0.32 puts them (chat: top level, on the role chunk when streamed; completions: in the choice, on
the first chunk when streamed) and every choice's ``token_ids``; a ``/v1/completions`` call whose
``prompt`` is those ids plus the first k output ids answers exactly the rest, logprobs included, for a
chat as for a completion.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson

from launcher.engines.sim import SimConfig, SimServer
from launcher.engines.sim.tokens import encode, render_chat

MakeServer = Callable[..., Awaitable[SimServer]]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Explain refits."}]


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with http.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        return orjson.loads(await r.read())


async def stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[Any]:
    async with http.post(url, json={**body, "stream": True}) as r:
        assert r.status == 200
        raw = (await r.read()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    return [orjson.loads(e[6:]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]


def chat_lps(choice_logprobs: dict[str, Any]) -> list[float]:
    return [e["logprob"] for e in choice_logprobs["content"]]


async def test_token_ids_where_vllm_puts_them(make_server: MakeServer, http: aiohttp.ClientSession) -> None:
    s = await make_server()
    prompt_ids = render_chat(MESSAGES)
    chat = await post(http, s.url + CHAT, {"messages": MESSAGES, "max_tokens": 8, "return_token_ids": True})
    assert chat["prompt_token_ids"] == prompt_ids and len(chat["choices"][0]["token_ids"]) == 8
    events = await stream(
        http, s.url + CHAT, {"messages": MESSAGES, "max_tokens": 8, "return_token_ids": True}
    )
    assert (
        events[0]["prompt_token_ids"] == prompt_ids
        and events[0]["choices"][0]["delta"]["role"] == "assistant"
    )
    streamed = [t for e in events[1:] for t in e["choices"][0]["token_ids"]]
    assert streamed == chat["choices"][0]["token_ids"]

    comp = await post(
        http, s.url + COMPLETIONS, {"prompt": "Once upon", "max_tokens": 6, "return_token_ids": True}
    )
    choice = comp["choices"][0]
    assert "prompt_token_ids" not in comp and choice["prompt_token_ids"] == encode("Once upon")
    events = await stream(
        http, s.url + COMPLETIONS, {"prompt": "Once upon", "max_tokens": 6, "return_token_ids": True}
    )
    assert events[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all(e["choices"][0]["prompt_token_ids"] is None for e in events[1:])
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == choice["token_ids"]
    plain = await post(http, s.url + COMPLETIONS, {"prompt": "Once upon", "max_tokens": 6})
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


async def test_a_chat_continued_on_another_engine_is_the_same_answer(
    make_server: MakeServer, http: aiohttp.ClientSession
) -> None:
    config = SimConfig(eos_min_tokens=30, eos_max_tokens=90)
    a, b = await make_server(config), await make_server(config)
    body = {"messages": MESSAGES, "max_tokens": 400, "logprobs": True, "return_token_ids": True, "seed": 1}
    whole = await post(http, a.url + CHAT, body)
    ids = whole["choices"][0]["token_ids"]
    assert whole["choices"][0]["finish_reason"] == "stop" and len(ids) > 10
    events = await stream(http, a.url + CHAT, body)
    k = 7  # the engine "died" after k tokens: continue the rest on b from prompt ids + produced
    prompt = events[0]["prompt_token_ids"] + ids[:k]
    rest_body = {"prompt": prompt, "max_tokens": 400 - k, "logprobs": 1, "return_token_ids": True, "seed": 1}
    rest = await post(http, b.url + COMPLETIONS, rest_body)
    assert rest["choices"][0]["token_ids"] == ids[k:]
    assert rest["choices"][0]["text"] == whole["choices"][0]["message"]["content"][4 * k :]
    assert rest["choices"][0]["logprobs"]["token_logprobs"] == chat_lps(whole["choices"][0]["logprobs"])[k:]
    assert rest["choices"][0]["finish_reason"] == "stop"
    streamed_rest = await stream(http, b.url + COMPLETIONS, rest_body)
    assert [t for e in streamed_rest for t in e["choices"][0]["token_ids"]] == ids[k:]


async def test_a_completion_continued_from_a_token_id_prompt(
    make_server: MakeServer, http: aiohttp.ClientSession
) -> None:
    s = await make_server()
    whole = await post(
        http, s.url + COMPLETIONS, {"prompt": "tell", "max_tokens": 50, "return_token_ids": True}
    )
    prompt_ids, ids = whole["choices"][0]["prompt_token_ids"], whole["choices"][0]["token_ids"]
    for k in (1, 25, 49):
        body = {"prompt": [prompt_ids + ids[:k]], "max_tokens": 50 - k, "return_token_ids": True}
        rest = await post(http, s.url + COMPLETIONS, body)
        assert rest["choices"][0]["token_ids"] == ids[k:] and rest["choices"][0]["finish_reason"] == "length"
