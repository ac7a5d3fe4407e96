"""A Gym-like replay client: what NeMo-Gym's vLLM model client does to a fleet, one trace at a time.

Why imitate Gym rather than write a "good" client: the router exists to serve *that* client. So the
replay keeps Gym's traits that matter for routing and for failure handling:

* all sessions start at once (a rollout step launches every rollout together), turns are serial within a
  session, and the whole conversation is resent every turn (no session state on the server side); a
  recorded step (``launcher.bench.recorded``) keeps its own pacing instead: each session starts at its
  ``start_s`` and each turn waits its ``gap_s`` after the previous answer (the tool's time);
* non-streaming ``POST {base}/chat/completions`` carrying Gym's extra fields (``logprobs``,
  ``top_logprobs: 0``, ``return_tokens_as_token_ids``);
* with several base URLs each session is pinned by ``int(sha256(session_id).hexdigest()[:8], 16) % n``,
  with one URL (a router) everything goes there; no ``X-Session-ID`` header unless asked for, because
  nemo-gym 0.7.0 sends none and affinity must not depend on one;
* Gym 0.7.0's retries: statuses 429, 500, 502, 503, 504, 520, 404, 408, three attempts, 0.5 s apart.
  Unlike Gym, connection errors and timeouts are bounded too (Gym retries a refused connection forever,
  which would hang a benchmark): a session that runs out of attempts is counted as lost and stops.

One ``aiohttp.ClientSession`` with an unlimited connector serves every session, as Gym does, so the client
itself never queues requests and the in-flight count measured here is what the fleet sees.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from launcher.bench.trace import Session, Trace

GYM_RETRY_STATUSES: frozenset[int] = frozenset({429, 500, 502, 503, 504, 520, 404, 408})


def gym_pin(session_id: str, n: int) -> int:
    """Index of the base URL current Gym pins ``session_id`` to, among ``n`` URLs."""
    return int(hashlib.sha256(session_id.encode()).hexdigest()[:8], 16) % n


def gym_chat_payload(
    model: str, messages: list[dict[str, str]], max_tokens: int, temperature: float = 1.0
) -> dict[str, Any]:
    """One turn's body as Gym's vLLM model client sends it (field order included: routers hash the raw
    bytes). The HTTP client and the virtual-time replay both build it here, so they route the same bytes."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "logprobs": True,
        "top_logprobs": 0,
        "return_tokens_as_token_ids": True,
    }


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Gym 0.7.0's retry rule, bounded for connection errors as well."""

    statuses: frozenset[int] = GYM_RETRY_STATUSES
    attempts: int = 3
    delay_s: float = 0.5


@dataclass(slots=True)
class ClientConfig:
    """Knobs of the replay client. Defaults imitate Gym; ``request_timeout_s`` and ``max_wall_s`` do not
    (Gym has no timeouts) but keep a stuck fleet from hanging the benchmark forever."""

    model: str = ""  # empty: the first id GET {base}/models lists, as Gym's config would name it
    session_header: bool = False
    max_concurrent: int = 0  # 0: every session at once, like a Gym rollout step
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    request_timeout_s: float | None = 600.0
    max_wall_s: float = 3600.0
    temperature: float = 1.0
    api_key: str | None = None
    engine_key: str | None = None
    """What the engines' own routes take for the counter scrapes (inside a job: its engine key, which no
    client key opens); None: ``api_key`` (a fleet the bench started itself, or engines given by hand)."""


@dataclass(slots=True)
class RequestRecord:
    session: str
    turn: int
    target: str
    start_s: float
    latency_s: float
    status: int  # last HTTP status, 0 for a connection error / timeout
    attempts: int
    ok: bool
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(slots=True)
class SessionRecord:
    id: str
    target: str
    turns_total: int
    turns_done: int = 0
    start_s: float | None = None
    end_s: float | None = None
    ok: bool = False
    error: str | None = None


@dataclass(slots=True)
class ReplayResult:
    """Everything one arm's run measured at the client; times are seconds since the run started."""

    wall_s: float
    sessions: list[SessionRecord]
    requests: list[RequestRecord]
    peak_in_flight: int
    started_at: float  # epoch seconds, for the record

    @property
    def errors(self) -> int:
        return sum(1 for s in self.sessions if not s.ok)

    @property
    def retries(self) -> int:
        return sum(r.attempts - 1 for r in self.requests)

    def target_counts(self) -> dict[str, int]:
        """Successful requests per base URL (the per-engine load in the direct arm)."""
        return dict(Counter(r.target for r in self.requests if r.ok))

    def completion_times(self) -> list[float]:
        """Sorted end times of the sessions that finished every turn."""
        return sorted(s.end_s for s in self.sessions if s.ok and s.end_s is not None)


