"""The simulated model: greedy decoding that is a function of the context alone, as a real model's is.

Why: the router continues a request whose engine died, was drained or quarantined by sending another
engine the prompt's token ids plus the tokens produced so far (``issues show 41``). With a real model
and greedy decoding that continuation yields the very tokens (and logprobs) the uninterrupted run would
have; a simulator that planned a whole answer from the prompt alone would answer the continuation with
a different text and hide every stitching bug. So each next token, its logprob and the end-of-sequence
decision come from a hash of the whole context (prompt + tokens so far), never from a per-request plan.

The context hash is a polynomial hash mod 2**64: numpy computes it over a long prompt in one pass, and
each generated token extends it in O(1), so a continuation prompt hashes to exactly the state the
uninterrupted run had at that token. Generated tokens are 4-byte ASCII pieces of filler words, so their
text re-tokenizes to the same ids (a chat turn's reply resent as an assistant message keeps the prefix
cache warm, see ``tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .tokens import TOKEN_BYTES, encode

_MASK = (1 << 64) - 1
_P = 0x100000001B3  # odd multiplier of the polynomial context hash

_WORDS = (
    "the and for with that this from into over under about after before while which there their "
    "model token cache block batch route engine agent tool call result value state step plan check "
    "retry queue fleet prefix decode prefill stream reply query order close open start stop train "
    "reward policy sample score trace apply merge split write read parse build test debug patch"
).split()


def _vocabulary() -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Every distinct 4-byte window of the filler text: word fragments, spaces included."""
    text = " " + " ".join(_WORDS) + " "
    pieces = sorted({text[i : i + TOKEN_BYTES] for i in range(len(text) - TOKEN_BYTES + 1)})
    return tuple(pieces), tuple(encode(p)[0] for p in pieces)


VOCAB_TEXT, VOCAB_IDS = _vocabulary()
_V = len(VOCAB_IDS)


def mix64(x: int) -> int:
    """splitmix64's finalizer: every output bit depends on every input bit (the polynomial hash's low
    bits alone depend only on the tokens' low bits)."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def context_hash(ids: Sequence[int]) -> int:
    """sum(t_i * P**(n-1-i)) mod 2**64; ``extend(context_hash(a), t) == context_hash(a + [t])``."""
    n = len(ids)
    if n == 0:
        return 0
    arr = np.asarray(ids, dtype=np.uint64)
    pows = np.full(n, _P, dtype=np.uint64)
    pows[0] = 1
    pows = np.cumprod(pows)[::-1]  # uint64 arithmetic wraps: exactly mod 2**64
    return int(np.sum(arr * pows, dtype=np.uint64))


def extend(h: int, token_id: int) -> int:
    return (h * _P + token_id) & _MASK


def model_key(engine_seed: int, request_seed: int | None, weights_salt: int | None) -> int:
    """What besides the context decides the output: the engine's seed, the request's ``seed`` (the
    router's continuation sends the same one) and the weights (a checkpoint's or adapter's salt)."""
    key = mix64(engine_seed * 0x9E3779B97F4A7C15 + (request_seed or 0) + 1)
    if weights_salt is not None:
        key ^= mix64((weights_salt & _MASK) ^ 0xD6E8FEB86659FD93)
    return key


@dataclass(slots=True)
class Decoded:
    tokens: list[int]
    text: str
    logprobs: list[float]
    stopped: bool
    """True when the model ended the sequence (finish "stop") before ``max_tokens``."""


def greedy(
    prompt: Sequence[int], max_tokens: int, key: int, eos_mean: int = 0, min_tokens: int = 0
) -> Decoded:
    """Up to ``max_tokens`` tokens after ``prompt``.

    Each step hashes (context, key) into the token, its logprob, and whether the sequence ends after it
    (probability ``1/eos_mean`` per token once ``min_tokens`` are out; ``eos_mean`` 0 = never). All
    three depend on the context only, so ``greedy(prompt + out[:k], max_tokens - k, key, eos_mean,
    min_tokens - k)`` is exactly ``out[k:]`` (the continuation the router sends).
    """
    h = context_hash(prompt)
    tokens: list[int] = []
    pieces: list[str] = []
    lps: list[float] = []
    stopped = False
    for i in range(max_tokens):
        x = mix64(h ^ key)
        j = x % _V
        t = VOCAB_IDS[j]
        tokens.append(t)
        pieces.append(VOCAB_TEXT[j])
        lps.append(-((x >> 20) % 4000) / 1000.0)
        h = extend(h, t)
        if eos_mean > 0 and i + 1 >= min_tokens and (x >> 44) % eos_mean == 0:
            stopped = i + 1 < max_tokens
            break
    return Decoded(tokens, "".join(pieces), lps, stopped)
