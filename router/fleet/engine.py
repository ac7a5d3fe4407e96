"""The engine's HTTP contract, in one place: its routes, the key it takes, how its answers read.

Every part of the launcher and the router that talks to an engine directly (the fleet controller's health
probes and pause check, the router's ``/fleet/*`` fan-outs, the cache reset, the per-step counters,
``rl-launch status``'s engine rows) goes through ``EngineClient``. Before, each caller spelled the paths,
the ``Authorization`` header and the answer's parsing on its own, and they drifted: one reader forgot the
engine key and a restarted engine's version was never known, another followed redirects and would have
sent the key elsewhere. Here:

* **Auth**: the job's engines take the engine key on every route but ``/health`` (a load balancer's
  probe carries none); ``health`` sends none, every other call sends it.
* **No redirect is followed**: a redirect is an answer (a failure here), so the key never leaves for
  another host.
* **One judgement of an answer** (``EngineAnswer``): a transport error or timeout, a non-2xx status, an
  ``"error"`` key in the body, or a body that does not say what the call asked for fails that engine,
  with a one-line reason.
* **Typed results**: ``Health`` for a probe, ``Reading`` for a value read (version, paused, counters),
  ``EngineAnswer`` for an operation (it goes into ``router.fleet.ops.FleetOpReport`` as is).
* **Bounded answers** (``router.fleet.engine_reads``): an answer is read up to the cap of its route
  (8 MiB for ``/metrics``, 1 MiB for the rest), past it that engine's call fails, and a large one is
  parsed off the event loop: an engine the trainer registered may be any URL.

The routes are vLLM 0.32's (``VLLM_SERVER_DEV_MODE=1``; ``vllm/entrypoints/rl/online/api_router.py`` and
the dev routes), which the simulator (``launcher.engines.sim``) serves with the same semantics, plus a
``dynamo.vllm`` worker's cache flush.

The client is async and takes an ``aiohttp.ClientSession`` (``EngineClient.open`` owns one): the router
and the driver's fleet endpoint call it on their loops, the fleet controller's thread runs one
``asyncio.run`` per tick, and ``rl-launch status`` can hand it its own session. Each call is bounded by
the client's ``timeout_s`` on its own, whatever the session's default.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import aiohttp

from router.fleet.engine_counters import Counters, parse_counters
from router.fleet.engine_reads import (
    MAX_ANSWER_BYTES,
    MAX_METRICS_BYTES,
    MAX_TABLE_BYTES,
    AnswerTooLarge,
    decoded,
    off_loop,
    read_capped,
)
from router.fleet.weight_checksums import CHECKSUM_METHOD, from_checker, merge_workers, no_such_method

HEALTH_PATH = "/health"
WEIGHT_INFO_PATH = "/weight_info"
IS_PAUSED_PATH = "/is_paused"
PAUSE_PATH = "/pause"
RESUME_PATH = "/resume"
ABORT_PATH = "/abort_requests"
UPDATE_WEIGHT_VERSION_PATH = "/update_weight_version"
WEIGHT_CHECKER_PATH = "/weight_checker"
METRICS_PATH = "/metrics"
COLLECTIVE_RPC_PATH = "/collective_rpc"
"""vLLM's dev route that runs one method on every worker of the engine (``reload_weights`` here)."""
WORLD_SIZE_PATH = "/get_world_size"
SERVER_INFO_PATH = "/server_info"
MODELS_PATH = "/v1/models"
INIT_TRANSFER_PATH = "/init_weight_transfer_engine"
START_UPDATE_PATH = "/start_weight_update"
UPDATE_WEIGHTS_PATH = "/update_weights"
FINISH_UPDATE_PATH = "/finish_weight_update"
VLLM_RESET_PATH = "/reset_prefix_cache"
"""vLLM (served with ``VLLM_SERVER_DEV_MODE=1``) and the simulator."""
LOAD_ADAPTER_PATH = "/v1/load_lora_adapter"
UNLOAD_ADAPTER_PATH = "/v1/unload_lora_adapter"
"""vLLM's runtime LoRA routes, mounted only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``
(``router.adapters.plan``)."""
DYNAMO_RESET_PATH = "/engine/flush_cache"
"""A ``dynamo.vllm`` worker's system server (the RL admin route)."""

