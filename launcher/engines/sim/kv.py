"""KV-cache blocks with a prefix cache: reference counts, chained-hash lookup, LRU eviction.

Only blocks nobody references can be evicted, so admitting new work never takes KV from a running
request. Block objects exist only while allocated or cached: free, never-hashed blocks are a counter,
so a fleet of 64 engines with 24k blocks each does not hold 1.5M idle Python objects.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class Block:
    """One KV block: ``ref`` requests hold it; ``hash`` is set once its tokens are computed and cached."""

    __slots__ = ("hash", "ref")

    def __init__(self) -> None:
        self.hash: int | None = None
        self.ref = 1


class BlockPool:
    """A fixed number of blocks; free = never used, or cached with no holder (evictable, LRU order)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._anon_free = num_blocks
        self._cached: dict[int, Block] = {}
        # Cached blocks no request holds, least recently freed first: the eviction order.
        self._lru: OrderedDict[int, Block] = OrderedDict()

    @property
    def num_free(self) -> int:
        return self._anon_free + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks held by requests (vLLM's ``kv_cache_usage_perc``; cached-free is free)."""
        return self.num_used / self.num_blocks

    def match_prefix(self, hashes: Sequence[int], max_blocks: int) -> int:
        """How many leading blocks of ``hashes`` (at most ``max_blocks``) are cached; no side effects."""
        if not self.enable_caching:
            return 0
        cached = self._cached
        n = 0
        for h in hashes[: max(max_blocks, 0)]:
            if h not in cached:
                break
            n += 1
        return n

    def can_allocate(self, hit_hashes: Sequence[int], new_blocks: int) -> bool:
        """Whether taking the cached ``hit_hashes`` and ``new_blocks`` fresh blocks fits now.

        Hits sitting in the LRU are free blocks too; taking them leaves fewer to allocate from.
        """
        lru = self._lru
        hits_free = sum(1 for h in hit_hashes if h in lru)
        return new_blocks <= self.num_free - hits_free

    def take_cached(self, hit_hashes: Sequence[int]) -> list[Block]:
        """Reference the cached blocks of a prefix hit (call before ``allocate`` so they are not evicted)."""
        out: list[Block] = []
        for h in hit_hashes:
            b = self._cached[h]
            if b.ref == 0:
                del self._lru[h]
            b.ref += 1
            out.append(b)
        return out

    def allocate(self, n: int) -> list[Block]:
        """``n`` fresh blocks, evicting least recently freed cached blocks when no blank one is left."""
        if n > self.num_free:
            raise RuntimeError(f"allocate({n}) with {self.num_free} free blocks")
        out: list[Block] = []
        for _ in range(n):
            if self._anon_free:
                self._anon_free -= 1
                out.append(Block())
            else:
                h, b = self._lru.popitem(last=False)
                del self._cached[h]
                b.hash = None
                b.ref = 1
                out.append(b)
        return out

    def register(self, block: Block, h: int) -> None:
        """Make a computed full block findable by its chained hash.

        If another request computed the same block meanwhile, the first copy stays the cached one and
        this block stays anonymous (freed blank), as in vLLM: no two cache entries per hash.
        """
        if self.enable_caching and block.hash is None and h not in self._cached:
            block.hash = h
            self._cached[h] = block

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference per block; tail blocks first, so a prompt's tail is evicted before its head
        (heads are what other requests share)."""
        for b in reversed(blocks):
            b.ref -= 1
            if b.ref == 0:
                if b.hash is not None:
                    self._lru[b.hash] = b
                else:
                    self._anon_free += 1

    def drop_cached(self) -> int:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``, after a weight update): evictable
        blocks become blank free ones, blocks requests still hold stay theirs but are no longer findable.
        Returns how many cache entries were dropped."""
        dropped = len(self._cached)
        for block in self._cached.values():
            block.hash = None
        self._anon_free += len(self._lru)
        self._cached.clear()
        self._lru.clear()
        return dropped

    def reset(self) -> None:
        """Forget everything (a killed engine restarts with an empty cache)."""
        self._anon_free = self.num_blocks
        self._cached.clear()
        self._lru.clear()
