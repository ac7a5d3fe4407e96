"""The simulator's tokenizer: deterministic, reversible, and cheap enough for 64 engines on one core.

A token is a run of up to 4 bytes (``TOKEN_BYTES``) of UTF-8 text; its id encodes those bytes
bijectively, so ``/detokenize`` needs no vocabulary and the same text gives the same ids in every
process (a per-process vocabulary would give two engines different ids for one prompt). Ids reach about
4.3e9: fine for JSON and int64 tensors, not for int32 ones.

Chat messages are rendered like a ChatML template, and each template piece (role header, content, end
tag, generation prompt) is tokenized on its own, the way special tokens split a real tokenizer's output.
That is what makes prefix caching across turns work as in vLLM: turn 1's prompt followed by its sampled
output is exactly a token prefix of turn 2's prompt (which repeats that output as an assistant message),
instead of the 4-byte grid shifting at every message boundary and missing every block after the first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import orjson

TOKEN_BYTES = 4

# Ids of length-L byte runs start at _OFFSETS[L], so runs of different lengths never share an id
# (b"a" and b"\x00a" would otherwise both be 97).
_OFFSETS = (0, 0, 256, 256 + 256**2, 256 + 256**2 + 256**3)
_FULL_OFFSET = np.int64(_OFFSETS[4])

IM_START = "<|im_start|>"
IM_END = "<|im_end|>\n"
GENERATION_PROMPT = f"{IM_START}assistant\n"


def encode(text: str | bytes) -> list[int]:
    """Cut ``text`` into tokens of ``TOKEN_BYTES`` bytes (the last may be shorter).

    numpy does the full 4-byte runs in one pass: a 100k-token agent prompt costs about a millisecond,
    not the tens a Python loop would steal from every other engine sharing the event loop.
    """
    data = text.encode() if isinstance(text, str) else text
    n_full = len(data) // TOKEN_BYTES
    ids: list[int] = []
    if n_full:
        arr = np.frombuffer(data, dtype=">u4", count=n_full).astype(np.int64) + _FULL_OFFSET
        ids = arr.tolist()
    rest = data[n_full * TOKEN_BYTES :]
    if rest:
        ids.append(_OFFSETS[len(rest)] + int.from_bytes(rest, "big"))
    return ids


def decode_token(token_id: int) -> bytes:
    """The bytes of one token id; raises ``ValueError`` for an id no text can produce."""
    if token_id < 0 or token_id >= _OFFSETS[4] + 256**4:
        raise ValueError(f"token id {token_id} out of range")
    for length in (4, 3, 2, 1):
        if token_id >= _OFFSETS[length]:
            return (token_id - _OFFSETS[length]).to_bytes(length, "big")
    raise ValueError(f"token id {token_id} out of range")  # unreachable: _OFFSETS[1] == 0


def decode(ids: Iterable[int]) -> str:
    """Text of a token sequence; byte runs that split a UTF-8 character are joined before decoding."""
    return b"".join(decode_token(int(t)) for t in ids).decode("utf-8", errors="replace")


def _content_text(content: Any) -> str:
    """Message content as text: a string, or the text parts of an OpenAI content-part list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                parts.append(orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode())
        return "".join(parts)
    return orjson.dumps(content, option=orjson.OPT_SORT_KEYS).decode()


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of a chat prompt, ChatML-style, each template piece tokenized separately.

    Tool schemas go first (as real templates put them in the system turn), so agent traffic shares a
    long common prefix across sessions, which is the very case routing policies are judged on.
    """
    ids: list[int] = []
    if tools:
        ids += encode(f"{IM_START}tools\n")
        ids += encode(orjson.dumps(list(tools), option=orjson.OPT_SORT_KEYS))
        ids += encode(IM_END)
    for msg in messages:
        role = str(msg.get("role", "user"))
        ids += encode(f"{IM_START}{role}\n")
        ids += encode(_content_text(msg.get("content")))
        if msg.get("tool_calls"):
            ids += encode(orjson.dumps(msg["tool_calls"], option=orjson.OPT_SORT_KEYS))
        ids += encode(IM_END)
    if add_generation_prompt:
        ids += encode(GENERATION_PROMPT)
    return ids


def chain_hashes(tokens: Sequence[int], block_size: int, prev: list[int], n_blocks: int) -> None:
    """Extend ``prev`` (chained hashes of the first blocks of ``tokens``) to ``n_blocks`` entries.

    Each hash covers its block's tokens and, through the previous hash, everything before: two
    sequences share hash k exactly when they share the first k blocks, as in vLLM's prefix cache.
    Python's hash of a tuple of ints is the same in every process (only str/bytes hashing is salted).
    """
    h = prev[-1] if prev else 0
    for i in range(len(prev), n_blocks):
        h = hash((h, *tokens[i * block_size : (i + 1) * block_size]))
        prev.append(h)
