"""One answer out of two engines' parts (``router.continuation.stitch``): the client sees one id, every token
once, logprobs and text offsets continuous, usage once, its own shape (a chat client's continuation parts
are ``/v1/completions`` chunks turned back into chat chunks)."""

from __future__ import annotations

from typing import Any

import orjson

from router.continuation.plan import CHAT, COMPLETIONS, Plan, plan_of
from router.continuation.spans import Spans
from router.continuation.stitch import Answer, chat_entries


def _plan(path: str, **body: Any) -> Plan:
    plan = plan_of(path, orjson.dumps(body))
    assert plan is not None
    return plan


def _lp(tokens: list[str], first_offset: int) -> dict[str, Any]:
    lps = [-0.1 * (i + 1) for i in range(len(tokens))]
    return {
        "text_offset": [first_offset + 4 * i for i in range(len(tokens))],
        "token_logprobs": lps,
        "tokens": tokens,
        "top_logprobs": [{t: lp, "zzzz": -9.0} for t, lp in zip(tokens, lps, strict=True)],
    }


def _completion(rid: str, ids: list[int], tokens: list[str], offset: int, **extra: Any) -> dict[str, Any]:
    choice = {
        "index": 0,
        "text": "".join(tokens),
        "logprobs": _lp(tokens, offset),
        "finish_reason": extra.pop("finish_reason", None),
        "stop_reason": None,
        "token_ids": ids,
        **extra,
    }
    return {"id": rid, "object": "text_completion", "created": 11, "model": "m", "choices": [choice]}


def _usage(rid: str, prompt: int, completion: int) -> dict[str, Any]:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return {
        "id": rid,
        "object": "text_completion",
        "created": 99,
        "model": "m",
        "choices": [],
        "usage": usage,
    }


def test_completions_parts_stitched_for_a_streaming_client() -> None:
    plan = _plan(COMPLETIONS, prompt=[1, 2, 3], max_tokens=6, logprobs=1, stream=True)
    spans = Spans("v1")
    answer = Answer(plan, spans)
    out = [answer.feed(_completion("cmpl-A", [10, 11], ["aaaa", "bbbb"], 0, prompt_token_ids=[1, 2, 3]))]
    out.append(answer.feed(_completion("cmpl-A", [12], ["cccc"], 8)))
    assert answer.prompt_ids == [1, 2, 3] and answer.ids == [10, 11, 12] and answer.continuable
    # the engine dies; the move is a /v1/completions stream from [1, 2, 3, 10, 11, 12]
    answer.new_part()
    spans.change("v2", answer.produced)
    out.append(answer.feed(_completion("cmpl-B", [13, 14], ["dddd", "eeee"], 0, prompt_token_ids=[1, 2])))
    out.append(answer.feed(_completion("cmpl-B", [15], ["ffff"], 8, finish_reason="length")))
    assert answer.feed(_usage("cmpl-B", 6, 3)) is None  # a part's usage never reaches the client
    chunks = [c for c in out if c is not None]
    assert {c["id"] for c in chunks} == {"cmpl-A"} and {c["created"] for c in chunks} == {11}
    assert all("token_ids" not in c["choices"][0] for c in chunks)  # the client did not ask for them
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks)
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, 4, 8, 12, 16, 20]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "aaaabbbbccccddddeeeeffff"
    assert answer.finish_reason == "length" and answer.versions_due(chunks[-1])
    tail = answer.final_chunks()
    assert tail == b"data: [DONE]\n\n"  # no usage chunk: the client did not ask
    assert spans.spans(answer.produced) == [["v1", 0, 2], ["v2", 3, 5]]


def test_usage_counted_once_with_the_original_prompt() -> None:
    plan = _plan(COMPLETIONS, prompt="x", stream=True, stream_options={"include_usage": True})
    answer = Answer(plan, Spans(None))
    answer.feed(_completion("cmpl-A", [5, 6], ["aaaa", "bbbb"], 0, prompt_token_ids=[1, 2, 3, 4]))
    answer.new_part()
    answer.feed(_completion("cmpl-B", [7], ["cccc"], 0, finish_reason="stop"))
    answer.feed(_usage("cmpl-B", 6, 1))  # the move's own: its prompt is the original plus 2 tokens
    events = answer.final_chunks().split(b"\n\n")
    usage_chunk = orjson.loads(events[0][len(b"data: ") :])
    assert usage_chunk["id"] == "cmpl-A" and usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert usage_chunk["weight_versions"] == [[None, 0, 2]]
    assert events[1] == b"data: [DONE]"


def _chat(rid: str, ids: list[int], tokens: list[str], **extra: Any) -> dict[str, Any]:
    content = [
        {
            "token": t,
            "logprob": -0.5,
            "bytes": list(t.encode()),
            "top_logprobs": [{"token": t, "logprob": -0.5, "bytes": list(t.encode())}],
        }
        for t in tokens
    ]
    choice = {
        "index": 0,
        "delta": {"content": "".join(tokens)},
        "logprobs": {"content": content},
        "finish_reason": None,
        "token_ids": ids,
    }
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "m",
        "choices": [choice],
        **extra,
    }