LOAD_GAUGES: tuple[str, ...] = ("vllm:num_requests_running", "vllm:num_requests_waiting")
"""The engine's load gauges on ``METRICS_PATH``: requests running and waiting; their sum is its load. The
bench's samples and the elastic tail policy read these same two, so a drain decision and the figures that
judge it never count load differently."""

PAUSE_MODES = ("abort", "wait", "keep")
"""vLLM's ``PauseMode``: abort in-flight requests, wait for them to finish, or freeze them until resume."""

Check = Callable[[Any], str | None]
"""Judges a parsed 2xx body: ``None`` when it shows the engine complied, else why not."""
Hint = Callable[[int], str]
"""Says more about a non-2xx status of one route (a 404 from vLLM without dev mode)."""

T = TypeVar("T")


@dataclass
class EngineAnswer:
    """One engine's answer to one call, judged (the shape ``FleetOpReport`` carries per engine)."""

    url: str
    ok: bool
    status: int | None
    detail: str = ""
    body: Any = None
    """The engine's parsed JSON answer (``None`` when it sent none)."""


@dataclass(frozen=True)
class Health:
    """One ``GET /health``: ``ok`` for a 2xx in time; ``detail`` says what came back or why not."""

    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class Reading(Generic[T]):
    """One value read from one engine: ``value`` is ``None`` exactly when the read failed (``error``)."""

    url: str
    value: T | None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.value is not None


def dev_mode_hint(status: int) -> str:
    if status == 404:
        return " (vLLM serves the RL routes only with VLLM_SERVER_DEV_MODE=1 in generation.env)"
    return ""


def reset_hint(path: str) -> Hint:
    """What a 404 on a cache-reset route means, per route."""

    def hint(status: int) -> str:
        if status == 404 and path == VLLM_RESET_PATH:
            return " (vLLM serves it only with VLLM_SERVER_DEV_MODE=1 in generation.env)"
        if status == 404:
            return " (this engine has no cache-invalidation route)"
        return ""

    return hint


def adapter_hint(status: int) -> str:
    if status == 404:
        return (
            " (vLLM serves the adapter routes only with --enable-lora and "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1: set generation.lora; a 404 naming the adapter is a "
            "directory it could not find)"
        )
    return ""


def expect(key: str, value: Any) -> Check:
    def check(body: Any) -> str | None:
        got = body.get(key) if isinstance(body, dict) else None
        return None if got == value else f"answered {key}={got!r}, expected {value!r}"

    return check


def has(key: str) -> Check:
    def check(body: Any) -> str | None:
        return None if isinstance(body, dict) and key in body else f"answer lacks {key!r}: {body!r}"[:300]

    return check


