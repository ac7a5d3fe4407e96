"""One simulated vLLM engine served over HTTP by aiohttp: routes, API key, and fault injection.

Routes (vLLM's surface): ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming SSE or
not), ``POST /tokenize``, ``POST /detokenize``, ``GET /v1/models``, ``GET /health`` (200, empty body),
``GET /metrics`` (Prometheus text, vLLM names), and vLLM's RL and dev routes (``rl``: pause, weights,
``/collective_rpc``, the weight-transfer routes, ``/get_world_size``, ``/server_info``), and with vLLM's
LoRA flags its runtime adapter routes (``lora``). Admin:
``POST /sim/fault`` (body: see ``faults``), ``GET /sim/fault``, ``GET /sim/stats``.

The engine core can die as vLLM's does (``core``): a generation step on weights a failed reload or a
weight update left detached (``worker``) kills it; ``/health`` then answers 503 and the engine routes
vLLM's 500, and shortly after the server "exits": the ``kill`` fault, for good (``exited`` is set; the
command line exits once all its engines have). Setting the fault to ``none`` from Python restarts such an
engine as vLLM restarts: built-in weights, version "default", empty cache.

The API key, as vLLM checks it: with a key and nothing else, only routes under vLLM's guarded prefixes
(``/v1``, ``/v2``, ``/inference``, ``/cohere``; never ``OPTIONS``) demand ``Authorization: Bearer K``
(401 otherwise), while ``/health``, ``/metrics``, ``/tokenize``, ``/detokenize`` and vLLM's dev routes
(``/pause``, ``/update_weight_version``, ``/collective_rpc``, the weight-transfer routes, ``/server_info``...)
answer anyone, exactly as a vLLM server in dev mode does: the tests must see what a user's engine exposes,
not a safer stand-in. With ``key_guard`` (what the launcher
gives every engine it starts with a key, vLLM through ``--middleware``) every route but ``/health`` takes
the key, by the same rule (``launcher.engines.key_guard``). ``/sim/*``, which has no vLLM counterpart and
can take the engine down, always demands the key when there is one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import struct
import time
from typing import Any

import orjson
from aiohttp import web

from ..key_guard import authorized, needs_key
from .checkpoint import CheckpointError, read_checkpoint
from .config import SimConfig
from .core import ENGINE_DEAD, CoreState, SimCore
from .faults import FaultSpec
from .lora import SimLora
from .metrics import CONTENT_TYPE, SimMetrics
from .protocol import (
    SSE_DONE,
    ApiError,
    GenParams,
    Kind,
    PlannedOutput,
    check_model,
    error_body,
    full_response,
    models_body,
    new_id,
    parse_generation,
    plan_output,
    prompt_of,
    role_chunk,
    stream_chunk,
    usage_chunk,
)
from .rl import SimRl
from .scheduler import ABORT_REASON, ReqState, Scheduler, SimRequest
from .stats import EngineStats
from .tokens import decode
from .worker import SimWorker

# Agent prompts with tool schemas run to megabytes; aiohttp's 1 MiB default would answer 413.
MAX_BODY_BYTES = 64 * 1024 * 1024
_JSON = "application/json"


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type=_JSON)


def _request_id(request: web.Request) -> str | None:
    """The client's ``X-Request-Id``; ``ApiError`` 400 for one that is not UTF-8. Every answer echoes the id
    in its JSON (``chatcmpl-<id>``), which such an id cannot be: checked before anything is scheduled, as a
    careful engine does, so it is the client's error (this simulator used to fail in ``_json``: a 500 that
    read as the engine's)."""
    given = request.headers.get("X-Request-Id")
    if given:
        try:
            given.encode()
        except UnicodeEncodeError:
            raise ApiError(400, "X-Request-Id is not valid UTF-8", param="X-Request-Id") from None
    return given


def _api_error(e: ApiError) -> web.Response:
    return web.Response(body=e.body(), status=e.status, content_type=_JSON)


