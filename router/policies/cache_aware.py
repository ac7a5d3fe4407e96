"""cache_aware: send a request where its prompt prefix already is, within a per-request load bound.

Multi-turn agent sessions resend their whole context every turn; an engine that served turn k holds turn
k's prompt in its prefix cache, so turn k+1 there costs only the new tokens. Gym sends no session header,
so affinity comes from the prompt itself: the deepest prefix match in a ``PrefixIndex`` of recent
dispatches.

The load bound is what the peers lack. Their rule ("go least-loaded only if the fleet-wide spread
exceeds 64 and max > 1.5 x min") lets a prefix shared by every session (system prompt + tool schemas)
pull nearly all traffic onto one engine. Here three rules replace it:

* a request that merely *shares* a prefix (a new session after the common system prompt) is placed by
  load, not by match (see below), so a shared prompt cannot attract the fleet;
* every affinity decision checks its own target: a backend may take one more request by affinity only
  while its in-flight count is under ``ceil(load_factor * (total + 1) / n) + load_slack`` (consistent
  hashing with bounded loads, Mirrokni et al.); above that the request goes to the least loaded
  backend, ties broken at random;
* and, because a request count cannot tell a 2k-token session from a 30k-token one, the same check on
  the bytes of request bodies in flight (``LoadTracker`` counts them): a holder may take the request only
  while the bytes it already has in flight are within ``byte_load_factor * mean`` (this request counted).
  A multi-turn request resends its whole context, so body bytes in flight track the KV each engine holds
  and the context every one of its decode steps reads. The byte bound has no additive slack: on a nearly
  idle fleet it turns a GRPO group's second identical first turn away from the engine holding the first
  (one request is far above a mean over empty engines), which costs that group one prefill of its task
  at the very start of a step. Both ways of exempting small loads that were tried (a slack of one
  request's size; no byte check below ``load_slack`` requests) let the request CV exceed 0.10 in most
  HTTP replays, because they also spare engines holding two or three very long contexts late in a step.

Why the byte bound (measured with the virtual-time replay, ``launcher/bench/virtual.py``, longtail
scale 0.5, 8 engines, trace seeds 1-4): with the count bound alone, sessions that turn out long stay
where their first turn landed, so one engine ends up with 7 of the 30 long sessions and another with
one: request CV 0.089 on average and 0.148 at worst, and the long tail runs on a few crowded engines.
With the byte bound at 1.5 x the mean, ~8 turns per step move (of ~5,500), CV is 0.054 (0.075 at worst)
and the step's wall clock drops ~2 points further; the price is ~0.2 pt of prefix-cache hits (each move
recomputes one context). Time to 90% is unchanged: until the short sessions end, all sessions look alike.

The bound is relative to the *mean*, not to the least loaded backend. Measured on the replay bench
(longtail, 300 sessions, 8 engines), a bound of "least loaded + slack" moved 11% of continuing turns,
because one engine's count dips whenever its sessions are between turns; every move costs a cold
prefill of the whole context that stalls the new engine's batch, and lost ~2 points of prefix-cache hits
for no gain in balance. The mean-based bound moved under 2%.

Which requests get affinity: those that *continue* a conversation (the deepest known block of the
prompt was the end of an earlier prompt) or repeat one exactly (a GRPO group's identical first turns,
which then share one engine's cache until its bound is hit); see ``PrefixIndex.continuation_holders``.
A request that merely shares a prefix with others (a new session after the common system prompt and
tool list) is placed by load: following the first engine that saw the system prompt is exactly the
peers' pile-up. Among holders: fewest in flight, then the most recent holder. Cost: one chained hash per
block of prompt and a dict lookup per block: O(prompt length), independent of the number of backends.

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
        load_slack: int = 3,
        max_prompt_bytes: int = 8 * 1024 * 1024,
        byte_load_factor: float = 1.5,
    ) -> None:
        if block_bytes < 16:
            raise ValueError("cache_aware block_bytes must be at least 16")
        if load_factor < 1.0:
            raise ValueError("cache_aware load_factor must be >= 1.0 (a multiple of the mean in flight)")
        if load_slack < 1:
            raise ValueError("cache_aware load_slack must be >= 1 (requests above the bound)")
        self.block_bytes = block_bytes
        self.load_factor = load_factor
        self.load_slack = load_slack
        self.max_blocks = max_prompt_bytes // block_bytes
        if byte_load_factor and byte_load_factor < 1.0:
            raise ValueError(
                "cache_aware byte_load_factor must be >= 1.0 (a multiple of the mean), or 0 for off"
            )
        self.byte_load_factor = byte_load_factor
        self.index = PrefixIndex(max_bytes=max_index_bytes, holders_per_block=holders_per_block)
        self.decisions = {"affinity": 0, "balanced": 0, "cold": 0}

    # -- features ----------------------------------------------------------------------------------
    def prepare(self, request: RouteRequest) -> RouteRequest:
        if request.features is not None:
            return request
        body = request.body
        hashes = block_hashes(body, self.block_bytes, prompt_start(body), self.max_blocks)
        return RouteRequest(request.path, body, request.headers, hashes, request.body_size)

    # -- decision ----------------------------------------------------------------------------------
    def load_cap(self, load: LoadTracker) -> int:
        """A backend with fewer than this many requests in flight may take one more by affinity."""
        n = max(len(load), 1)
        return math.ceil(self.load_factor * (load.total_in_flight + 1) / n) + self.load_slack

    def byte_cap(self, load: LoadTracker, weight: int) -> float | None:
        """A backend whose in-flight body bytes are within this may take a request of ``weight`` bytes
        by affinity (the mean counts that request); None when the byte bound is off."""
        if not self.byte_load_factor:
            return None
        n = max(len(load), 1)
        return self.byte_load_factor * (load.total_bytes_in_flight + weight) / n

    def choose(self, request: RouteRequest, load: LoadTracker, exclude: frozenset[str] = frozenset()) -> str:
        if len(load) == 0:
            raise NoBackendAvailable("no serving backend")
        hashes = self._hashes(request)
        chosen: str | None = None
        if hashes:
            holders, _depth = self.index.continuation_holders(hashes)
            if holders:
                chosen = self._least_loaded_under_cap(holders, load, exclude, request.size)
                self.decisions["affinity" if chosen else "balanced"] += 1
            else:
                self.decisions["cold"] += 1
        else:
            self.decisions["cold"] += 1
        if chosen is None:
            chosen = load.least_loaded(exclude)
        return chosen

    def _hashes(self, request: RouteRequest) -> list[int]:
        hashes = request.features if request.features is not None else self.prepare(request).features
        assert isinstance(hashes, list)
        return hashes

    def commit(self, request: RouteRequest, url: str) -> None:
        """Record that ``url`` now holds this prompt (see ``Policy``: learned at dispatch)."""
        hashes = self._hashes(request)
        if hashes:
            self.index.record(hashes, url)

    def retract(self, request: RouteRequest, url: str) -> None:
        """The attempt on ``url`` failed: it does not hold this prompt; drop it from the blocks' holders."""
        hashes = self._hashes(request)
        if hashes:
            self.index.discard(hashes, url)

    def _least_loaded_under_cap(
        self, holders: tuple[str, ...], load: LoadTracker, exclude: frozenset[str], weight: int = 0
    ) -> str | None:
        """The holder with the fewest in flight below the cap; among equals the most recent holder
        (holders are most recent first), which is where the conversation's latest turn went."""
        cap = self.load_cap(load)
        byte_cap = self.byte_cap(load, weight)
        best: str | None = None
        best_busy = cap
        for url in holders:
            if url in exclude or url not in load:
                continue
            busy = load.in_flight(url)
            if byte_cap is not None and load.bytes_in_flight(url) > byte_cap:
                continue
            if busy < best_busy:
                best, best_busy = url, busy
        return best

    def reset_cache_state(self) -> int:
        return self.index.clear()

    def stats(self) -> dict[str, float]:
        return {
            "index_entries": float(len(self.index)),
            "index_bytes": float(self.index.approx_bytes),
            "index_evictions": float(self.index.evictions),
            **{f"decisions_{k}": float(v) for k, v in self.decisions.items()},
        }