class ReplayClient:
    """Replays a :class:`Trace` against ``base_urls`` (each ending in ``/v1``) the way Gym would."""

    def __init__(
        self,
        base_urls: Sequence[str],
        config: ClientConfig | None = None,
        on_session_end: Callable[[SessionRecord], None] | None = None,
    ) -> None:
        if not base_urls:
            raise ValueError("need at least one base URL")
        self.base_urls = [u.rstrip("/") for u in base_urls]
        self.config = config or ClientConfig()
        self._on_session_end = on_session_end
        self._in_flight = 0
        self._peak = 0
        self._t0 = 0.0
        self._requests: list[RequestRecord] = []

    def target_for(self, session_id: str) -> str:
        return self.base_urls[gym_pin(session_id, len(self.base_urls))]

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    async def run(self, trace: Trace) -> ReplayResult:
        """Run every session of ``trace``; returns when all ended or ``max_wall_s`` passed."""
        cfg = self.config
        self._requests = []
        self._in_flight = self._peak = 0
        records = [SessionRecord(s.id, self.target_for(s.id), len(s.turns)) for s in trace.sessions]
        sem = asyncio.Semaphore(cfg.max_concurrent) if cfg.max_concurrent > 0 else None
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        if not cfg.model:
            cfg.model = await discover_model(self.base_urls[0], api_key=cfg.api_key) or "default"
        started_at = time.time()
        self._t0 = time.perf_counter()
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            tasks = [
                asyncio.create_task(self._session(http, trace, s, rec, sem))
                for s, rec in zip(trace.sessions, records, strict=True)
            ]
            _, pending = await asyncio.wait(tasks, timeout=cfg.max_wall_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        wall = self._now()
        for rec in records:
            if not rec.ok and rec.error is None:  # cancelled at the deadline (or never started)
                rec.error = f"not finished within max_wall_s={cfg.max_wall_s}"
            if rec.end_s is None:
                rec.end_s = wall
        return ReplayResult(wall, records, self._requests, self._peak, started_at)

    async def _session(
        self,
        http: aiohttp.ClientSession,
        trace: Trace,
        s: Session,
        rec: SessionRecord,
        sem: asyncio.Semaphore | None,
    ) -> None:
        if s.start_s > 0:  # a recorded arrival: wait outside the semaphore, holding no slot
            await asyncio.sleep(max(0.0, s.start_s - self._now()))
        if sem is None:
            await self._session_body(http, trace, s, rec)
        else:
            async with sem:
                await self._session_body(http, trace, s, rec)

    async def _session_body(
        self, http: aiohttp.ClientSession, trace: Trace, s: Session, rec: SessionRecord
    ) -> None:
        cfg = self.config
        rec.start_s = self._now()
        url = rec.target + "/chat/completions"
        headers = {"Content-Type": "application/json"}
        if cfg.session_header:
            headers["X-Session-ID"] = s.id
        if cfg.api_key:
            headers["Authorization"] = f"Bearer {cfg.api_key}"
        messages: list[dict[str, str]] = [
            {"role": "system", "content": trace.system_prompt(s)},
            {"role": "user", "content": s.task},
        ]
        try:
            for k, turn in enumerate(s.turns):
                if k > 0 and turn.gap_s > 0:
                    await asyncio.sleep(turn.gap_s)
                if k > 0:
                    # Tool results go back as a user message: a "tool" role would need a matching
                    # tool_call id in the previous assistant message, which plain-text replies lack.
                    messages.append({"role": "user", "content": turn.tool_output})
                payload = gym_chat_payload(cfg.model, messages, turn.max_tokens, cfg.temperature)
                t_req = self._now()
                data, status, attempts, err = await self.post(http, url, orjson.dumps(payload), headers)
                usage = (data or {}).get("usage") or {}
                self._requests.append(
                    RequestRecord(
                        session=s.id,
                        turn=k,
                        target=rec.target,
                        start_s=t_req,
                        latency_s=self._now() - t_req,
                        status=status,
                        attempts=attempts,
                        ok=data is not None,
                        prompt_tokens=int(usage.get("prompt_tokens") or 0),
                        completion_tokens=int(usage.get("completion_tokens") or 0),
                    )
                )
                if data is None:
                    rec.error = f"turn {k}: {err}"
                    return
                messages.append({"role": "assistant", "content": _reply_text(data)})
                rec.turns_done = k + 1
            rec.ok = True
        finally:
            rec.end_s = self._now()
            if self._on_session_end is not None:
                self._on_session_end(rec)

    async def post(
        self, http: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]
    ) -> tuple[dict[str, Any] | None, int, int, str | None]:
        """POST with Gym's bounded retries. Returns (json or None, last status, attempts, last error).

        A non-retryable status fails at once (Gym raises on it); a retryable one, a connection error, a
        timeout or an unreadable 200 body is tried again after ``delay_s``, at most ``attempts`` times.
        """
        retry = self.config.retry
        status, err = 0, None
        attempt = 0
        for attempt in range(1, max(1, retry.attempts) + 1):
            self._in_flight += 1
            self._peak = max(self._peak, self._in_flight)
            try:
                async with http.post(url, data=body, headers=headers, allow_redirects=False) as resp:
                    status = resp.status
                    raw = await resp.read()
                if status == 200:
                    data = orjson.loads(raw)
                    if isinstance(data, dict) and data.get("choices"):
                        return data, status, attempt, None
                    err = f"HTTP 200 without choices: {raw[:200]!r}"
                else:
                    err = f"HTTP {status}: {raw[:200]!r}"
                    if status not in retry.statuses:
                        return None, status, attempt, err
            except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as e:
                status, err = 0, f"{type(e).__name__}: {e}"
            finally:
                self._in_flight -= 1
            if attempt < retry.attempts:
                await asyncio.sleep(retry.delay_s)
        return None, status, attempt, err


def _reply_text(data: dict[str, Any]) -> str:
    """The assistant text to resend next turn: exactly what came back, so prefix caches can match it."""
    try:
        msg = data["choices"][0].get("message") or {}
        return str(msg.get("content") or "")
    except (KeyError, IndexError, AttributeError, TypeError):
        return ""


async def discover_model(base_url: str, timeout_s: float = 5.0, api_key: str | None = None) -> str | None:
    """The first model id ``GET {base}/models`` lists (what Gym's config would name), or None."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http,
            http.get(base_url.rstrip("/") + "/models", headers=headers, allow_redirects=False) as resp,
        ):
            if resp.status != 200:
                return None
            data = await resp.json(content_type=None)
        models = data.get("data") or []
        return str(models[0]["id"]) if models else None
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
        return None
