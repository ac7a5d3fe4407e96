"""Which requests the router continues, and the bodies their first part and their moves send
(``router.continuation.plan``); the event splitter and the version spans (``sse``, ``spans``)."""

from __future__ import annotations

import orjson
import pytest

from router.continuation.plan import CHAT, COMPLETIONS, plan_of
from router.continuation.spans import Spans, parse_header
from router.continuation.sse import Events


def _plan(path: str, **body: object):  # type: ignore[no-untyped-def]
    return plan_of(path, orjson.dumps(body))


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (COMPLETIONS, {"prompt": "hi", "n": 2}),
        (COMPLETIONS, {"prompt": "hi", "best_of": 3}),
        (COMPLETIONS, {"prompt": "hi", "echo": True}),
        (COMPLETIONS, {"prompt": "hi", "suffix": "x"}),
        (COMPLETIONS, {"prompt": ["a", "b"]}),  # a batch: several answers
        (COMPLETIONS, {"prompt": [[1, 2]]}),
        (COMPLETIONS, {"prompt": "hi", "stream_options": {"continuous_usage_stats": True}}),
        (COMPLETIONS, {"prompt": "hi", "prompt_logprobs": 1}),
        (CHAT, {"messages": [], "tools": [{"type": "function"}]}),
        (CHAT, {"messages": [], "response_format": {"type": "json_object"}}),
        (CHAT, {"messages": [], "structured_outputs": {"regex": "a+"}}),
        (CHAT, {"messages": "not a list"}),
        ("/v1/responses", {"input": "hi"}),
        ("/tokenize", {"prompt": "hi"}),
    ],
)
def test_what_is_not_continued(path: str, body: dict[str, object]) -> None:
    assert plan_of(path, orjson.dumps(body)) is None


def test_unreadable_bodies_are_not_continued() -> None:
    assert plan_of(COMPLETIONS, b'{"prompt": NaN}') is None  # orjson refuses: proxied as it is
    assert plan_of(COMPLETIONS, b"[1, 2]") is None
    assert plan_of(COMPLETIONS, b"\x1f\x8b compressed") is None


def test_the_first_part_asks_for_a_stream_with_token_ids_and_keeps_the_rest() -> None:
    plan = _plan(COMPLETIONS, model="m", prompt="hello", max_tokens=40, temperature=0.0, logprobs=2)
    assert plan is not None and not plan.chat and not plan.stream and not plan.include_usage
    assert plan.logprobs == 2 and plan.max_tokens == 40 and not plan.token_ids
    first = orjson.loads(plan.first_body)
    assert first == {
        "model": "m",
        "prompt": "hello",
        "max_tokens": 40,
        "temperature": 0.0,
        "logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    assert _plan(COMPLETIONS, prompt=[1, 2, 3]) is not None  # token ids
    assert _plan(COMPLETIONS, prompt="x").max_tokens == 16  # type: ignore[union-attr]  # vLLM's default


def test_a_move_continues_from_the_prompt_ids_and_the_tokens_produced() -> None:
    plan = _plan(
        CHAT,
        model="adapter@v2",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=50,
        min_tokens=10,
        logprobs=True,
        top_logprobs=3,
        temperature=0,
        seed=7,
        stop=["\n\n"],
        skip_special_tokens=False,
        tool_choice="none",
        tools=[{"type": "function"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    assert plan is not None and plan.chat and plan.stream and plan.include_usage and plan.logprobs == 3
    body = orjson.loads(plan.resume_body([1, 2, 3], [9, 8]))
    assert body == {
        "model": "adapter@v2",
        "prompt": [1, 2, 3, 9, 8],
        "max_tokens": 48,
        "min_tokens": 8,
        "logprobs": 3,
        "temperature": 0,
        "seed": 7,
        "stop": ["\n\n"],
        "skip_special_tokens": False,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    # chat without a budget: the rest of the context, as the first part had
    unbounded = _plan(CHAT, messages=[{"role": "user", "content": "x"}])
    assert unbounded is not None and unbounded.logprobs is None
    assert orjson.loads(unbounded.resume_body([1], [2]))["max_tokens"] is None


def test_events_whatever_the_chunking() -> None:
    stream = b'data: {"a": 1}\n\nevent: error\ndata: {"error": 2}\n\n: comment\n\ndata: [DONE]\r\n\r\n'
    whole = Events().feed(stream)
    assert whole == [("", b'{"a": 1}'), ("error", b'{"error": 2}'), ("", b"[DONE]")]
    for size in (1, 2, 3, 7):
        events = Events()
        got = []
        for i in range(0, len(stream), size):
            got += events.feed(stream[i : i + size])
        assert got == whole and not events.pending
    cut = Events()
    assert cut.feed(b'data: {"a"') == [] and cut.pending


def test_spans() -> None:
    spans = Spans("v3")
    assert spans.spans(0) == [] and spans.header(5) == "v3:0-4"
    spans.change("v3", 2)  # the same version: nothing starts
    spans.change("v4", 118)
    assert spans.header(241) == "v3:0-117,v4:118-240"
    assert parse_header(spans.header(241)) == spans.spans(241) == [["v3", 0, 117], ["v4", 118, 240]]
    spans.change(None, 241)  # a move to an engine whose version nobody stamped
    assert spans.header(250) == "v3:0-117,v4:118-240,unknown:241-249"
    assert parse_header("unknown:0-3") == [[None, 0, 3]]
    quick = Spans("v1")
    quick.change("v2", 0)  # nothing made on v1: replaced
    assert quick.spans(3) == [["v2", 0, 2]]
    back = Spans("a")
    back.change("b", 5)
    back.change("a", 5)  # b made nothing: a goes on
    assert back.spans(8) == [["a", 0, 7]]


def test_the_first_body_is_the_clients_bytes_with_the_routers_fields_after_them() -> None:
    raw = b'{"model": "m", "prompt": "caf\\u00e9", "temperature": 0.70, "stream": false}  \n'
    plan = plan_of(COMPLETIONS, raw)
    assert plan is not None
    assert plan.first_body.startswith(raw.rstrip()[:-1])  # the client's bytes, as written
    assert plan.first_body.endswith(
        b',"stream":true,"stream_options":{"include_usage":true},"return_token_ids":true}'
    )
    assert orjson.loads(plan.first_body)["stream"] is True  # the last of two keys wins
    streamed = b'{"prompt": "x", "stream": true, "stream_options": {"include_usage": true}}'
    plan = plan_of(COMPLETIONS, streamed)
    assert plan is not None and plan.first_body == streamed[:-1] + b',"return_token_ids":true}'
    asked = b'{"prompt": [1], "stream": true, "stream_options": {"include_usage": true}, '
    asked += b'"return_token_ids": true}'
    assert plan_of(COMPLETIONS, asked).first_body == asked  # type: ignore[union-attr]