def _reset_transport(transport: asyncio.BaseTransport | None) -> None:
    """Close a connection with a TCP RST, as the kernel does when a process dies mid-request (a plain
    close would send FIN, and the client would see a clean end-of-stream instead)."""
    if transport is None or transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()  # type: ignore[attr-defined]


# vLLM's own key check (vllm/entrypoints/serve/middleware/authenticate.py, 0.32): these prefixes only.
VLLM_GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")

# vLLM's dev-mode routes: answered even while wedged (a trainer must be able to resume a fleet).
_DEV_PATHS = frozenset(
    {
        "/reset_prefix_cache",
        "/pause",
        "/resume",
        "/is_paused",
        "/abort_requests",
        "/update_weight_version",
        "/weight_info",
        "/weight_checker",
        "/get_world_size",
        "/server_info",
    }
)
"""Of the routes that reach the worker (``/collective_rpc``, the weight-transfer routes) none is here: a
wedged GPU hangs them as it hangs vLLM's."""


class SimServer:
    """One simulated engine on ``host:port`` (0 = OS-chosen). Start and stop inside an event loop."""

    def __init__(
        self,
        config: SimConfig | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        key_guard: bool = False,
        fault: FaultSpec | str | None = None,
        index: int = 0,
    ) -> None:
        self.config = config or SimConfig()
        self.config.validate()
        self.host = host
        self._port = port
        self.index = index
        self._api_key = api_key or None
        self._key_guard = key_guard
        self.stats = EngineStats()
        self.scheduler = Scheduler(self.config, self.stats)
        self.metrics = SimMetrics(self.scheduler, self.config.model_name)
        self.exited = asyncio.Event()
        """Set when the engine core died and the server "exited" after it (see ``core``)."""
        self.lora = SimLora(self.config, lambda: self.core)
        self.lora.register(self.metrics.registry)
        self._new_core()
        self._fault = FaultSpec.parse(fault)
        # Seeded per engine so fleets repeat runs exactly yet engines do not fail in lockstep.
        self._dice = random.Random(self.config.seed * 1_000_003 + index)
        self._unwedged = asyncio.Event()
        self._unwedged.set()
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._revive_task: asyncio.Task[None] | None = None
        self._fault_lock = asyncio.Lock()
        self._created = int(time.time())

    def _new_core(self, initial_digest: str | None = None) -> None:
        """A fresh engine core and worker (at construction, and when a dead engine is restarted)."""
        self.worker = SimWorker(self.config, initial_digest)
        self.core = SimCore(self.config, lambda: self.worker.detached, self._core_died, self._core_exit)
        self.scheduler.step_gate = self.core.step_gate
        self.lora.reset()
        if hasattr(self, "rl"):  # its bound methods are the app's routes: restart it in place
            self.rl.worker, self.rl.core, self.rl.weight_version = self.worker, self.core, "default"
        else:
            self.rl = SimRl(self.scheduler, self.config, self.worker, self.core)

    def _core_died(self) -> None:
        self.scheduler.reset()  # every request in flight answers vLLM's EngineCore 500

    async def _core_exit(self) -> None:
        await self.set_fault("kill")
        self.exited.set()

    async def _initial_weights(self) -> None:
        """An engine whose ``model_path`` is a checkpoint directory starts on its weights; one it cannot
        read fails to start, as vLLM does."""
        path = self.config.model_path
        if path and await asyncio.to_thread(os.path.isdir, path):
            try:
                digest = await asyncio.to_thread(read_checkpoint, path)
            except (CheckpointError, OSError) as e:
                raise ValueError(f"model_path {path}: {e}") from None
            self.worker.initial_digest = self.worker.digest = digest

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._port}"

    @property
    def fault(self) -> FaultSpec:
        return self._fault

    @property
    def listening(self) -> bool:
        return self._site is not None

    async def start(self) -> str:
        """Bind, start the scheduler, apply the initial fault; returns the URL once the socket is bound."""
        await self._initial_weights()
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._gate])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/sim/fault", self._post_fault)
        app.router.add_get("/sim/fault", self._get_fault)
        app.router.add_get("/sim/stats", self._get_stats)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        self.rl.add_routes(app)
        self.lora.add_routes(app)
        # handler_cancellation: a client that hangs up cancels its handler, whose ``finally`` aborts the
        # request and frees its KV, as vLLM aborts on disconnect (else timed-out clients fill the cache).
        self._runner = web.AppRunner(
            app, handle_signals=False, access_log=None, handler_cancellation=True, shutdown_timeout=1.0
        )
        await self._runner.setup()
        await self._bind()
        self.scheduler.start()
        initial, self._fault = self._fault, FaultSpec()
        await self.set_fault(initial)
        return self.url

    async def _bind(self) -> None:
        assert self._runner is not None
        site = web.TCPSite(self._runner, self.host, self._port, reuse_address=True)
        await site.start()
        self._site = site
        if self._port == 0:
            self._port = int(self._runner.addresses[-1][1])

    async def stop(self) -> None:
        """Release every waiting handler, abort all requests, close sockets. Idempotent."""
        if self._revive_task is not None:
            self._revive_task.cancel()
            self._revive_task = None
        self._unwedged.set()
        self.core.cancel()
        self.scheduler.resume()
        await self.scheduler.close()
        if self._runner is not None:
            runner, self._runner, self._site = self._runner, None, None
            await runner.cleanup()

    def stats_snapshot(self) -> dict[str, Any]:
        """Counters plus live state, for benches that would rather not parse Prometheus text."""
        s = self.scheduler
        d = self.stats.snapshot()
        d.update(
            url=self.url,
            fault=self._fault.mode,
            running=len(s.running),
            waiting=len(s.waiting),
            kv_usage=s.pool.usage(),
            kv_cached_blocks=s.pool.num_cached,
        )
        return d

    # -- faults ----------------------------------------------------------------------------------
    async def set_fault(
        self,
        fault: FaultSpec | str | dict[str, Any] | None,
        *,
        spare: web.BaseRequest | None = None,
        **params: Any,
    ) -> FaultSpec:
        """Switch fault mode (see ``faults`` for each mode's exact behaviour); returns the new spec.

        ``spare``: the admin request asking for a kill, whose connection is closed cleanly after its
        answer rather than reset.
        """
        spec = FaultSpec.parse(fault, **params)
        async with self._fault_lock:
            current = asyncio.current_task()
            if self._revive_task is not None and self._revive_task is not current:
                self._revive_task.cancel()
            self._revive_task = None
            old = self._fault
            # Undo the old mode.
            if old.mode == "kill" and spec.mode != "kill" and self._runner is not None:
                if not self.core.alive:  # a dead engine core comes back as a restarted vLLM does
                    self.core.cancel()
                    self._new_core(self.worker.initial_digest)
                    self.exited.clear()
                    self.scheduler.start()
                await self._bind()
            if old.mode == "wedge" and spec.mode != "wedge":
                self._unwedged.set()
                self.scheduler.resume()
            self.scheduler.slow_factor = 1.0
            self._fault = spec
            # Apply the new one.
            if spec.mode == "kill" and old.mode != "kill":
                await self._kill(spare)
            elif spec.mode == "wedge":
                self._unwedged.clear()
                self.scheduler.pause()
            elif spec.mode == "slow":
                self.scheduler.slow_factor = spec.slow_factor
            if spec.mode == "kill" and spec.revive_after_s is not None:
                self._revive_task = asyncio.get_running_loop().create_task(
                    self._revive(spec.revive_after_s), name="sim-revive"
                )
        return spec

    async def _kill(self, spare: web.BaseRequest | None) -> None:
        if self._site is not None:
            site, self._site = self._site, None
            await site.stop()
        spare_transport = spare.transport if spare is not None else None
        if self._runner is not None and self._runner.server is not None:
            for handler in list(self._runner.server.connections):
                if handler.transport is not spare_transport:
                    _reset_transport(handler.transport)
        self.scheduler.reset()

    async def _revive(self, delay: float) -> None:
        await asyncio.sleep(delay)
        self._revive_task = None
        await self.set_fault("none")

    # -- middleware ------------------------------------------------------------------------------
    def _authorized(self, request: web.Request) -> bool:
        assert self._api_key is not None
        return authorized(request.headers.get("Authorization"), self._api_key)

    def _needs_key(self, request: web.Request) -> bool:
        """Which requests vLLM (``key_guard``: vLLM with the launcher's guard) answers only with the key."""
        if self._api_key is None:
            return False
        path = request.path
        if path.startswith("/sim/"):
            return True
        if self._key_guard:
            return needs_key(path)
        return request.method != "OPTIONS" and path.startswith(VLLM_GUARDED_PREFIXES)

    @web.middleware
    async def _gate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self._needs_key(request) and not self._authorized(request):
            return _json({"error": "Unauthorized"}, 401)
        path = request.path
        if path.startswith("/sim/") or path in _DEV_PATHS:
            return await handler(request)
        if not self._unwedged.is_set() and (self._fault.wedge_health or path not in ("/health", "/metrics")):
            await self._unwedged.wait()
        return await handler(request)

    # -- generation ------------------------------------------------------------------------------
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _read_json(self, request: web.Request) -> Any:
        """The body as vLLM reads it: FastAPI parses with ``json.loads``, which takes what orjson refuses
        (``NaN``, a UTF-8 byte order mark, a lone surrogate escape). A stricter simulator hid a hole: the
        router forwarded such bodies unread, and only the real engine served what they named."""
        try:
            return json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
            raise ApiError(400, f"invalid JSON body: {e}") from None

    async def _generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        try:
            given = _request_id(request)
            params = parse_generation(kind, await self._read_json(request), self.config, self.lora.names())
            total = len(params.prompt) + params.max_tokens
            if not self.scheduler.fits_alone(total):
                raise ApiError(
                    400,
                    f"request needs {total} tokens of KV cache; the engine holds "
                    f"{self.config.num_gpu_blocks * self.config.block_size}",
                    param="max_tokens",
                )
            salt = await self.lora.salt(params.model, self.worker.output_salt)  # an adapter's text
        except ApiError as e:
            return _api_error(e)
        await self.core.wait_verdict()
        if not self.core.alive:
            return self.core.dead_response()
        if self._fault.mode == "error" and self._dice.random() < self._fault.error_rate:
            self.stats.errors_injected += 1
            return web.Response(
                body=error_body(500, "simulated engine error (fault injection)", "InternalServerError"),
                status=500,
                content_type=_JSON,
            )
        out = plan_output(params, self.config, salt)
        # vLLM's external id: the prefix plus X-Request-Id when the client sent one (POST /abort_requests
        # names requests by it).
        rid = new_id(kind) if not given else ("chatcmpl-" if kind == "chat" else "cmpl-") + given
        req = SimRequest(
            rid,
            params.prompt + out.tokens,
            len(params.prompt),
            len(out.tokens),
            out.finish_reason,
            stream=params.stream,
        )
        self.scheduler.submit(req)
        self.lora.track(params.model, req)
        try:
            if params.stream:
                return await self._stream(request, req, params, out)
            await req.done
            if self.core.state == CoreState.DEAD and req.state != ReqState.FINISHED:
                return self.core.dead_response()
            aborted = req.state == ReqState.ABORTED and req.finish_reason == ABORT_REASON
            if req.state != ReqState.FINISHED and not aborted:
                return web.Response(
                    body=error_body(500, "request aborted", "InternalServerError"),
                    status=500,
                    content_type=_JSON,
                )
            # vLLM answers a request aborted by /abort_requests or a pause(abort) like a finished one,
            # with finish_reason "abort" and what it had generated.
            output = PlannedOutput(out.tokens, out.text, ABORT_REASON, out.logprobs) if aborted else out
            created = int(time.time())
            model = params.model  # the served model's name, or a LoRA adapter's
            return _json(full_response(params, req.rid, created, model, output, req.n_gen, req.cached_tokens))
        finally:
            self.lora.untrack(req)
            if req.state in (ReqState.WAITING, ReqState.RUNNING):
                self.scheduler.abort(req)

    async def _stream(
        self, request: web.Request, req: SimRequest, params: GenParams, out: PlannedOutput
    ) -> web.StreamResponse:
        assert req.progress is not None
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        model = params.model
        created = int(time.time())
        sent = 0
        try:
            if params.kind == "chat":
                ids = params.prompt if params.return_token_ids else None
                await resp.write(role_chunk(req.rid, created, model, ids))
            while True:
                req.progress.clear()
                n = req.n_gen
                if n > sent:
                    done = req.state == ReqState.FINISHED and n >= req.target
                    await resp.write(stream_chunk(params, req.rid, created, model, out, sent, n, done))
                    sent = n
                    continue
                if req.state == ReqState.FINISHED:
                    break
                if req.state == ReqState.ABORTED and req.finish_reason == ABORT_REASON:
                    aborted = PlannedOutput(out.tokens, out.text, ABORT_REASON, out.logprobs)
                    await resp.write(stream_chunk(params, req.rid, created, model, aborted, sent, sent, True))
                    break  # aborted through the RL routes: ends like vLLM's, finish_reason "abort"
                if req.state == ReqState.ABORTED and self.core.state == CoreState.DEAD:
                    # vLLM's streaming generator catches the EngineDeadError: an error event, then [DONE]
                    await resp.write(
                        b"data: " + error_body(500, ENGINE_DEAD, "InternalServerError") + b"\n\n"
                    )
                    await resp.write(SSE_DONE)
                    await resp.write_eof()
                    return resp
                if req.state == ReqState.ABORTED:
                    return resp  # engine stopped or killed: the stream ends without [DONE]
                await req.progress.wait()
            if params.include_usage:
                await resp.write(usage_chunk(params, req.rid, created, model, sent, req.cached_tokens))
            await resp.write(SSE_DONE)
            await resp.write_eof()
        except ConnectionError:  # the client went away; the caller's ``finally`` aborts the request
            pass
        return resp

    # -- other routes ----------------------------------------------------------------------------
    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._read_json(request)
            if not isinstance(body, dict):
                raise ApiError(400, "request body must be a JSON object")
            check_model(body, self.config.model_name, self.lora.names())
            kind: Kind = "chat" if "messages" in body else "completion"
            ids = prompt_of(body, kind)
        except ApiError as e:
            return _api_error(e)
        return _json(
            {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids, "token_strs": None}
        )

    async def _detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._read_json(request)
            tokens = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise ApiError(400, "'tokens' must be a list of integers", param="tokens")
            try:
                text = decode(tokens)
            except ValueError as e:
                raise ApiError(400, str(e), param="tokens") from None
        except ApiError as e:
            return _api_error(e)
        return _json({"prompt": text})

    async def _models(self, request: web.Request) -> web.Response:
        body = models_body(self.config, self._created)
        body["data"] += self.lora.cards(self._created)
        return _json(body)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.core.state == CoreState.DEAD else 200)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _post_fault(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read() or b"{}")
            spec = FaultSpec.parse(body)
        except (orjson.JSONDecodeError, ValueError, TypeError) as e:
            return web.Response(
                body=error_body(400, str(e), "BadRequestError"), status=400, content_type=_JSON
            )
        spec = await self.set_fault(spec, spare=request)
        resp = _json({"fault": spec.to_dict()})
        if spec.mode == "kill":
            resp.force_close()
        return resp

    async def _get_fault(self, request: web.Request) -> web.Response:
        return _json({"fault": self._fault.to_dict()})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /reset_prefix_cache`` (dev mode): the fleet-wide cache invalidation after a weight
        update must reach simulated engines too, or a test of it proves nothing."""
        await self.core.wait_verdict()
        if not self.core.alive:
            return self.core.dead_response()
        dropped = self.scheduler.pool.drop_cached()
        return _json({"status": "ok", "dropped_blocks": dropped})

    async def _get_stats(self, request: web.Request) -> web.Response:
        return _json(self.stats_snapshot())
