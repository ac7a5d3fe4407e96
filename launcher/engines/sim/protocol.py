"""The OpenAI/vLLM wire format: parse generation requests, decide outputs, shape responses and chunks.

Kept free of I/O and of the scheduler so the shapes can be checked on their own and the server module
stays about transport and faults. Field names follow vLLM's OpenAI server (``usage`` with
``prompt_tokens_details.cached_tokens``, ``stop_reason``, ``return_tokens_as_token_ids``, vLLM's
``return_token_ids``), because clients such as NeMo-Gym read them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from .config import SimConfig
from .decoding import greedy, model_key
from .tokens import TOKEN_BYTES, decode_token, encode, render_chat

Kind = Literal["chat", "completion"]


class ApiError(Exception):
    """A request the server refuses; rendered as an OpenAI error body with ``status``."""

    def __init__(
        self, status: int, message: str, err_type: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.err_type, self.param)


def error_body(status: int, message: str, err_type: str, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": err_type, "param": param, "code": status}})


@dataclass(slots=True)
class GenParams:
    """What a generation request asks for, validated."""

    kind: Kind
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    tokens_as_ids: bool = False
    return_token_ids: bool = False
    seed: int | None = None
    model: str = ""
    """The model the request named (its answer's ``model``): the served one, or a LoRA adapter's name."""


def _int(body: Mapping[str, Any], key: str, default: int | None) -> int | None:
    v = body.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'{key}' must be an integer", param=key)
    return v


def check_model(body: Mapping[str, Any], served: str, adapters: Collection[str] = ()) -> str:
    """The model a request names: the served one (also when it names none) or a loaded LoRA adapter's;
    404 for any other name, in vLLM 0.32's words."""
    model = body.get("model")
    if model is None:
        return served
    if model != served and model not in adapters:
        message = f"The model `{model}` does not exist. Valid aliases: {served}."
        raise ApiError(404, message, "NotFoundError", "model")
    return str(model)


def prompt_of(body: Mapping[str, Any], kind: Kind) -> list[int]:
    """Prompt token ids of a chat (``messages``) or completion (``prompt``) body."""
    if kind == "chat":
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages and all(isinstance(m, Mapping) for m in messages)):
            raise ApiError(400, "'messages' must be a non-empty list of objects", param="messages")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ApiError(400, "'tools' must be a list", param="tools")
        return render_chat(messages, tools, bool(body.get("add_generation_prompt", True)))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise ApiError(
            400,
            "'prompt' must be a string or a list of token ids (batches are not supported by the simulator)",
            param="prompt",
        )
    if not ids:
        raise ApiError(400, "The prompt cannot be empty.", param="prompt")
    return ids


