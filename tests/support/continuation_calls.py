"""A client's view of a continued generation (issue 41, ``router.continuation``) and the checks that a
stitched answer is the uninterrupted one: shared by the real-vLLM continuation test
(``tests/vllm/test_continuation_vllm.py``) and anything else that reads answers the way a trainer does.

``call`` sends one greedy request (completions or chat, streamed or not, token ids and logprobs asked)
and reads it into an ``Answer`` whatever its shape: the token ids, the text, each token's logprob and its
top alternatives, the finish reason, the usage, the ids the chunks carried, the per-token weight-version
spans (header and body) and, streamed, when each token arrived. ``differences`` says in words how a cut
answer differs from a whole one (empty: the same answer), with the logprob tolerance measured on vLLM 0.32's
CPU build (``LOGPROB_TOLERANCE``). Plain ``urllib`` in threads: what a user's script does.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
TOP = 2
"""Top alternatives asked per token (chat ``top_logprobs``, completions ``logprobs``)."""
LOGPROB_TOLERANCE = 1e-2
"""Largest |logprob difference| allowed between a token of a continued answer and the same token of the
uninterrupted one. Measured (the probe in docs/continuation.md, 375 split points, three prompts, a
second engine process): max 3.9e-3, most 0 to 3e-5; the bf16 CPU kernels' prefill (a continuation reads
the tokens produced as its prompt) and decode differ in the 1e-3 range."""
NEAR_TIE = 1e-3
"""A greedy choice whose runner-up is this close (logprob) can flip under that noise: the tiny random
model's distributions are flat (a 3e-5 gap between the two best tokens was seen in a 3500-token answer),
a trained model's rarely are. The one difference ``differences`` allows, and says so."""


def body(path: str, prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    """A greedy request of exactly ``max_tokens`` tokens that asks for token ids and logprobs."""
    out: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if path == CHAT:
        out |= {"messages": [{"role": "user", "content": prompt}], "logprobs": True, "top_logprobs": TOP}
    else:
        out |= {"prompt": prompt, "logprobs": TOP}
    if stream:
        out |= {"stream": True, "stream_options": {"include_usage": True}}
    return out


@dataclass
class Answer:
    """One answer as the client read it (streamed chunks or one JSON body, normalised)."""

    path: str
    stream: bool
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    ids: list[int] = field(default_factory=list)
    text: str = ""
    pieces: list[str] = field(default_factory=list)
    """Streamed: each chunk's text (chat ``delta.content``), one per chunk that carried tokens."""
    piece_ends: list[int] = field(default_factory=list)
    """Streamed: the token count after each of ``pieces``."""
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[str, float]]] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    usage: list[dict[str, Any]] = field(default_factory=list)
    answer_ids: set[str] = field(default_factory=set)
    prompt_ids: list[int] | None = None
    spans: Any = None
    """The body's ``weight_versions`` (whole: top level; streamed: the chunk that carried it)."""
    arrived: list[float] = field(default_factory=list)
    """Streamed: ``time.time()`` when each token's chunk was read."""
    errors: list[str] = field(default_factory=list)
    done: int = 0
    error_body: Any = None

    @property
    def header_spans(self) -> str | None:
        return self.headers.get("x-rl-weight-versions")


def _entries(path: str, logprobs: dict[str, Any] | None) -> list[tuple[str, float, list[tuple[str, float]]]]:
    if not logprobs:
        return []
    if path == CHAT:
        return [
            (e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e.get("top_logprobs") or ()])
            for e in logprobs.get("content") or ()
        ]
    tops = logprobs.get("top_logprobs") or [None] * len(logprobs["tokens"])
    return [
        (t, lp, sorted((top or {}).items(), key=lambda kv: -kv[1]))
        for t, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"], tops, strict=True)
    ]