def test_a_chat_answer_continued_through_completions_reads_as_chat() -> None:
    plan = _plan(
        CHAT,
        messages=[{"role": "user", "content": "q"}],
        logprobs=True,
        top_logprobs=1,
        return_token_ids=True,
    )
    answer = Answer(plan, Spans("v1"))
    role = {
        "id": "chatcmpl-A",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "m",
        "prompt_token_ids": [7, 8, 9],
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    first = answer.feed(role)
    assert first is not None and first["prompt_token_ids"] == [7, 8, 9]  # asked: kept, once
    answer.feed(_chat("chatcmpl-A", [20], ["abcd"]))
    answer.new_part()
    moved = answer.feed(_completion("cmpl-B", [21, 22], ["efgh", "ijkl"], 0, finish_reason="stop"))
    assert moved is not None
    assert (
        moved["id"] == "chatcmpl-A"
        and moved["object"] == "chat.completion.chunk"
        and "prompt_token_ids" not in moved
    )
    choice = moved["choices"][0]
    assert choice["delta"] == {"content": "efghijkl"} and choice["token_ids"] == [21, 22]
    assert choice["finish_reason"] == "stop"
    assert choice["logprobs"]["content"][0] == {
        "token": "efgh",
        "logprob": -0.1,
        "bytes": list(b"efgh"),
        "top_logprobs": [{"token": "efgh", "logprob": -0.1, "bytes": list(b"efgh")}],  # best 1 of 2
    }
    whole = answer.whole()
    assert whole["id"] == "chatcmpl-A" and whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["content"] == "abcdefghijkl"
    assert whole["choices"][0]["token_ids"] == [20, 21, 22] and whole["prompt_token_ids"] == [7, 8, 9]
    assert [e["token"] for e in whole["choices"][0]["logprobs"]["content"]] == ["abcd", "efgh", "ijkl"]
    assert whole["usage"]["completion_tokens"] == 3 and whole["usage"]["prompt_tokens"] == 3
    assert whole["weight_versions"] == [["v1", 0, 2]]


def test_a_chat_answer_that_a_parser_reads_is_not_continued() -> None:
    plan = _plan(CHAT, messages=[{"role": "user", "content": "q"}])
    answer = Answer(plan, Spans(None))
    event = _chat("chatcmpl-A", [1], ["abcd"])
    event["choices"][0]["delta"] = {"reasoning_content": "abcd"}
    answer.feed(event)
    assert not answer.continuable
    blind = Answer(plan, Spans(None))
    event = _chat("chatcmpl-A", [1], ["abcd"])
    del event["choices"][0]["token_ids"]  # an engine that ignores return_token_ids
    blind.feed(event)
    assert not blind.continuable


def test_chat_entries_keep_the_best_alternatives() -> None:
    lp = {"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": [{"a": -1.0, "b": -0.2, "c": -3.0}]}
    (entry,) = chat_entries(lp, 2)
    assert [t["token"] for t in entry["top_logprobs"]] == ["b", "a"]
    assert chat_entries(None, 2) == [] and chat_entries(lp, 0)[0]["top_logprobs"] == []


def test_a_whole_completion_answer() -> None:
    plan = _plan(COMPLETIONS, prompt="x", logprobs=0)
    answer = Answer(plan, Spans("v9"))
    answer.feed(_completion("cmpl-A", [5], ["aaaa"], 0, prompt_token_ids=[1]))
    answer.new_part()
    answer.feed(_completion("cmpl-B", [6], ["bbbb"], 0, finish_reason="length"))
    whole = answer.whole()
    choice = whole["choices"][0]
    assert choice["text"] == "aaaabbbb" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["text_offset"] == [0, 4] and choice["logprobs"]["tokens"] == ["aaaa", "bbbb"]
    assert "token_ids" not in choice and "prompt_token_ids" not in choice
    assert whole["usage"] == {"prompt_tokens": 1, "total_tokens": 3, "completion_tokens": 2}


def test_token_ids_the_client_did_not_ask_for_are_cut_from_the_engines_bytes() -> None:
    from router.continuation.loop import without_token_ids

    event = {
        "id": "c",
        "choices": [
            {"index": 0, "text": 'a "token_ids":[1] b', "token_ids": [5, 6], "prompt_token_ids": None}
        ],
    }
    cut = orjson.loads(without_token_ids(orjson.dumps(event)))
    assert cut == {"id": "c", "choices": [{"index": 0, "text": 'a "token_ids":[1] b'}]}  # the text untouched
    first = orjson.dumps({"prompt_token_ids": [1, 2], "choices": [{"token_ids": [], "text": ""}]})
    assert orjson.loads(without_token_ids(first)) == {"choices": [{"text": ""}]}
    plain = b'{"choices":[{"text":"x"}]}'
    assert without_token_ids(plain) is plain


def test_a_move_continues_after_the_last_token_whose_text_came() -> None:
    """Tokens streamed with empty text (bytes of an unfinished character) are taken back on a move: vLLM's
    detokenizer primed with a prompt that ends inside a character gives a wrong first piece."""
    plan = _plan(COMPLETIONS, prompt=[1], logprobs=1, max_tokens=10)
    answer = Answer(plan, Spans(None))
    answer.feed(_completion("cmpl-A", [10, 11], ["ab", "cd"], 0, prompt_token_ids=[1]))
    assert answer.settled == 2 and not answer.pending
    answer.feed(_completion("cmpl-A", [12, 13], ["", ""], 4))  # two byte tokens of one character
    assert answer.produced == 4 and answer.settled == 2 and answer.pending
    answer.cut_to_settled()
    assert answer.ids == [10, 11] and len(answer.completion_logprobs["tokens"]) == 2
    body = orjson.loads(plan.resume_body(answer.prompt_ids or [], answer.ids))
    assert body["prompt"] == [1, 10, 11] and body["max_tokens"] == 8
    answer.new_part()
    answer.feed(_completion("cmpl-B", [12, 13, 14], ["é", "", "ef"], 0, finish_reason="length"))
    whole = answer.whole()
    assert whole["choices"][0]["text"] == "abcdéef" and answer.ids == [10, 11, 12, 13, 14]
