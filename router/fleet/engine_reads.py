"""Reading an engine's answer with a bound: how much of it, and where it is parsed.

``router.fleet.engine.EngineClient`` reads every engine answer through here. Before, each was read whole
(``resp.text()``) and parsed on the caller's loop; an engine the trainer registered is any URL its
capability holder named, and one answering ``/metrics`` with 400 MB took the router from 106 to 933 MB
of memory and stalled its rollouts 3.6 s (a few GB would have killed the router's actor, and its restart
would have been handed the same engine back). Now an answer is read up to the cap of its route and
fails that engine's call past it, and a large one is decoded and parsed in a thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import aiohttp

T = TypeVar("T")

MAX_METRICS_BYTES = 8 * 1024 * 1024
"""The most of an engine's ``/metrics`` read: vLLM's is tens of KiB (a few hundred KiB with many LoRA
adapters or engine indexes), so 8 MiB is generous and still bounds what one engine costs the router."""
MAX_ANSWER_BYTES = 1024 * 1024
"""The most of any other engine answer read (JSON: versions, ``/server_info``, ``/v1/models``), but:"""
MAX_TABLE_BYTES = 64 * 1024 * 1024
"""The most of an answer with an entry per weight tensor (the checksums): a mixture-of-experts model has
tens of thousands of tensors, each hashed by every worker of the engine (TP x PP)."""
OFF_LOOP_BYTES = 64 * 1024
"""An answer at least this large is decoded and parsed in a thread, not on the caller's event loop (the
router's, which relays every rollout)."""


class AnswerTooLarge(ValueError):
    """An engine's answer past the cap of its route (``read_capped``): that engine's call fails."""


def _size(n: int) -> str:
    return f"{n / (1024 * 1024):g} MiB" if n >= 1024 * 1024 else f"{n / 1024:g} KiB"


async def read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The answer's body, at most ``limit`` bytes: a declared length past it is refused before a byte is
    read, and a body that grows past it (chunked, or a lying length) is dropped at ``limit`` plus one
    chunk. Raises ``AnswerTooLarge``; leaving the response unread closes its connection."""
    declared = resp.content_length
    if declared is not None and declared > limit:
        raise AnswerTooLarge(f"answer of {declared} bytes is over the {_size(limit)} cap")
    body = bytearray()
    async for chunk in resp.content.iter_chunked(64 * 1024):
        body += chunk
        if len(body) > limit:
            raise AnswerTooLarge(f"answer over the {_size(limit)} cap (read no further)")
    return bytes(body)


async def off_loop(fn: Callable[[str], T], text: str) -> T:
    """``fn(text)``, in a thread when ``text`` is large (``OFF_LOOP_BYTES``): a big answer parsed on the
    router's loop stalls every rollout it relays meanwhile."""
    if len(text) >= OFF_LOOP_BYTES:
        return await asyncio.to_thread(fn, text)
    return fn(text)


def _decode(raw: bytes, charset: str) -> str:
    try:
        return raw.decode(charset, errors="replace")
    except LookupError:  # a charset Python does not know
        return raw.decode("utf-8", errors="replace")


async def decoded(raw: bytes, charset: str) -> str:
    """``raw`` as text in ``charset`` (UTF-8 for one Python does not know), in a thread when large."""
    if len(raw) >= OFF_LOOP_BYTES:
        return await asyncio.to_thread(_decode, raw, charset)
    return _decode(raw, charset)