def _take_choice(out: Answer, choice: dict[str, Any], now: float | None) -> None:
    chat = out.path == CHAT
    ids = choice.get("token_ids") or []
    if chat:
        piece = (choice.get("delta") or choice.get("message") or {}).get("content") or ""
    else:
        piece = choice.get("text") or ""
    entries = _entries(out.path, choice.get("logprobs"))
    if not chat and choice.get("logprobs"):
        out.text_offsets += choice["logprobs"].get("text_offset") or []
    out.ids += ids
    out.text += piece
    for token, lp, top in entries:
        out.tokens.append(token)
        out.logprobs.append(lp)
        out.tops.append(top)
    if out.stream and ids:
        out.pieces.append(piece)
        out.piece_ends.append(len(out.ids))
        out.arrived += [now or time.time()] * len(ids)
    if choice.get("finish_reason"):
        out.finish.append(choice["finish_reason"])
    if not chat and choice.get("prompt_token_ids"):
        out.prompt_ids = choice["prompt_token_ids"]


def _take_event(out: Answer, event: dict[str, Any]) -> None:
    now = time.time()
    if event.get("id") is not None:
        out.answer_ids.add(event["id"])
    if event.get("usage"):
        out.usage.append(event["usage"])
    if event.get("prompt_token_ids"):
        out.prompt_ids = event["prompt_token_ids"]
    if event.get("weight_versions") is not None:
        out.spans = event["weight_versions"]
    for choice in event.get("choices") or ():
        _take_choice(out, choice, now)


