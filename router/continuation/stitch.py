"""One answer out of several engines' parts: what was produced, and the client's chunks and body.

``Answer.feed`` takes each event of a part (parsed JSON) and keeps what a move needs (the prompt's token
ids, the tokens produced) and what the client's answer is made of (text, logprobs, the finish reason),
and gives back the chunk the client gets for it, in the shape the client asked:

* the first part's ``id``, ``created`` and ``model`` on every chunk;
* a chat client's continuation parts (``/v1/completions`` chunks) turned back into chat chunks: the text
  as ``delta.content``, the completions logprobs as ``logprobs.content`` entries (``token``,
  ``logprob``, ``bytes``, ``top_logprobs`` as the client's ``top_logprobs`` asked);
* a completions client's ``text_offset`` continued across parts;
* ``token_ids`` and ``prompt_token_ids`` only where the client asked ``return_token_ids``;
* no part's usage chunk: one, at the end (``final_chunks``), when the client asked ``include_usage``,
  counting the original prompt once and every produced token once.

A non-streamed client gets ``whole()``: the same answer as one JSON body.
"""

from __future__ import annotations

from typing import Any

import orjson

from router.continuation.plan import Plan
from router.continuation.spans import Spans


def chat_entries(logprobs: dict[str, Any] | None, top: int) -> list[dict[str, Any]]:
    """Completions logprobs (``tokens``, ``token_logprobs``, ``top_logprobs`` as {token: logprob}) as chat
    ``logprobs.content`` entries with the ``top`` best alternatives each."""
    if not logprobs:
        return []
    tokens = logprobs.get("tokens") or []
    lps = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or [None] * len(tokens)
    out = []
    for token, lp, alts in zip(tokens, lps, tops, strict=False):
        best = sorted((alts or {}).items(), key=lambda kv: -(kv[1] if kv[1] is not None else -1e30))[:top]
        out.append(
            {
                "token": token,
                "logprob": lp,
                "bytes": list(token.encode("utf-8", "replace")),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(t.encode("utf-8", "replace"))} for t, v in best
                ],
            }
        )
    return out


