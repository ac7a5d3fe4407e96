"""A bounded index of which backends recently received which prompt prefixes.

Prompts are cut into fixed-size blocks of the request body's raw bytes, each block hashed together with
the hash of everything before it (a chained hash, as vLLM's own prefix cache does with token blocks). Two
requests share the first k block hashes exactly when they share the first k blocks of bytes, so the
deepest common prefix with any earlier request is found by walking the chain until the first miss:
O(prompt length), no tokenizer, no per-request JSON re-serialisation.

Why raw bytes and not tokens: the router must not call a tokenizer per request (vllm-router 0.1.17 calls
each worker's render endpoint for every request); the JSON a client sends for a growing conversation is a
byte-prefix of the next turn's JSON from the ``"messages"`` key onwards, which is all that matters.

Memory is bounded by a byte budget: entries are kept in LRU order and the oldest are evicted. Each entry
remembers the few backends that most recently received that block, most recent first.
"""

from __future__ import annotations

from collections import OrderedDict

# Where the conversation starts in an OpenAI request body: fields before it (model, seed, metadata)
# may differ between turns of one session and must not break the prefix chain.
_PROMPT_KEYS = (b'"messages"', b'"prompt"', b'"input"')
_SPACE = frozenset(b" \t\r\n")

# Rough bytes per index entry on CPython 3.11: the OrderedDict node and slot (~100), the int key (~32) and
# the holders tuple (~56-80). Measured with tracemalloc in tests/unit/test_policies.py.
ENTRY_BYTES = 200


def prompt_start(body: bytes) -> int:
    """Offset of the first conversation key in a JSON body, or 0 when none is found.

    A key preceded by a backslash is inside a string value, not a key, and is skipped.
    """
    best = len(body)
    for key in _PROMPT_KEYS:
        i = body.find(key, 0, best)
        while i > 0 and body[i - 1] == 0x5C:  # backslash: inside a string
            i = body.find(key, i + 1, best)
        if i >= 0:
            best = i
    return best if best < len(body) else 0


def _boundaries(body: bytes, start: int) -> list[int]:
    """Offsets of each ``}`` followed by ``,{`` or ``]``, whitespace allowed in between (Python's
    ``json.dumps``, which Gym's aiohttp client and the OpenAI client use, writes ``}, {``; orjson writes
    ``},{``). ``bytes.find`` is memchr: far faster than a regex scan for the few braces of a chat body."""
    out: list[int] = []
    find = body.find
    n = len(body)
    i = find(b"}", start)
    while i >= 0:
        j = i + 1
        while j < n and body[j] in _SPACE:
            j += 1
        if j < n:
            c = body[j]
            if c == 0x5D:  # ]
                out.append(i)
            elif c == 0x2C:  # ,
                j += 1
                while j < n and body[j] in _SPACE:
                    j += 1
                if j < n and body[j] == 0x7B:  # {
                    out.append(i)
        i = find(b"}", i + 1)
    return out


def block_hashes(body: bytes, block_bytes: int, start: int = 0, max_blocks: int | None = None) -> list[int]:
    """Chained hashes of the blocks of ``body[start:]``, cut at message boundaries and every
    ``block_bytes`` within a message.

    Boundaries are content-defined: just before a ``}`` followed by ``,{`` or ``]``, whitespace
    allowed (the end of one message object in a ``messages`` array). Turn k+1 of a session has turn k's
    messages as a byte prefix but continues after the last of them with ``,{`` where turn k had ``]``;
    cutting before that ``}`` makes turn k's last message a complete block in both, so even a short
    final message (a task line, a tool result) identifies the session. Bytes after the last boundary
    (closing brackets, sampling options) are not hashed. A body without boundaries (a completions
    ``prompt`` string) is cut into fixed blocks, the partial last one dropped.
    """
    bounds = _boundaries(body, start)
    if not bounds:
        bounds = [start + ((len(body) - start) // block_bytes) * block_bytes]
    limit = max_blocks if max_blocks is not None else len(body)
    out: list[int] = []
    append = out.append
    h = 0
    pos = start
    for end in bounds:
        while pos < end:
            if len(out) >= limit:
                return out
            cut = min(pos + block_bytes, end)
            h = hash((h, body[pos:cut]))
            append(h)
            pos = cut
    return out


_BRANCH = -1  # child marker: more than one distinct continuation seen (CPython's hash() is never -1)


class PrefixIndex:
    """block hash -> (child, holders...): the one continuation seen after this block (``None`` for a
    leaf, ``_BRANCH`` once two different ones were seen) and the backends that most recently received
    it (most recent first, at most ``holders_per_block``).

    The child marker is what separates "this request continues a conversation" from "this request shares
    a prefix with others": turn k+1 of a session resends turn k's prompt, whose last block was a leaf,
    while a new session diverges after a system prompt that other sessions already continued
    differently.
    """

    def __init__(self, max_bytes: int = 64 * 1024 * 1024, holders_per_block: int = 4) -> None:
        if max_bytes < ENTRY_BYTES:
            raise ValueError(f"index max_bytes must be at least {ENTRY_BYTES}")
        if holders_per_block < 1:
            raise ValueError("index holders_per_block must be >= 1")
        self.max_bytes = max_bytes
        self.max_entries = max_bytes // ENTRY_BYTES
        self.holders_per_block = holders_per_block
        self._entries: OrderedDict[int, tuple[int | None, *tuple[str, ...]]] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def approx_bytes(self) -> int:
        return len(self._entries) * ENTRY_BYTES

    def continuation_holders(self, hashes: list[int]) -> tuple[tuple[str, ...], int]:
        """Who holds the conversation this request continues, and how many blocks of it match.

        Walks the chain to the deepest known block. The request *continues* a conversation when that
        block is a leaf (the previous turn's prompt ended there), or when the whole prompt matched
        (identical requests, e.g. a GRPO group's first turns): then its holders are returned. When the
        deepest block already had a different continuation, the request merely shares a prefix (a
        system prompt, a task other group members went on from) and the answer is "nobody": the caller
        balances load instead of piling every new session onto the engine that saw the prefix first.
        O(prompt blocks); independent of the fleet size.
        """
        entries = self._entries
        last = None
        depth = 0
        for h in hashes:
            entry = entries.get(h)
            if entry is None:
                break
            last = entry
            depth += 1
        if last is None or (depth < len(hashes) and last[0] is not None):
            return (), depth
        return last[1:], depth  # type: ignore[return-value]

    def clear(self) -> int:
        """Forget every block (the engines' caches were flushed: stale holders would pull sessions to an
        engine that no longer has their prefix). Returns how many entries were dropped."""
        dropped = len(self._entries)
        self._entries.clear()
        return dropped

    def record(self, hashes: list[int], backend: str) -> None:
        """Note that ``backend`` received a prompt with these blocks; refreshes their recency."""
        entries = self._entries
        keep = self.holders_per_block - 1
        n = len(hashes)
        move_to_end = entries.move_to_end
        for i, h in enumerate(hashes):
            nxt = hashes[i + 1] if i + 1 < n else None
            entry = entries.get(h)
            if entry is None:
                entries[h] = (nxt, backend)
                continue
            child = entry[0]
            if nxt is not None and child != nxt:
                child = nxt if child is None else _BRANCH
            if child == entry[0] and entry[1] == backend:
                move_to_end(h)  # the common case (a session's next turn): only the recency changes
                continue
            holders = entry[1:]
            if holders[0] != backend:
                holders = (backend, *tuple(u for u in holders if u != backend)[:keep])
            entries[h] = (child, *holders)
            move_to_end(h)
        overflow = len(entries) - self.max_entries
        if overflow > 0:
            self.evictions += overflow
            popitem = entries.popitem
            for _ in range(overflow):
                popitem(last=False)

    def discard(self, hashes: list[int], backend: str) -> None:
        """Remove ``backend`` from the holders of these blocks (its attempt failed); a block left with no
        holder is dropped, so a walk stops before it. Child markers set by the failed record stay: at
        worst a later request is placed by load instead of by affinity."""
        entries = self._entries
        for h in hashes:
            entry = entries.get(h)
            if entry is None or backend not in entry[1:]:
                continue
            holders = tuple(u for u in entry[1:] if u != backend)
            if holders:
                entries[h] = (entry[0], *holders)
            else:
                del entries[h]
