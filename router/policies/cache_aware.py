"""cache_aware: send a request where its prompt prefix already is, within a per-request load bound.

Multi-turn agent sessions resend their whole context every turn; an engine that served turn k holds turn
k's prompt in its prefix cache, so turn k+1 there costs only the new tokens. Gym sends no session header,
so affinity comes from the prompt itself: the deepest prefix match in a ``PrefixIndex`` of recent
dispatches.

The load bound is what the peers lack. Their rule ("go least-loaded only if the fleet-wide spread
exceeds 64 and max > 1.5 x min") lets a prefix shared by every session (system prompt + tool schemas)
pull nearly all traffic onto one engine. Here every request checks its own target: a backend is eligible
for affinity only while its in-flight count stays under ``ceil(load_factor * (total + 1) / n) +
load_slack`` (consistent hashing with bounded loads, Mirrokni et al.). Above that the request goes to the
least loaded backend, ties broken at random, and that backend is recorded as a holder of the prefix too,
so a popular prefix spreads to as many engines as its load needs.

Choice among matching backends: deepest match first (most cached tokens), then fewer in flight, then
random. GRPO groups (several identical first turns) therefore share one engine's cache until its bound
is hit. Cost: one chained hash per ``block_bytes`` of prompt, a dict lookup per block, and a handful of
set operations on the (at most ``holders_per_block``) holders: O(prompt length), independent of the
number of backends.

Backends that leave the serving set are not purged from the index (a walk of up to millions of entries
on every health tick); they are filtered out at match time and age out of each block's short holder list
as new dispatches are recorded.
"""

from __future__ import annotations

import math

from router.policies.base import LoadTracker, NoBackendAvailable, Policy, RouteRequest
from router.policies.prefix_index import PrefixIndex, block_hashes, prompt_start


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(
        self,
        block_bytes: int = 1024,
        max_index_bytes: int = 64 * 1024 * 1024,
        holders_per_block: int = 4,
        load_factor: float = 1.25,
        load_slack: int = 2,
        max_prompt_bytes: int = 8 * 1024 * 1024,
    ) -> None:
        if block_bytes < 16:
            raise ValueError("cache_aware block_bytes must be at least 16")
        if load_factor < 1.0:
            raise ValueError("cache_aware load_factor must be >= 1.0 (1.0 = perfectly even)")
        if load_slack < 0:
            raise ValueError("cache_aware load_slack must be >= 0")
        self.block_bytes = block_bytes
        self.load_factor = load_factor
        self.load_slack = load_slack
        self.max_blocks = max_prompt_bytes // block_bytes
        self.index = PrefixIndex(max_bytes=max_index_bytes, holders_per_block=holders_per_block)
        self.decisions = {"affinity": 0, "balanced": 0, "cold": 0}

    # -- features ----------------------------------------------------------------------------------
    def prepare(self, request: RouteRequest) -> RouteRequest:
        if request.features is not None:
            return request
        body = request.body
        hashes = block_hashes(body, self.block_bytes, prompt_start(body), self.max_blocks)
        return RouteRequest(request.path, body, request.headers, hashes)

    # -- decision ----------------------------------------------------------------------------------
    def load_cap(self, load: LoadTracker) -> int:
        """The most requests a backend may have in flight and still take one more by affinity."""
        n = max(len(load), 1)
        return math.ceil(self.load_factor * (load.total_in_flight + 1) / n) + self.load_slack

    def choose(self, request: RouteRequest, load: LoadTracker, exclude: frozenset[str] = frozenset()) -> str:
        if len(load) == 0:
            raise NoBackendAvailable("no serving backend")
        hashes = request.features if request.features is not None else self.prepare(request).features
        assert isinstance(hashes, list)
        chosen: str | None = None
        if hashes:
            eligible = load.__contains__ if not exclude else (lambda u: u in load and u not in exclude)
            depths = self.index.match_depths(hashes, eligible)
            if depths:
                chosen = self._deepest_under_cap(depths, load)
                self.decisions["affinity" if chosen else "balanced"] += 1
            else:
                self.decisions["cold"] += 1
        else:
            self.decisions["cold"] += 1
        if chosen is None:
            chosen = load.least_loaded(exclude)
        if hashes:
            self.index.record(hashes, chosen)
        return chosen

    def _deepest_under_cap(self, depths: dict[str, int], load: LoadTracker) -> str | None:
        """Deepest match, then fewest in flight, then a uniformly random one among equals."""
        cap = self.load_cap(load)
        best: str | None = None
        best_depth = best_busy = -1
        ties = 0
        for url, depth in depths.items():
            busy = load.in_flight(url)
            if busy >= cap:
                continue
            if depth > best_depth or (depth == best_depth and busy < best_busy):
                best, best_depth, best_busy, ties = url, depth, busy, 1
            elif depth == best_depth and busy == best_busy:
                ties += 1  # reservoir sampling keeps each equal candidate with probability 1/ties
                if load.rng.random() * ties < 1:
                    best = url
        return best

    # -- housekeeping ------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return {
            "index_entries": float(len(self.index)),
            "index_bytes": float(self.index.approx_bytes),
            "index_evictions": float(self.index.evictions),
            **{f"decisions_{k}": float(v) for k, v in self.decisions.items()},
        }