class Answer:
    def __init__(self, plan: Plan, spans: Spans) -> None:
        self.plan = plan
        self.spans = spans
        self.id: Any = None
        self.created: Any = None
        self.model: Any = None
        self.prompt_ids: list[int] | None = None
        self.ids: list[int] = []
        self.text: list[str] = []
        self.chars = 0
        self.chat_logprobs: list[dict[str, Any]] = []
        self.completion_logprobs: dict[str, list[Any]] = {
            "text_offset": [],
            "token_logprobs": [],
            "tokens": [],
            "top_logprobs": [],
        }
        self.finish_reason: Any = None
        self.stop_reason: Any = None
        self.usage: dict[str, Any] | None = None
        self.continuable = True
        self.settled = 0
        """Tokens up to the last one whose text came (or the finish)."""
        """False once the answer cannot be continued exactly (module ``plan``; no token ids)."""
        self.parts = 0
        self._chat_part = plan.chat
        self._shift = 0
        self._first_offset: int | None = None

    @property
    def produced(self) -> int:
        return len(self.ids)

    @property
    def pending(self) -> bool:
        """Tokens whose text the engine has not given yet (the bytes of an unfinished UTF-8 character, a
        skipped special token): a move must not cut after them (``cut_to_settled``)."""
        return len(self.ids) > self.settled

    def cut_to_settled(self) -> None:
        """Forget the tokens after the last one whose text came. vLLM's detokenizer, primed with a prompt
        that ends inside a character, gives the whole prompt's text as the continuation's first piece
        (tokenizers' ``DecodeStream``; docs/continuation.md, the detokenizer): a move continues from a
        settled token instead and the new engine makes the pending ones again (greedy: the same)."""
        n = self.settled
        del self.ids[n:]
        del self.chat_logprobs[n:]
        for values in self.completion_logprobs.values():
            del values[n:]

    def new_part(self) -> None:
        """A move: what follows is a ``/v1/completions`` stream continuing this answer."""
        self.parts += 1
        self._chat_part = False
        self._first_offset = None

    # -- the engine's events ------------------------------------------------------------------------
    def feed(self, event: dict[str, Any], reshape: bool = True) -> dict[str, Any] | None:
        """Keep what ``event`` carries; return the client's chunk for it (None: nothing for the client).
        Without ``reshape`` (a streamed first part, whose events the client gets as the engine wrote
        them), ``event`` is returned as it is, but for the finish chunk (it may carry the spans)."""
        if self.id is None:
            self.id, self.created, self.model = event.get("id"), event.get("created"), event.get("model")
        prompt_ids = event.pop("prompt_token_ids", None)
        choices = event.get("choices") or []
        if not choices:
            usage = event.get("usage")
            if usage is not None and self.usage is None and not self.parts:
                # The first part's: its cached tokens are the client's prompt's (a move's are of its own
                # prompt, the produced tokens included: not said when the first part's usage was lost).
                self.usage = usage
            if prompt_ids is not None and self.prompt_ids is None:
                self.prompt_ids = prompt_ids
            return None
        choice = choices[0]
        prompt_ids = choice.pop("prompt_token_ids", None) or prompt_ids
        if prompt_ids is not None and self.prompt_ids is None:
            self.prompt_ids = list(prompt_ids)
        ids = choice.get("token_ids")
        if self._chat_part:
            delta = choice.get("delta") or {}
            text = delta.get("content") or ""
            if delta.get("tool_calls") or delta.get("reasoning_content") or delta.get("reasoning"):
                self.continuable = False  # a parser is reading this answer (module plan)
        else:
            text = choice.get("text") or ""
        if ids is None:
            if text:
                self.continuable = False  # an engine without return_token_ids: nothing to continue from
            ids = []
        self.ids.extend(ids)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")
        if text or self.finish_reason is not None:
            self.settled = len(self.ids)
        logprobs = choice.get("logprobs")
        if self.parts and not text and not ids and choice.get("finish_reason") is None:
            return None  # a move's opening chunk (its prompt's ids): nothing of the answer
        if reshape or choice.get("finish_reason") is not None:
            out = self._client_chunk(event, choice, text, ids, logprobs, prompt_ids)
        else:
            out = event
        self.text.append(text)
        self.chars += len(text)
        return out

    def _client_chunk(
        self,
        event: dict[str, Any],
        choice: dict[str, Any],
        text: str,
        ids: list[int],
        logprobs: dict[str, Any] | None,
        prompt_ids: list[int] | None,
    ) -> dict[str, Any]:
        plan = self.plan
        event["id"], event["created"], event["model"] = self.id, self.created, self.model
        event.pop("usage", None)
        if plan.chat and not self._chat_part:  # a continuation part, back in chat shape
            entries = chat_entries(logprobs, plan.logprobs or 0) if plan.logprobs is not None else None
            choice = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": {"content": entries} if entries is not None else None,
                "finish_reason": choice.get("finish_reason"),
                "stop_reason": choice.get("stop_reason"),
                "token_ids": ids,
            }
            event["object"] = "chat.completion.chunk"
            event["choices"] = [choice]
            self.chat_logprobs.extend(entries or ())
        elif plan.chat:
            if logprobs:
                self.chat_logprobs.extend(logprobs.get("content") or ())
        elif logprobs:
            offsets = logprobs.get("text_offset")
            if offsets and self.parts:
                if self._first_offset is None:
                    self._first_offset = offsets[0]
                    self._shift = self.chars - offsets[0]
                logprobs["text_offset"] = offsets = [o + self._shift for o in offsets]
            kept = self.completion_logprobs
            for key in kept:
                kept[key].extend(logprobs.get(key) or ())
        if plan.token_ids:
            if prompt_ids is not None and self.parts == 0:
                if plan.chat:
                    event["prompt_token_ids"] = prompt_ids
                else:
                    choice["prompt_token_ids"] = prompt_ids
        else:
            choice.pop("token_ids", None)
        return event

    def versions_due(self, chunk: dict[str, Any]) -> bool:
        """Whether ``chunk`` carries the answer's spans: the finish chunk when no usage chunk follows."""
        choices = chunk.get("choices") or ()
        return not self.plan.include_usage and bool(choices) and choices[0].get("finish_reason") is not None

    # -- the answer's end ---------------------------------------------------------------------------
    def total_usage(self) -> dict[str, Any]:
        """The engine's own usage for an answer of one part; for a continued one, the original prompt's
        tokens and every produced token, each once."""
        if not self.parts and self.usage is not None:
            return self.usage
        first = self.usage or {}
        prompt = len(self.prompt_ids) if self.prompt_ids is not None else first.get("prompt_tokens", 0)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + self.produced,
            "completion_tokens": self.produced,
        }
        if first.get("prompt_tokens_details") is not None:
            usage["prompt_tokens_details"] = first["prompt_tokens_details"]
        return usage

    def final_chunks(self) -> bytes:
        """What ends a streamed answer: the usage chunk when the client asked for it, then ``[DONE]``."""
        out = b""
        if self.plan.include_usage:
            chunk = {
                "id": self.id,
                "object": "chat.completion.chunk" if self.plan.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": self.total_usage(),
                "weight_versions": self.spans.spans(self.produced),
            }
            out = b"data: " + orjson.dumps(chunk) + b"\n\n"
        return out + b"data: [DONE]\n\n"

    def whole(self) -> dict[str, Any]:
        """The answer as one JSON object (a client that did not ask to stream)."""
        plan = self.plan
        text = "".join(self.text)
        choice: dict[str, Any] = {"index": 0}
        if plan.chat:
            # vLLM 0.32's message (an empty tool_calls left out, as it does); no parser ran on it (plan).
            choice["message"] = {"role": "assistant", "content": text, "refusal": None, "annotations": None}
            choice["message"] |= {"audio": None, "function_call": None, "reasoning": None}
            choice["logprobs"] = {"content": self.chat_logprobs} if plan.logprobs is not None else None
        else:
            choice["text"] = text
            lp = self.completion_logprobs
            if plan.logprobs is not None and not plan.logprobs:
                lp = {**lp, "top_logprobs": lp["top_logprobs"] or None}
            choice["logprobs"] = lp if plan.logprobs is not None else None
        choice["finish_reason"] = self.finish_reason
        choice["stop_reason"] = self.stop_reason
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion" if plan.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.total_usage(),
        }
        if plan.token_ids:
            choice["token_ids"] = self.ids
            if plan.chat:
                body["prompt_token_ids"] = self.prompt_ids
            else:
                choice["prompt_token_ids"] = self.prompt_ids
        body["weight_versions"] = self.spans.spans(self.produced)
        return body
