"""What the forwarder reads off a request and its answer as they pass: the record's parts and the usage.

Nothing here buffers: the request's part of its record is taken from the body already read whole (its
block hashes the policy's own when it computed them), and the answer's end from the last chunks relayed,
kept by reference. The same end gives the consumer ledger the engine's ``usage.completion_tokens``
(``router.state.fair_share``). Apart from the forwarder so that what a record takes, and how the usage
is found, is read in one place and changed without touching the proxy.
"""

from __future__ import annotations

from aiohttp import web

from router.http.auth import CONSUMER
from router.http.bodies import LARGE_BODY_BYTES
from router.policies.base import RouteRequest
from router.policies.consistent_hash import session_key
from router.policies.prefix_index import block_hashes, prompt_start
from router.record.draft import RecordDraft, json_int
from router.record.format import MAX_PREFIX_BLOCKS

# Where the engine's usage is looked for: the end of a small answer, else the last chunks relayed.
USAGE_TAIL_BYTES = 16 * 1024
USAGE_TAIL_CHUNKS = 4
_USAGE_KEY = b'"completion_tokens"'
# The record's prompt blocks when the policy computed none (cache_aware's own are reused): its default.
RECORD_BLOCK_BYTES = 1024
# The answer's end the record keeps (its usage and finish reason are in the last few hundred bytes; a
# small copy, as the record holds it until its sink has it).
RECORD_TAIL_BYTES = 4096


def completion_tokens(tail: bytes) -> int:
    """The last ``"completion_tokens": N`` in ``tail`` (the end of an answer), 0 when there is none. A
    match inside a JSON string has its opening quote escaped, or is not followed by ``:`` (a key is; a
    string value ends with ``,`` or ``}``), so generated text cannot pass for it."""
    return json_int(tail, _USAGE_KEY) or 0


def record_tail(chunks: list[bytes]) -> bytes:
    """The last ``RECORD_TAIL_BYTES`` of a stream, from its last chunks (the last alone when it is
    long enough: no join of the others)."""
    last = chunks[-1]
    if len(last) >= RECORD_TAIL_BYTES or len(chunks) == 1:
        return last[-RECORD_TAIL_BYTES:]
    return b"".join(chunks)[-RECORD_TAIL_BYTES:]


def record_hashes(body: bytes) -> list[int]:
    """The record's block hashes of a prompt whose policy computed none (pure: runs in a thread too)."""
    return block_hashes(body, RECORD_BLOCK_BYTES, prompt_start(body), MAX_PREFIX_BLOCKS)


def draft_request(
    draft: RecordDraft,
    request: web.Request,
    route_request: RouteRequest,
    session_header: str,
    accounting: bool,
    record_text: bool,
) -> bool:
    """The request's part of its record: what is known before routing. The prompt's block hashes are
    the policy's own when it computed them (cache_aware), else computed here; True when they are
    still to be computed, off the loop (a large body, as ``prepare`` is)."""
    body = route_request.body
    features = route_request.features
    later = False
    if isinstance(features, list):
        hashes: list[int] | None = features
    elif len(body) > LARGE_BODY_BYTES:
        hashes, later = None, True
    else:
        hashes = record_hashes(body) if body else None
    draft.read_body(body, hashes)
    draft.session_key = session_key(request.headers, session_header, case_insensitive=True)
    if accounting:
        consumer = request.get(CONSUMER)
        if consumer is not None:
            draft.consumer = consumer.name
    if record_text:
        draft.prompt = body
    return later
