"""Which requests are continued, and the bodies their engines get: the first part's and a move's.

A request is continued only when the router can put its answer back together exactly:

* ``POST /v1/completions`` or ``/v1/chat/completions`` with a JSON object body the router reads (orjson);
* one choice (``n`` absent or 1, no ``best_of`` above 1), no ``echo``, no ``suffix``, no
  ``prompt_logprobs``, no ``stream_options.continuous_usage_stats`` (usage on every chunk would count
  each part's tokens from zero);
* completions: ``prompt`` one string or one list of token ids (a batch is several answers);
* chat: no ``tools`` unless ``tool_choice`` is ``"none"``, no ``response_format``, no guided decoding
  (``guided_*``, ``structured_outputs``): the engine's tool-call and structured-output parsers read the
  whole text of an answer, and a continuation is a plain completion nobody re-parses. A chat answer whose
  first part shows reasoning or tool-call deltas (a reasoning parser on the server) stops being
  continued at that point (``stitch.Answer``), for the same reason.

Anything else goes through the proxy as before, byte for byte.

The first part goes to the route the client called, its body the client's bytes with only what the
router needs to see tokens added at the end (``with_fields``): ``stream: true`` with usage,
``return_token_ids: true``. A move goes to ``/v1/completions`` with
the prompt's token ids (the engine's own, from the first part: for chat, the rendered template) plus the
tokens produced so far, the budget left, and the client's sampling fields, so that greedy decoding goes on
where it stopped. What does not carry over exactly: ``presence_penalty``/``frequency_penalty`` count the
continuation's output only, and a stop string that straddles a move is not seen (docs/continuation.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
VLLM_COMPLETIONS_MAX_TOKENS = 16
"""vLLM's ``max_tokens`` for a completions request that names none: the budget a move continues."""

# Sampling and decoding fields a move passes on as the client sent them (both routes have them).
CARRIED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "return_tokens_as_token_ids",
    "priority",
    "user",
)
_GUIDED = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


@dataclass
class Plan:
    """What the router needs of an eligible request: its kind, what the client asked to get back, and the
    fields a move carries on."""

    chat: bool
    body: dict[str, Any]
    stream: bool
    include_usage: bool
    token_ids: bool
    """The client asked for ``return_token_ids`` (else token ids are taken out of its answer)."""
    logprobs: int | None
    """Top alternatives per token the client asked (chat ``top_logprobs``, completions ``logprobs``);
    None: no logprobs."""
    max_tokens: int | None
    """The client's budget (None: the rest of the context, chat's default)."""
    min_tokens: int
    model: Any
    first_body: bytes = field(default=b"")

    def resume_body(self, prompt_ids: list[int], produced: list[int]) -> bytes:
        """A move's ``/v1/completions`` body: the prompt's ids and the tokens produced as its prompt, the
        budget that is left."""
        body: dict[str, Any] = {k: self.body[k] for k in CARRIED if k in self.body}
        if self.model is not None:
            body["model"] = self.model
        body["prompt"] = prompt_ids + produced
        body["max_tokens"] = None if self.max_tokens is None else max(self.max_tokens - len(produced), 1)
        if self.min_tokens:
            body["min_tokens"] = max(self.min_tokens - len(produced), 0)
        if self.logprobs is not None:
            body["logprobs"] = self.logprobs
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        body["return_token_ids"] = True
        return orjson.dumps(body)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def plan_of(path: str, raw: bytes) -> Plan | None:
    """The plan of a request the router continues, None for any other (it is proxied as it is)."""
    chat = path == CHAT
    if not chat and path != COMPLETIONS:
        return None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict):
        return None
    if body.get("n", 1) not in (1, None) or (body.get("best_of") or 1) != 1:
        return None
    if body.get("echo") or body.get("suffix") is not None or body.get("prompt_logprobs") is not None:
        return None
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return None
    if options and options.get("continuous_usage_stats"):
        return None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None  # an engine refuses it: its answer to the client's own bytes
        if body.get("tools") and body.get("tool_choice") != "none":
            return None
        if any(body.get(k) is not None for k in _GUIDED):
            return None
        logprobs = (_int_or_none(body.get("top_logprobs")) or 0) if body.get("logprobs") else None
        max_tokens = _int_or_none(body.get("max_completion_tokens"))
        if max_tokens is None:
            max_tokens = _int_or_none(body.get("max_tokens"))
    else:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or _token_list(prompt)):
            return None
        if any(body.get(k) is not None for k in _GUIDED):
            return None
        raw_lp = body.get("logprobs")
        logprobs = _int_or_none(raw_lp)
        if raw_lp is not None and logprobs is None:
            return None  # a logprobs value vLLM would refuse: its answer, not the router's
        max_tokens = body.get("max_tokens", VLLM_COMPLETIONS_MAX_TOKENS)
        if max_tokens is not None and _int_or_none(max_tokens) is None:
            return None
    plan = Plan(
        chat=chat,
        body=body,
        stream=bool(body.get("stream")),
        include_usage=bool(options and options.get("include_usage")),
        token_ids=bool(body.get("return_token_ids")),
        logprobs=logprobs,
        max_tokens=max_tokens,
        min_tokens=_int_or_none(body.get("min_tokens")) or 0,
        model=body.get("model"),
    )
    wanted = {
        "stream": True,
        "stream_options": {**(options or {}), "include_usage": True},
        "return_token_ids": True,
    }
    plan.first_body = with_fields(raw, body, wanted)
    return plan


def with_fields(raw: bytes, body: dict[str, Any], wanted: dict[str, Any]) -> bytes:
    """``raw`` (a JSON object, ``body`` parsed) with the ``wanted`` fields it does not have already added
    at its end. The client's bytes are kept as they are (no re-serialization of a 40 KB conversation, its
    numbers and escapes as written); a key added again overrides the client's, as the last of duplicate
    keys wins in every parser an engine uses (``json.loads``, orjson, pydantic)."""
    changes = {k: v for k, v in wanted.items() if body.get(k) != v}
    if not changes:
        return raw
    head = raw.rstrip()[:-1].rstrip()
    added = b",".join(orjson.dumps(k) + b":" + orjson.dumps(v) for k, v in changes.items())
    return head + (b"," if body else b"") + added + b"}"


def _token_list(prompt: Any) -> bool:
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )
