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
from collections.abc import Callable

# Where the conversation starts in an OpenAI request body: fields before it (model, seed, metadata)
# may differ between turns of one session and must not break the prefix chain.
_PROMPT_KEYS = (b'"messages"', b'"prompt"', b'"input"')

# Rough bytes per index entry on CPython 3.11: the OrderedDict node and slot (~100), the int key (~32) and
# the holders tuple (~56-80). Measured with tracemalloc in tests/test_policies.py.
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
    """Offsets of each ``}`` followed by ``,{`` or ``]`` (``bytes.find`` is memchr: far faster than a
    regex scan for the few braces a chat body has)."""
    out: list[int] = []
    find = body.find
    i = find(b"}", start)
    while i >= 0:
        nxt = body[i + 1 : i + 3]
        if nxt == b",{" or nxt[:1] == b"]":
            out.append(i)
        i = find(b"}", i + 1)
    return out


def block_hashes(body: bytes, block_bytes: int, start: int = 0, max_blocks: int | None = None) -> list[int]:
    """Chained hashes of the blocks of ``body[start:]``, cut at message boundaries and every
    ``block_bytes`` within a message.

    Boundaries are content-defined: just before a ``}`` followed by ``,{`` or ``]`` (the end of one
    message object in a ``messages`` array). Turn k+1 of a session has turn k's messages as a byte prefix
    but continues after the last of them with ``,{`` where turn k had ``]``; cutting before that ``}``
    makes turn k's last message a complete block in both, so even a short final message (a task line, a
    tool result) identifies the session. Bytes after the last boundary (closing brackets, sampling
    options) are not hashed. A body without boundaries (a completions ``prompt`` string) is cut into
    fixed blocks, the partial last one dropped.
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


class PrefixIndex:
    """block hash -> the backends (most recent first, at most ``holders_per_block``) that received it."""

    def __init__(self, max_bytes: int = 64 * 1024 * 1024, holders_per_block: int = 4) -> None:
        if max_bytes < ENTRY_BYTES:
            raise ValueError(f"index max_bytes must be at least {ENTRY_BYTES}")
        self.max_bytes = max_bytes
        self.max_entries = max_bytes // ENTRY_BYTES
        self.holders_per_block = holders_per_block
        self._entries: OrderedDict[int, tuple[str, ...]] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def approx_bytes(self) -> int:
        return len(self._entries) * ENTRY_BYTES

    def match_depths(self, hashes: list[int], eligible: Callable[[str], bool]) -> dict[str, int]:
        """How many leading blocks of ``hashes`` each backend holds beyond the common prefix.

        A block whose holder list is full (``holders_per_block`` backends) is *common*: a shared system
        prompt and tool list that many engines already hold. Common leading blocks say nothing about
        where a request belongs, so they are skipped and only the backends holding the first
        distinctive block are returned, with their depth. An empty result means "no affinity": the
        caller balances load instead of following the few most recent holders of a shared prompt.
        The cost does not grow with the fleet: only the few holders of each block are examined.
        """
        entries = self._entries
        full = self.holders_per_block
        alive: list[str] | None = None  # None: still in the common prefix
        depths: dict[str, int] = {}
        depth = 0
        for h in hashes:
            holders = entries.get(h)
            if holders is None:
                break
            if alive is None:
                if len(holders) >= full:
                    depth += 1
                    continue
                alive = [u for u in holders if eligible(u)]
            else:
                still = [u for u in alive if u in holders]
                if len(still) != len(alive):
                    for u in alive:
                        if u not in still:
                            depths[u] = depth
                    alive = still
            if not alive:
                break
            depth += 1
        for u in alive or ():
            depths[u] = depth
        return depths

    def record(self, hashes: list[int], backend: str) -> None:
        """Note that ``backend`` received a prompt with these blocks; refreshes their recency."""
        entries = self._entries
        cap = self.holders_per_block
        for h in hashes:
            holders = entries.get(h)
            if holders is None:
                entries[h] = (backend,)
            else:
                if holders[0] != backend:
                    entries[h] = (backend, *tuple(u for u in holders if u != backend)[: cap - 1])
                entries.move_to_end(h)
        overflow = len(entries) - self.max_entries
        if overflow > 0:
            self.evictions += overflow
            popitem = entries.popitem
            for _ in range(overflow):
                popitem(last=False)