def call(
    url: str,
    path: str,
    request: dict[str, Any],
    request_id: str | None = None,
    on_tokens: tuple[int, Callable[[Answer], None]] | None = None,
    timeout_s: float = 600.0,
    headers: dict[str, str] | None = None,
) -> Answer:
    """Send ``request`` to ``url + path`` and read the answer. ``on_tokens=(n, f)``: a streamed read calls
    ``f(answer so far)`` once, when it holds ``n`` tokens (the test's moment to kill, drain, refit)."""
    stream = bool(request.get("stream"))
    out = Answer(path, stream)
    head = {"Content-Type": "application/json", **(headers or {})}
    if request_id is not None:
        head["X-Request-Id"] = request_id
    req = urllib.request.Request(url + path, data=json.dumps(request).encode(), headers=head)
    try:
        resp = urllib.request.urlopen(req, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        out.status = exc.code
        out.headers = {k.lower(): v for k, v in exc.headers.items()}
        raw = exc.read()
        try:
            out.error_body = json.loads(raw or b"null")
        except ValueError:
            out.error_body = raw.decode("utf-8", "replace")
        return out
    with resp:
        out.status = resp.status
        out.headers = {k.lower(): v for k, v in resp.headers.items()}
        if not stream:
            whole = json.loads(resp.read())
            _take_event(out, whole)
            return out
        fired = on_tokens is None
        name = ""
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.rstrip(b"\r\n")
            if not line:
                name = ""
                continue
            if line.startswith(b"event:"):
                name = line[6:].strip().decode()
                continue
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if name == "error":
                out.errors.append(data.decode("utf-8", "replace"))
                continue
            if data == b"[DONE]":
                out.done += 1
                continue
            _take_event(out, json.loads(data))
            if not fired and on_tokens is not None and len(out.ids) >= on_tokens[0]:
                fired = True
                on_tokens[1](out)
    return out


def in_thread(results: dict[str, Answer], key: str, *args: Any, **kw: Any) -> threading.Thread:
    """``call(*args, **kw)`` in a daemon thread, its answer (or the exception's text) into ``results``."""

    def run() -> None:
        try:
            results[key] = call(*args, **kw)
        except Exception as exc:  # the test reports it with the others
            failed = Answer(args[1], False)
            failed.errors.append(f"{type(exc).__name__}: {exc}")
            results[key] = failed

    t = threading.Thread(target=run, name=f"client-{key}", daemon=True)
    t.start()
    return t


def near_tie_flip(cut: Answer, whole: Answer, tie: float = NEAR_TIE) -> tuple[int, float] | None:
    """``(i, gap)`` when the answers' token ids first differ at ``i`` and, there, the whole answer's
    runner-up was within ``tie`` of the token it chose, and the cut answer chose that runner-up: a greedy
    choice between two near-equal logits that the bf16 noise between a prefill and a decode flipped
    (``NEAR_TIE``). None when they do not differ or differ otherwise."""
    at = next((i for i, (a, b) in enumerate(zip(cut.ids, whole.ids, strict=False)) if a != b), None)
    if at is None or at >= len(whole.tops) or at >= len(cut.tokens) or at >= len(whole.logprobs):
        return None
    chosen = whole.logprobs[at]
    for token, lp in whole.tops[at]:
        if token == cut.tokens[at] and token != whole.tokens[at] and abs(chosen - lp) <= tie:
            return at, abs(chosen - lp)
    return None


def differences(cut: Answer, whole: Answer, tolerance: float = LOGPROB_TOLERANCE) -> list[str]:
    """How ``cut`` differs from ``whole`` as a client sees it, in words (empty: the same answer). A
    near-tie flip (``near_tie_flip``) is not a difference: everything before it is compared, and the rest
    of the answer (made from another token on) only for its length, finish reason and usage."""
    out: list[str] = []
    if cut.status != 200:
        return [f"status {cut.status}: {cut.error_body!r}"[:600]]
    if cut.errors:
        out.append(f"error events: {cut.errors}"[:600])
    if cut.stream and cut.done != 1:
        out.append(f"{cut.done} [DONE] lines")
    flip = near_tie_flip(cut, whole)
    if flip is not None:
        cut, whole = _before(cut, flip[0]), _before(whole, flip[0])
    if cut.ids != whole.ids:
        at = next((i for i, (a, b) in enumerate(zip(cut.ids, whole.ids, strict=False)) if a != b), None)
        out.append(f"token ids differ: {len(cut.ids)} vs {len(whole.ids)} tokens, first difference at {at}")
    if flip is None and cut.text != whole.text:
        at = next((i for i, (a, b) in enumerate(zip(cut.text, whole.text, strict=False)) if a != b), None)
        at = at if at is not None else min(len(cut.text), len(whole.text))
        out.append(
            f"text differs at char {at}: {cut.text[max(0, at - 20) : at + 40]!r} vs "
            f"{whole.text[max(0, at - 20) : at + 40]!r}"
        )
    if cut.tokens != whole.tokens:
        out.append(f"logprob tokens differ ({len(cut.tokens)} vs {len(whole.tokens)})")
    if len(cut.logprobs) != len(whole.logprobs):
        out.append(f"{len(cut.logprobs)} logprobs vs {len(whole.logprobs)}")
    else:
        worst = max((abs(a - b) for a, b in zip(cut.logprobs, whole.logprobs, strict=True)), default=0.0)
        if worst > tolerance:
            out.append(f"a logprob differs by {worst:.3g} (> {tolerance:g})")
    out += _top_differences(cut, whole, tolerance)
    if flip is None and not _offsets_fit(cut):
        out.append(f"completions text_offset do not fit the text: {cut.text_offsets[:8]}...")
    if cut.finish != whole.finish:
        out.append(f"finish reasons {cut.finish} vs {whole.finish}")
    if [_usage(u) for u in cut.usage] != [_usage(u) for u in whole.usage]:
        out.append(f"usage {cut.usage} vs {whole.usage}")
    if len(cut.answer_ids) != 1:
        out.append(f"{len(cut.answer_ids)} answer ids: {sorted(cut.answer_ids)}")
    if cut.prompt_ids != whole.prompt_ids:
        out.append("prompt_token_ids differ")
    return out


def _offsets_fit(a: Answer) -> bool:
    """A completions answer's ``text_offset``: one per token, from 0, none past the text by more than
    the tokens' count. Not compared with the uninterrupted answer's: vLLM gives a chunk's first token the
    length of the text streamed so far and the others that plus their own token strings' lengths (a byte
    token's string is not its share of the text), so the offsets follow how the engine happened to chunk
    the stream (they need not even grow)."""
    offsets = a.text_offsets
    if not offsets:
        return a.path == CHAT or not a.ids
    within = all(0 <= o <= len(a.text) + len(a.ids) for o in offsets)
    return len(offsets) == len(a.ids) and offsets[0] == 0 and within


def _before(a: Answer, n: int) -> Answer:
    """``a``'s first ``n`` tokens (ids, logprobs, alternatives), the rest of it as it is."""
    return replace(a, ids=a.ids[:n], logprobs=a.logprobs[:n], tokens=a.tokens[:n], tops=a.tops[:n])


def _usage(u: dict[str, Any]) -> tuple[Any, ...]:
    return (u.get("prompt_tokens"), u.get("completion_tokens"), u.get("total_tokens"))


def _top_differences(cut: Answer, whole: Answer, tolerance: float) -> list[str]:
    """Every top alternative the cut answer shows is the whole one's (within ``tolerance``); one may be
    missing only where the whole answer has two alternatives that read the same (vLLM's completions
    ``top_logprobs`` is a dict by token string: partial UTF-8 bytes all read ``""``, and a continuation's
    alternatives come from it)."""
    out: list[str] = []
    for i, (a, b) in enumerate(zip(cut.tops, whole.tops, strict=False)):
        for token, lp in a:
            if not any(t == token and abs(v - lp) <= tolerance for t, v in b):
                out.append(f"token {i}: top alternative {token!r} {lp} not in {b}")
                break
        if len(a) < len(b):
            strings = [t for t, _ in b]
            if len(set(strings)) == len(strings):
                out.append(
                    f"token {i}: {len(a)} top alternatives of {len(b)}, none of them collide: {a} vs {b}"
                )
    if len(cut.tops) != len(whole.tops):
        out.append(f"{len(cut.tops)} top lists vs {len(whole.tops)}")
    return out[:5]


def pending_before(whole: Answer, at_token: int) -> bool:
    """Whether the streamed ``whole`` answer's piece just before token ``at_token`` was empty: the engine
    still held that character's bytes (an incomplete UTF-8 sequence) or the token was a skipped special
    one. A cut there is the detokenizer case of the probe note (section 3)."""
    for end, piece in zip(whole.piece_ends, whole.pieces, strict=True):
        if end == at_token:
            return piece == ""
        if end > at_token:
            return False
    return False


def record_line(record_dir: Path, request_id: str, timeout_s: float = 10.0) -> dict[str, Any] | None:
    """The router's record line of request ``request_id`` (the records are flushed every 0.25 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for f in sorted(record_dir.glob("requests*.jsonl")):
            for line in f.read_bytes().splitlines():
                if request_id.encode() in line:
                    rec = json.loads(line)
                    if rec.get("id") == request_id:
                        return rec  # type: ignore[no-any-return]
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)


def engine_counter(engine_url: str, key: str, name: str) -> float:
    """A counter of an engine's ``/metrics`` (e.g. ``vllm:generation_tokens_total``), summed over labels."""
    req = urllib.request.Request(engine_url + "/metrics", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def engine_completion(engine_url: str, key: str, prompt_ids: list[int], max_tokens: int) -> Answer:
    """A greedy ``/v1/completions`` straight to one engine from token ids (what a move sends)."""
    req = {
        "model": "tiny",
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    out = Answer(COMPLETIONS, False)
    request = urllib.request.Request(
        engine_url + COMPLETIONS,
        data=json.dumps(req).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(request, timeout=300) as resp:
        out.status = resp.status
        _take_event(out, json.loads(resp.read()))
    return out