def parse_generation(kind: Kind, body: Any, config: SimConfig, adapters: Collection[str] = ()) -> GenParams:
    """Validate a generation body (its model: the served one or one of the loaded ``adapters``); raises
    ``ApiError`` with vLLM's status for each refusal."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "request body must be a JSON object")
    model = check_model(body, config.model_name, adapters)
    n = _int(body, "n", 1)
    if n != 1:
        raise ApiError(400, "the simulator supports only n=1", param="n")
    prompt = prompt_of(body, kind)
    max_tokens = _int(body, "max_completion_tokens", None) if kind == "chat" else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None)
    if max_tokens is None:
        max_tokens = config.default_max_tokens
    if max_tokens < 1:
        raise ApiError(400, "max_tokens must be at least 1", param="max_tokens")
    total = len(prompt) + max_tokens
    if total > config.max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {config.max_model_len} tokens. "
            f"However, you requested {total} tokens ({len(prompt)} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages "
            "or completion.",
            param="max_tokens",
        )
    stream_options = body.get("stream_options") or {}
    raw_logprobs = body.get("logprobs")
    if kind == "chat":
        logprobs = bool(raw_logprobs)
        top = _int(body, "top_logprobs", 0) or 0
    else:  # completions: logprobs is the number of top alternatives, None = off
        logprobs = raw_logprobs is not None and raw_logprobs is not False
        top = raw_logprobs if isinstance(raw_logprobs, int) and not isinstance(raw_logprobs, bool) else 0
    return GenParams(
        kind=kind,
        prompt=prompt,
        max_tokens=max_tokens,
        ignore_eos=bool(body.get("ignore_eos", False)),
        min_tokens=_int(body, "min_tokens", 0) or 0,
        stream=bool(body.get("stream", False)),
        include_usage=bool(isinstance(stream_options, Mapping) and stream_options.get("include_usage")),
        logprobs=logprobs,
        top_logprobs=max(top, 0),
        tokens_as_ids=bool(body.get("return_tokens_as_token_ids", False)),
        return_token_ids=bool(body.get("return_token_ids", False)),
        seed=_int(body, "seed", None),
        model=model,
    )


@dataclass(slots=True)
class PlannedOutput:
    """The output a request will produce: ``text`` is exactly ``TOKEN_BYTES`` ASCII bytes per token,
    ``logprobs`` one per token."""

    tokens: list[int]
    text: str
    finish_reason: str
    logprobs: list[float]


def plan_output(params: GenParams, config: SimConfig, weights_salt: int | None = None) -> PlannedOutput:
    """Greedy output of the simulated model (``decoding.greedy``): a function of (engine seed, request
    seed, weights, context), so the same request gets the same text on every engine and every run,
    routing never changes what a rollout generates, a shorter ``max_tokens`` yields a prefix of a longer
    one, and a completions request whose ``prompt`` is this one's token ids plus the first k output ids
    yields exactly the rest (with ``max_tokens`` and ``min_tokens`` reduced by k), chat or completion.

    ``weights_salt`` (the loaded checkpoint's, see ``worker.SimWorker.output_salt``) changes the text
    as new weights change a real model's output; ``None`` (built-in weights) keeps the default text.
    With ``eos_max_tokens`` > 0 (and no ``ignore_eos``) the model ends a sequence with probability
    1/mean per token, mean = (eos_min_tokens + eos_max_tokens) / 2: an end decided by the context
    alone, as a continuation needs, so lengths are geometric rather than bounded by the pair."""
    eos_mean = 0
    if config.eos_max_tokens > 0 and not params.ignore_eos:
        eos_mean = max((config.eos_min_tokens + config.eos_max_tokens) // 2, 1)
    key = model_key(config.seed, params.seed, weights_salt)
    out = greedy(params.prompt, params.max_tokens, key, eos_mean, params.min_tokens)
    return PlannedOutput(out.tokens, out.text, "stop" if out.stopped else "length", out.logprobs)


def new_id(kind: Kind) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _piece(token_id: int) -> str:
    return decode_token(token_id).decode("utf-8", errors="replace")


def chat_logprobs(ids: list[int], lps: list[float], params: GenParams) -> dict[str, Any]:
    content = []
    for t, lp in zip(ids, lps, strict=True):
        piece = _piece(t)
        entry: dict[str, Any] = {
            "token": f"token_id:{t}" if params.tokens_as_ids else piece,
            "logprob": lp,
            "bytes": list(piece.encode()),
        }
        entry["top_logprobs"] = [dict(entry)] if params.top_logprobs > 0 else []
        content.append(entry)
    return {"content": content}


def completion_logprobs(ids: list[int], lps: list[float], params: GenParams, offset: int) -> dict[str, Any]:
    tokens = [f"token_id:{t}" if params.tokens_as_ids else _piece(t) for t in ids]
    return {
        "text_offset": [offset + i * TOKEN_BYTES for i in range(len(ids))],
        "token_logprobs": lps,
        "tokens": tokens,
        "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, lps, strict=True)]
        if params.top_logprobs > 0
        else None,
    }


def full_response(
    params: GenParams, rid: str, created: int, model: str, out: PlannedOutput, n_out: int, cached_tokens: int
) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` or ``text_completion`` body. With ``return_token_ids`` the
    choice has ``token_ids``, and ``prompt_token_ids`` is where vLLM 0.32 puts it: top level for chat,
    in the choice for completions."""
    ids = out.tokens[:n_out]
    lps = out.logprobs[:n_out]
    text = out.text[: n_out * TOKEN_BYTES]
    choice: dict[str, Any]
    if params.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": []},
            "logprobs": chat_logprobs(ids, lps, params) if params.logprobs else None,
            "finish_reason": out.finish_reason,
            "stop_reason": None,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": completion_logprobs(ids, lps, params, 0) if params.logprobs else None,
            "finish_reason": out.finish_reason,
            "stop_reason": None,
        }
        obj = "text_completion"
    if params.return_token_ids:
        if params.kind == "completion":
            choice["prompt_token_ids"] = params.prompt
        choice["token_ids"] = ids
    body: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(len(params.prompt), n_out, cached_tokens),
    }
    if params.return_token_ids and params.kind == "chat":
        body["prompt_token_ids"] = params.prompt
    return body


def stream_chunk(
    params: GenParams,
    rid: str,
    created: int,
    model: str,
    out: PlannedOutput,
    start: int,
    end: int,
    finished: bool,
) -> bytes:
    """One SSE event carrying output tokens ``[start, end)``; ``finish_reason`` on the last one. With
    ``return_token_ids`` the choice has ``token_ids``; a completion's first chunk (``start`` 0) carries
    ``prompt_token_ids`` in its choice, later ones null (vLLM 0.32; chat's are on ``role_chunk``)."""
    ids = out.tokens[start:end]
    lps = out.logprobs[start:end]
    text = out.text[start * TOKEN_BYTES : end * TOKEN_BYTES]
    finish = out.finish_reason if finished else None
    choice: dict[str, Any]
    if params.kind == "chat":
        choice = {
            "index": 0,
            "delta": {"content": text},
            "logprobs": chat_logprobs(ids, lps, params) if params.logprobs else None,
            "finish_reason": finish,
            "stop_reason": None,
        }
        obj = "chat.completion.chunk"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": completion_logprobs(ids, lps, params, start * TOKEN_BYTES)
            if params.logprobs
            else None,
            "finish_reason": finish,
            "stop_reason": None,
        }
        obj = "text_completion"
    if params.return_token_ids:
        if params.kind == "completion":
            choice["prompt_token_ids"] = params.prompt if start == 0 else None
        choice["token_ids"] = ids
    return sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]})


def role_chunk(rid: str, created: int, model: str, prompt_token_ids: list[int] | None = None) -> bytes:
    """The first chat chunk, announcing the assistant role with empty content (as vLLM sends); with
    ``return_token_ids`` it carries the rendered prompt's ``prompt_token_ids`` at top level."""
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    if prompt_token_ids is not None:
        chunk["prompt_token_ids"] = prompt_token_ids
    return sse(chunk)


def usage_chunk(params: GenParams, rid: str, created: int, model: str, n_out: int, cached: int) -> bytes:
    obj = "chat.completion.chunk" if params.kind == "chat" else "text_completion"
    return sse(
        {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [],
            "usage": usage(len(params.prompt), n_out, cached),
        }
    )


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def models_body(config: SimConfig, created: int | None = None) -> dict[str, Any]:
    """vLLM's ``/v1/models``: ``root`` is where the model was loaded from (the path given to ``vllm
    serve``: ``SimConfig.model_path``), the model name when there is none."""
    created = int(time.time()) if created is None else created
    name = config.model_name
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": config.model_path or name,
                "parent": None,
                "max_model_len": config.max_model_len,
                "permission": [],
            }
        ],
    }