def describe_failure(exc: BaseException, timeout_s: float) -> str:
    """A short reason a call got no answer ("no answer within 2 s", "cannot connect (connection
    refused)"): it lands in a dashboard row, an event or a health record, which have room for a few
    words, not a traceback (aiohttp's timeout error has no message at all)."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(exc, aiohttp.ClientConnectorError):
        err = exc.os_error
        if isinstance(err, ConnectionRefusedError):
            return "cannot connect (connection refused)"
        if isinstance(err, socket.gaierror):
            return f"cannot connect (unknown host {exc.host})"
        return f"cannot connect ({getattr(err, 'strerror', None) or type(err).__name__})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "disconnected"
    return f"{type(exc).__name__}: {exc}"[:120]


class EngineClient:
    """Calls to the job's engines over one session. ``api_key``: the engine key (``None``: engines
    without one, as in some tests); ``timeout_s`` bounds each call."""

    def __init__(self, session: aiohttp.ClientSession, api_key: str | None = None, timeout_s: float = 60.0):
        self.session = session
        self.api_key = api_key
        self.timeout_s = timeout_s

    @classmethod
    @asynccontextmanager
    async def open(cls, api_key: str | None = None, timeout_s: float = 60.0) -> AsyncIterator[EngineClient]:
        """A client with a session of its own, closed on exit. No cap on connections: a fleet-wide call
        goes to every engine at once, and a capped pool would make the last engines wait out their
        timeout in the queue."""
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            yield cls(session, api_key, timeout_s)

    async def each(self, urls: Sequence[str], call: Callable[[EngineClient, str], Awaitable[T]]) -> list[T]:
        """``call(self, url)`` for every engine at once, answers in ``urls``' order."""
        return list(await asyncio.gather(*(call(self, u) for u in urls)))

    # -- the one transport --------------------------------------------------------------------------
    async def call(
        self,
        url: str,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: dict[str, str] | None = None,
        check: Check | None = None,
        hint: Hint = dev_mode_hint,
        limit: int = MAX_ANSWER_BYTES,
    ) -> EngineAnswer:
        """``method path`` on one engine, with the key; an error, a timeout, a non-2xx answer, an
        ``"error"`` key in the body, a failed ``check`` or an answer over ``limit`` bytes is a failure of
        that engine."""
        got = await self._send(url, method, path, json_body=json_body, params=params, key=True, limit=limit)
        if isinstance(got, str):
            return EngineAnswer(url, False, None, got)
        status, text = got
        try:
            body = await off_loop(json.loads, text) if text else None
        except ValueError:
            body = None
        if not 200 <= status < 300:
            return EngineAnswer(url, False, status, f"HTTP {status}{hint(status)}: {text[:300]}")
        if isinstance(body, dict) and "error" in body:
            return EngineAnswer(url, False, status, f"engine error: {str(body['error'])[:300]}", body)
        why = check(body) if check is not None else None
        if why is not None:
            return EngineAnswer(url, False, status, why, body)
        return EngineAnswer(url, True, status, "", body)

    async def _send(
        self,
        url: str,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: dict[str, str] | None = None,
        key: bool,
        brief: bool = False,
        limit: int = MAX_ANSWER_BYTES,
    ) -> tuple[int, str] | str:
        """``(status, text)``, or why nothing came back: the exception's type and message for the
        reports the trainer logs (``ClientConnectorError: ...``), or with ``brief`` the few words a
        dashboard row has room for (``describe_failure``). At most ``limit`` bytes are read
        (``read_capped``): past it the call fails."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if key and self.api_key else {}
        try:
            async with self.session.request(
                method,
                url + path,
                json=json_body,
                params=params,
                headers=headers,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            ) as resp:
                raw = await read_capped(resp, limit)
                charset = resp.charset or "utf-8"
        except AnswerTooLarge as exc:
            return f"{path}: {exc}"
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            return describe_failure(exc, self.timeout_s) if brief else f"{type(exc).__name__}: {exc}"
        return resp.status, await decoded(raw, charset)

    # -- reads ----------------------------------------------------------------------------------------
    async def health(self, url: str) -> Health:
        """``GET /health``, without the key (the one route the engines serve open)."""
        got = await self._send(url, "GET", HEALTH_PATH, key=False)
        if isinstance(got, str):
            return Health(False, f"probe failed: {got}")
        status, _ = got
        return Health(200 <= status < 300, f"HTTP {status}")

    async def weight_info(self, url: str) -> EngineAnswer:
        """``GET /weight_info``, judged: the answer must carry ``weight_version``."""
        return await self.call(url, "GET", WEIGHT_INFO_PATH, check=has("weight_version"))

    async def weight_version(self, url: str) -> Reading[str]:
        answer = await self.weight_info(url)
        if not answer.ok or answer.body["weight_version"] is None:
            return Reading(url, None, answer.detail or "no weight version")
        return Reading(url, str(answer.body["weight_version"]))

    async def paused_answer(self, url: str) -> EngineAnswer:
        """``GET /is_paused``, judged: the answer must carry ``is_paused``."""
        return await self.call(url, "GET", IS_PAUSED_PATH, check=has("is_paused"))

    async def is_paused(self, url: str) -> Reading[bool]:
        answer = await self.paused_answer(url)
        if not answer.ok:
            return Reading(url, None, answer.detail)
        return Reading(url, bool(answer.body["is_paused"]))

    async def counters(self, url: str) -> Reading[Counters]:
        """The engine's counters from ``GET /metrics`` (``router.fleet.engine_counters`` names them). An
        answer that is not Prometheus text (an HTML page) is an error of the read, not zero counts."""
        got = await self._send(url, "GET", METRICS_PATH, key=True, limit=MAX_METRICS_BYTES)
        if isinstance(got, str):
            return Reading(url, None, got)
        status, text = got
        if status != 200:
            return Reading(url, None, f"HTTP {status}")
        try:
            return Reading(url, await off_loop(parse_counters, text))
        except ValueError as exc:
            return Reading(url, None, f"unparsable /metrics: {exc}")

    async def metrics_text(self, url: str) -> Reading[str]:
        """The engine's whole ``GET /metrics`` text, for a reader that wants more than the counters
        (``rl-launch status``'s load, cache and latency figures)."""
        got = await self._send(url, "GET", METRICS_PATH, key=True, brief=True, limit=MAX_METRICS_BYTES)
        if isinstance(got, str):
            return Reading(url, None, got)
        status, text = got
        if status != 200:
            return Reading(url, None, f"HTTP {status} from /metrics")
        return Reading(url, text)

    # -- operations ------------------------------------------------------------------------------------
    async def pause(self, url: str, mode: str) -> EngineAnswer:
        return await self.call(url, "POST", PAUSE_PATH, params={"mode": mode})

    async def resume(self, url: str) -> EngineAnswer:
        return await self.call(url, "POST", RESUME_PATH)

    async def abort(self, url: str, request_ids: list[str]) -> EngineAnswer:
        """Abort the named requests, or every one with ``[]``."""
        return await self.call(url, "POST", ABORT_PATH, json_body={"request_ids": request_ids})

    async def stamp(self, url: str, version: str) -> EngineAnswer:
        """Set the engine's weight version; it must answer with the version it now reports."""
        return await self.call(
            url,
            "POST",
            UPDATE_WEIGHT_VERSION_PATH,
            json_body={"new_version": version},
            check=expect("new_version", version),
        )

    async def checksum(self, url: str) -> EngineAnswer:
        """The engine's per-parameter weight checksums (``body["checksums"]``) of every weight it computes
        with: the launcher's worker extension through ``/collective_rpc``, else (an engine without it)
        vLLM's ``/weight_checker``, whose ``body["uncovered"]`` names what it hashed as zero bytes
        (``router.fleet.weight_checksums`` says why)."""
        rpc = {"method": CHECKSUM_METHOD}
        answer = await self.call(url, "POST", COLLECTIVE_RPC_PATH, json_body=rpc, limit=MAX_TABLE_BYTES)
        if answer.ok:
            merged, why = merge_workers(answer.body)
            if merged is None:
                return EngineAnswer(url, False, answer.status, why, answer.body)
            return EngineAnswer(url, True, answer.status, "", merged)
        if not no_such_method(answer.detail):
            return answer
        answer = await self.call(
            url,
            "POST",
            WEIGHT_CHECKER_PATH,
            json_body={"action": "checksum"},
            check=has("checksums"),
            limit=MAX_TABLE_BYTES,
        )
        if answer.ok:
            answer.body = from_checker(answer.body)
        return answer

    async def reload_weights(self, url: str, weights_path: str) -> EngineAnswer:
        """Reload the engine's weights in place from ``weights_path`` on every one of its workers (vLLM's
        ``collective_rpc`` of ``reload_weights``). On vLLM 0.32 a failed reload leaves the model without
        weights (its checksum read fails, its next generation step kills the engine core): the engine is
        then unusable until a good reload, not merely on old weights."""
        return await self.call(
            url,
            "POST",
            COLLECTIVE_RPC_PATH,
            json_body={"method": "reload_weights", "kwargs": {"weights_path": weights_path}},
        )

    async def world_size(self, url: str) -> Reading[int]:
        """The engine's TP x PP size (its ranks in a weight-transfer group), without data parallelism."""
        answer = await self.call(
            url, "GET", WORLD_SIZE_PATH, params={"include_dp": "false"}, check=has("world_size")
        )
        if not answer.ok:
            return Reading(url, None, answer.detail)
        try:
            return Reading(url, int(answer.body["world_size"]))
        except (TypeError, ValueError):
            return Reading(url, None, f"world_size is not a number: {answer.body['world_size']!r}")

    async def server_info_answer(self, url: str, fmt: str = "json") -> EngineAnswer:
        """``GET /server_info?config_format=fmt`` (dev mode), judged: a failure without ``vllm_config``."""
        return await self.call(
            url, "GET", SERVER_INFO_PATH, params={"config_format": fmt}, check=has("vllm_config")
        )

    async def server_info(self, url: str) -> Reading[dict[str, Any]]:
        """``GET /server_info?config_format=json``: the engine's whole configuration (dev mode)."""
        answer = await self.server_info_answer(url)
        if not answer.ok:
            return Reading(url, None, answer.detail)
        config = answer.body["vllm_config"]
        if not isinstance(config, dict):
            return Reading(url, None, "vllm_config is not an object (an engine older than vLLM 0.32?)")
        return Reading(url, config)

    async def model_root(self, url: str) -> Reading[str]:
        """Where the served model was loaded from (``root`` of the first ``/v1/models`` entry)."""
        answer = await self.call(url, "GET", MODELS_PATH, check=has("data"))
        if not answer.ok:
            return Reading(url, None, answer.detail)
        data = answer.body["data"]
        root = data[0].get("root") if isinstance(data, list) and data and isinstance(data[0], dict) else None
        return Reading(url, str(root)) if root else Reading(url, None, "/v1/models names no root")

    async def init_weight_transfer(self, url: str, init_info: dict[str, Any]) -> EngineAnswer:
        """Join the trainer's weight-transfer group (NCCL: the engine's ranks from ``rank_offset``)."""
        return await self.call(url, "POST", INIT_TRANSFER_PATH, json_body={"init_info": init_info})

    async def start_weight_update(self, url: str) -> EngineAnswer:
        return await self.call(url, "POST", START_UPDATE_PATH)

    async def update_weights(self, url: str, update_info: dict[str, Any]) -> EngineAnswer:
        """Receive one round of weights (the trainer broadcasts them meanwhile)."""
        return await self.call(url, "POST", UPDATE_WEIGHTS_PATH, json_body={"update_info": update_info})

    async def finish_weight_update(self, url: str) -> EngineAnswer:
        """End the update (the version is stamped by the transaction after it verified the weights)."""
        return await self.call(url, "POST", FINISH_UPDATE_PATH, json_body={})

    async def reset_cache(self, url: str, path: str = VLLM_RESET_PATH) -> EngineAnswer:
        """Flush the engine's prefix cache (``path``: the engine kind's route)."""
        return await self.call(url, "POST", path, hint=reset_hint(path))

    # -- LoRA adapters (router.adapters) ------------------------------------------------------------------
    async def load_adapter(self, url: str, served_name: str, path: str) -> EngineAnswer:
        """Load the adapter directory ``path`` under ``served_name``. vLLM answers a name already loaded
        400 and a rank above its ``--max-lora-rank`` or an unreadable file 500, and stays up either way."""
        return await self.call(
            url,
            "POST",
            LOAD_ADAPTER_PATH,
            json_body={"lora_name": served_name, "lora_path": path},
            hint=adapter_hint,
        )

    async def unload_adapter(self, url: str, served_name: str) -> EngineAnswer:
        return await self.call(
            url, "POST", UNLOAD_ADAPTER_PATH, json_body={"lora_name": served_name}, hint=adapter_hint
        )

    async def models(self, url: str) -> Reading[dict[str, str]]:
        """Every model the engine serves, ``{id: root}``: the base model first, then each adapter loaded
        (its ``root`` is the directory it was loaded from)."""
        answer = await self.call(url, "GET", MODELS_PATH, check=has("data"))
        if not answer.ok:
            return Reading(url, None, answer.detail)
        data = answer.body["data"]
        if not isinstance(data, list):
            return Reading(url, None, "/v1/models data is not a list")
        return Reading(
            url,
            {str(m["id"]): str(m.get("root") or "") for m in data if isinstance(m, dict) and "id" in m},
        )
