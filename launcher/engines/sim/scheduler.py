"""One engine's continuous-batching scheduler: FIFO admission bounded by KV, chunked prefill, decode.

Each step, like vLLM v1's: running requests first (one decode token each, or the next prefill chunk),
then waiting requests in arrival order while the token budget, ``max_num_seqs`` and free KV allow. A
request is admitted only when blocks for its whole current sequence fit (after prefix-cache hits), so a
full cache makes the queue grow (``num_requests_waiting``) instead of stealing KV from running work.
A running request that needs one more block for decode while none is free preempts the newest running
request (recompute, as vLLM does); without that, decode growth could deadlock a full cache.

The step's duration is modelled from its contents and slept (never spun), so an idle engine costs
nothing and 64 busy engines share one core: see ``SimConfig`` for the cost model.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections import deque
from collections.abc import AsyncIterator, Callable

from .config import SimConfig
from .kv import Block, BlockPool
from .stats import EngineStats
from .tokens import chain_hashes

ABORT_REASON = "abort"
"""vLLM's finish reason for a request aborted through the RL routes: the client gets a 200 answer with
the tokens generated so far, not an error (unlike a crash, which the simulator answers with 500)."""


class ReqState(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    ABORTED = 3


class SimRequest:
    """One generation request as the scheduler sees it.

    ``tokens`` holds the prompt followed by the whole output the request will produce (decided up front,
    deterministically), so the sequence so far is ``tokens[:seq_len]`` and block hashes of generated
    tokens are computed exactly like prompt ones.
    """

    __slots__ = (
        "admitted",
        "arrival",
        "blocks",
        "cached_tokens",
        "done",
        "finish_reason",
        "finished_at",
        "first_token_at",
        "hashes",
        "n_gen",
        "num_computed",
        "progress",
        "prompt_len",
        "registered",
        "rid",
        "seq_len",
        "state",
        "target",
        "tokens",
    )

    def __init__(
        self,
        rid: str,
        tokens: list[int],
        prompt_len: int,
        target: int,
        finish_reason: str,
        *,
        stream: bool = False,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.rid = rid
        self.tokens = tokens
        self.prompt_len = prompt_len
        self.target = target
        self.finish_reason = finish_reason
        self.num_computed = 0
        self.n_gen = 0
        # prompt_len + n_gen, kept as a field: it is read several times per request per step.
        self.seq_len = prompt_len
        self.blocks: list[Block] = []
        self.hashes: list[int] = []
        self.registered = 0
        self.state = ReqState.WAITING
        self.admitted = False
        self.cached_tokens = 0
        self.arrival = loop.time()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        # Streaming handlers wait on this; non-streaming ones only on ``done`` (one wake-up per request).
        self.progress: asyncio.Event | None = asyncio.Event() if stream else None
        self.done: asyncio.Future[None] = loop.create_future()

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len : self.prompt_len + self.n_gen]


class Scheduler:
    """The step loop of one engine. Create inside a running event loop; ``start()`` then ``submit()``."""

    def __init__(self, config: SimConfig, stats: EngineStats | None = None) -> None:
        self.config = config
        self.stats = stats if stats is not None else EngineStats()
        self.pool = BlockPool(config.num_gpu_blocks, config.enable_prefix_caching)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.slow_factor = 1.0
        self._wake = asyncio.Event()
        self._resume = asyncio.Event()
        self._resume.set()
        self._clock = 0.0
        self._task: asyncio.Task[None] | None = None
        # vLLM's pause for a weight update (``/pause``), apart from the wedge fault above: while
        # ``gen_paused`` new requests are held (not scheduled); in ``keep`` mode the step loop is frozen too.
        self.gen_paused = False
        self._frozen = asyncio.Event()
        self._frozen.set()
        self._held: deque[SimRequest] = deque()
        self.in_flight: dict[str, SimRequest] = {}
        # The engine core's own work between steps (a weight reload): no step runs until it is done.
        self._core_free = asyncio.Event()
        self._core_free.set()
        self.step_gate: Callable[[], bool] | None = None
        """Asked before each step; ``False`` stops the loop for good (the engine core died, see ``core``)."""

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-scheduler")

    async def close(self) -> None:
        """Stop the loop and abort every request (their handlers return at once)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.reset()

    def pause(self) -> None:
        """Freeze at the next step boundary (a wedged GPU): in-flight requests stop making progress."""
        self._resume.clear()

    def resume(self) -> None:
        self._resume.set()

    @contextlib.asynccontextmanager
    async def core_busy(self) -> AsyncIterator[None]:
        """Hold every step while the engine core runs a utility call (vLLM runs them between steps)."""
        self._core_free.clear()
        try:
            yield
        finally:
            self._core_free.set()

    def reset(self) -> None:
        """Abort everything and empty the KV cache: what a crashed-and-restarted engine looks like."""
        for r in [*self.running, *self.waiting, *self._held]:
            self._finish(r, ReqState.ABORTED)
        self.running = []
        self.waiting.clear()
        self._held.clear()
        self.pool.reset()

    # -- vLLM's RL pause (POST /pause, /resume) ----------------------------------------------------
    async def pause_generation(self, mode: str) -> None:
        """``abort``: abort every request in flight; ``wait``: let them finish first; ``keep``: freeze
        them where they are until ``resume_generation``. Requests arriving meanwhile wait."""
        self.gen_paused = True
        if mode == "abort":
            for r in [*self.running, *self.waiting]:
                r.finish_reason = ABORT_REASON
                self._finish(r, ReqState.ABORTED)
            self.running = []
            self.waiting.clear()
        elif mode == "wait":
            pending = [r.done for r in [*self.running, *self.waiting] if not r.done.done()]
            if pending:
                await asyncio.wait(pending)
        elif mode == "keep":
            self._frozen.clear()
        else:
            raise ValueError(f"unknown pause mode {mode!r}")

    def resume_generation(self) -> None:
        self.gen_paused = False
        self._frozen.set()
        while self._held:
            self.waiting.append(self._held.popleft())
        self._wake.set()

    def abort_ids(self, ids: list[str] | None) -> int:
        """Abort the named requests (all in flight when ``ids`` is empty); returns how many."""
        live = self.in_flight
        targets = list(live.values()) if not ids else [live[i] for i in ids if i in live]
        for r in targets:
            if r.state in (ReqState.WAITING, ReqState.RUNNING):
                r.finish_reason = ABORT_REASON
            self.abort(r)
        return len(targets)

    # -- requests --------------------------------------------------------------------------------
    def fits_alone(self, total_tokens: int) -> bool:
        """Whether a request of this many tokens (prompt + output) fits an empty cache.

        Checked at submission: an admitted-first request that can never fit would hold the FIFO head
        (and so every request behind it) forever.
        """
        bs = self.config.block_size
        return -(-total_tokens // bs) <= self.pool.num_blocks

    def submit(self, req: SimRequest) -> None:
        self.in_flight[req.rid] = req
        if self.gen_paused:
            self._held.append(req)
            return
        self.waiting.append(req)
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        """Drop a request (client went away); frees its KV at once. No-op once finished."""
        if req.state == ReqState.WAITING:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
            with contextlib.suppress(ValueError):
                self._held.remove(req)
        elif req.state == ReqState.RUNNING:
            with contextlib.suppress(ValueError):
                self.running.remove(req)
        else:
            return
        self._finish(req, ReqState.ABORTED)

    def _finish(self, req: SimRequest, state: ReqState) -> None:
        if req.state in (ReqState.FINISHED, ReqState.ABORTED):
            return
        if req.blocks:
            self.pool.free(req.blocks)
            req.blocks = []
        req.state = state
        self.in_flight.pop(req.rid, None)
        req.finished_at = asyncio.get_running_loop().time()
        if state == ReqState.ABORTED:
            self.stats.aborted += 1
        else:
            s = self.stats
            s.success[req.finish_reason] = s.success.get(req.finish_reason, 0) + 1
            s.e2e.observe(req.finished_at - req.arrival)
        if req.progress is not None:
            req.progress.set()
        if not req.done.done():
            req.done.set_result(None)

    # -- the step loop ---------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.config
        while True:
            if not self._resume.is_set():
                await self._resume.wait()
            if not self._frozen.is_set():
                await self._frozen.wait()
                continue
            if not self._core_free.is_set():
                await self._core_free.wait()
                continue
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            if self.step_gate is not None and not self.step_gate():
                return  # this step crashes the engine core: nothing runs any more
            plan, cost = self._schedule()
            if not plan:  # nothing schedulable: wait for an arrival or abort to change that
                self._wake.clear()
                await self._wake.wait()
                continue
            dt = cost * self.slow_factor / cfg.speed
            now = loop.time()
            if self._clock < now - cfg.max_lag_s:
                self._clock = now
            self._clock += dt
            await asyncio.sleep(max(self._clock - now, 0.0))
            if not self._resume.is_set():  # wedged mid-step: the step's results never arrive
                await self._resume.wait()
            if not self._frozen.is_set():  # paused in keep mode mid-step: results land on resume
                await self._frozen.wait()
            self.stats.steps += 1
            self.stats.busy_s += dt
            self._commit(plan, loop.time())

    def _schedule(self) -> tuple[list[tuple[SimRequest, int]], float]:
        """Decide this step's work; returns ``[(request, tokens to compute)]`` and its modelled cost."""
        cfg = self.config
        bs = cfg.block_size
        pool = self.pool
        budget = cfg.max_num_batched_tokens
        plan: list[tuple[SimRequest, int]] = []
        prefill_tokens = decode_seqs = context = 0
        running = self.running
        preempted = False

        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            remaining = r.seq_len - r.num_computed
            k = remaining if remaining < budget else budget
            need = -(-(r.num_computed + k) // bs) - len(r.blocks)
            if need > 0:
                while pool.num_free < need:
                    victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is r:
                        break
                if r.state != ReqState.RUNNING:
                    break
                r.blocks += pool.allocate(need)
            plan.append((r, k))
            budget -= k
            context += r.num_computed + k
            if remaining > 1:
                prefill_tokens += k
            else:
                decode_seqs += 1
            i += 1

        waiting = self.waiting
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs and not preempted:
            r = waiting[0]
            seq_len = r.seq_len
            n_full = seq_len // bs
            if len(r.hashes) < n_full:
                chain_hashes(r.tokens, bs, r.hashes, n_full)
            # At least one token is always computed (to sample from), so a fully cached prompt still
            # recomputes its last block: vLLM caps hits at (len - 1) tokens the same way.
            hit = pool.match_prefix(r.hashes, (seq_len - 1) // bs)
            new = -(-seq_len // bs) - hit
            hit_hashes = r.hashes[:hit]
            if not pool.can_allocate(hit_hashes, new):
                break  # FIFO: nobody overtakes the head, as in vLLM's FCFS policy
            waiting.popleft()
            r.blocks = pool.take_cached(hit_hashes) + pool.allocate(new)
            r.num_computed = hit * bs
            r.registered = hit
            if not r.admitted:
                r.admitted = True
                r.cached_tokens = hit * bs
                self.stats.prefix_cache_queries += seq_len
                self.stats.prefix_cache_hits += hit * bs
            r.state = ReqState.RUNNING
            running.append(r)
            remaining = seq_len - r.num_computed
            k = remaining if remaining < budget else budget
            plan.append((r, k))
            budget -= k
            context += r.num_computed + k
            if remaining > 1:
                prefill_tokens += k
            else:
                decode_seqs += 1

        cost = (
            cfg.step_base_s
            + prefill_tokens * cfg.prefill_token_s
            + decode_seqs * cfg.decode_seq_s
            + context * cfg.context_token_s
        )
        return plan, cost

    def _preempt(self, r: SimRequest) -> None:
        """Recompute-preemption: free the KV (its full blocks stay cached), requeue at the front."""
        self.pool.free(r.blocks)
        r.blocks = []
        r.num_computed = 0
        r.registered = 0
        r.state = ReqState.WAITING
        self.waiting.appendleft(r)
        self.stats.preemptions += 1

    def _commit(self, plan: list[tuple[SimRequest, int]], now: float) -> None:
        """Apply a finished step: computed tokens, cache registration, sampled tokens, completions."""
        bs = self.config.block_size
        interval = self.config.stream_interval
        pool = self.pool
        stats = self.stats
        generated = 0
        finished: list[SimRequest] = []
        for r, k in plan:
            if r.state != ReqState.RUNNING:  # aborted or preempted during the step
                continue
            r.num_computed += k
            full = r.num_computed // bs
            if full > r.registered:
                if len(r.hashes) < full:
                    chain_hashes(r.tokens, bs, r.hashes, full)
                for j in range(r.registered, full):
                    pool.register(r.blocks[j], r.hashes[j])
                r.registered = full
            if r.num_computed == r.seq_len:
                r.n_gen += 1
                r.seq_len += 1
                generated += 1
                if r.first_token_at is None:
                    r.first_token_at = now
                    stats.prompt_tokens += r.prompt_len
                    stats.ttft.observe(now - r.arrival)
                if r.n_gen >= r.target:
                    finished.append(r)
                elif r.progress is not None and r.n_gen % interval == 0:
                    r.progress.set()
        stats.generation_tokens += generated
        if finished:
            self.running = [r for r in self.running if r.n_gen < r.target]
            for r in finished:
                self._finish(r, ReqState.FINISHED)
