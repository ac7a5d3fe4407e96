"""vLLM 0.32's RL and dev routes (``VLLM_SERVER_DEV_MODE=1``) on the simulator, with the same semantics.

A test of the refit window (pause, abort, load, version stamp, checksum, resume) against simulated fleets
proves something only if the simulator answers those routes as vLLM does
(``vllm/entrypoints/rl/online/api_router.py``, ``vllm/entrypoints/serve/dev/rpc/api_router.py``,
``.../dev/server_info/api_router.py``): same paths, query and body fields, same answer keys, and the
same failures, each checked against a real vLLM 0.32 CPU engine:

* Body validation as FastAPI does it (vLLM renders it 400 ``{"error": {"message": "1 validation error:
  ...", "type": "Bad Request", "param": "body.init_info", "code": 400}}``); ``/collective_rpc`` parses
  its body by hand: 400 "JSON decode error: ...", "Request body must be a JSON object", "Missing 'method'
  in request body".
* A worker method that raises answers 500 "Call to collective_rpc method failed: Worker failed with
  error '<message>', please check the stack trace above for the root cause" (the message sanitized:
  paths become ``<path>``), and the engine keeps serving; what the failure leaves behind (detached
  weights, which the next generation step turns into a dead engine core) is ``worker``'s and ``core``'s.
* Once the core is dead, every route that reaches it answers vLLM's 500 "EngineCore encountered an
  issue..."; ``/pause``, ``/resume``, ``/is_paused`` and ``/abort_requests`` catch it into their own
  ``{"error": "Failed to ...: ..."}``; ``/get_world_size`` and ``/server_info`` (the HTTP server's own
  state) still answer.

``/weight_checker``: the checksums are the worker's (``worker.SimWorker.checksums``): the model name and
``--weights-tag`` until a checkpoint directory is loaded, then that directory's digest. A version stamp
does not change them (it is a label, as in vLLM); nor does a reload change the version.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from .config import SimConfig
from .core import (
    ENGINE_DEAD,
    SimCore,
    bad_request,
    error_response,
    field_error,
    rpc_failure,
    validation_error,
)
from .info import server_info
from .scheduler import Scheduler
from .worker import SimWorker, WorkerError

PAUSE_MODES = ("abort", "wait", "keep")
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


class SimRl:
    def __init__(self, scheduler: Scheduler, config: SimConfig, worker: SimWorker, core: SimCore) -> None:
        self.scheduler = scheduler
        self.config = config
        self.worker = worker
        self.core = core
        self.weight_version = "default"  # vLLM's EngineCore starts with "default"
        self._utility = asyncio.Lock()  # the engine core runs one utility call at a time
        self.env_collected = False
        """Whether a ``/server_info`` has collected the environment (``SimConfig.env_collect_s``)."""
        self.env_collections = 0
        """How many ``/server_info`` reads collected the environment (more than one: they overlapped)."""
        self.server_info_reads = 0
        """``/server_info`` answers given (what a test counts to see answers kept)."""

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def checksums(self) -> dict[str, str]:
        """The weights' checksums as seen from Python (the HTTP route fails while they are detached)."""
        detached, self.worker.detached = self.worker.detached, False
        try:
            return self.worker.checksums()
        finally:
            self.worker.detached = detached

    def add_routes(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/pause", self.pause)
        r.add_post("/resume", self.resume)
        r.add_get("/is_paused", self.is_paused)
        r.add_post("/abort_requests", self.abort_requests)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_get("/weight_info", self.weight_info)
        r.add_post("/weight_checker", self.weight_checker)
        r.add_post("/collective_rpc", self.collective_rpc)
        r.add_post("/init_weight_transfer_engine", self.init_weight_transfer_engine)
        r.add_post("/shutdown_weight_transfer_engine", self.shutdown_weight_transfer_engine)
        r.add_post("/start_weight_update", self.start_weight_update)
        r.add_post("/start_draft_weight_update", self.start_draft_weight_update)
        r.add_post("/update_weights", self.update_weights)
        r.add_post("/finish_weight_update", self.finish_weight_update)
        r.add_get("/get_world_size", self.get_world_size)
        r.add_get("/server_info", self.server_info)

    # -- the engine core ---------------------------------------------------------------------------
    async def _dead(self) -> bool:
        await self.core.wait_verdict()
        return not self.core.alive

    def _caught(self, what: str) -> web.Response:
        """A route that catches the core's death into its own error (and so does not end the server)."""
        return _json({"error": f"Failed to {what}: {ENGINE_DEAD}"}, 500)

    async def _rpc(
        self, method: Any, args: Any = (), kwargs: Any = None, label: str = "collective_rpc"
    ) -> Any:
        """One call into the worker through the engine core; returns its result or the error response."""
        if await self._dead():
            return self.core.dead_response()
        async with self._utility, self.scheduler.core_busy():
            if not self.core.alive:
                return self.core.dead_response()
            try:
                return _Result(await self.worker.call(method, args, kwargs or {}))
            except WorkerError as e:
                return rpc_failure(label, str(e))

    # -- pause, resume, abort, version ---------------------------------------------------------------
    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return _json({"detail": f"mode must be one of {PAUSE_MODES}"}, 422)
        if await self._dead():
            return self._caught("pause generation")
        await self.scheduler.pause_generation(mode)
        return _json({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        if await self._dead():
            return self._caught("resume generation")
        self.scheduler.resume_generation()
        return _json({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        if await self._dead():
            return self._caught("fetch pause status")
        return _json({"is_paused": self.scheduler.gen_paused})

    async def _body(self, request: web.Request) -> Any:
        try:
            return orjson.loads(await request.read() or b"{}")
        except orjson.JSONDecodeError:
            return None

    async def abort_requests(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if not isinstance(body, dict):
            return _json({"detail": "Request body must be a JSON object"}, 400)
        if await self._dead():
            return self._caught("abort requests")
        ids = body.get("request_ids") or []
        n = self.scheduler.abort_ids([str(i) for i in ids])
        return _json({"status": "aborted", "aborted": len(ids) if ids else n})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        version = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(version, str):
            return _json({"detail": "new_version (string) is required"}, 422)
        if await self._dead():
            return self.core.dead_response()
        self.weight_version = version
        return _json({"success": True, "new_version": version})

    async def weight_info(self, request: web.Request) -> web.Response:
        if await self._dead():
            return self.core.dead_response()
        return _json({"weight_version": self.weight_version})

    async def weight_checker(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        action = body.get("action") if isinstance(body, dict) else None
        if action not in ("checksum", "compare", "reset"):
            return _json({"detail": "action must be checksum, reset or compare"}, 422)
        if action == "compare" and not isinstance(body.get("baseline"), dict):
            return _json({"detail": "action='compare' requires a 'baseline' object"}, 400)
        if await self._dead():
            return self.core.dead_response()
        if action == "reset":
            return _json({"status": "reset"})
        got = await self._rpc("compute_weight_checksums", label="compute_weight_checksums")
        if not isinstance(got, _Result):
            return got
        checksums: dict[str, str] = got.value
        if action == "checksum":
            return _json({"checksums": checksums})
        baseline = body["baseline"]
        mismatches = sorted(
            k for k in checksums.keys() | baseline.keys() if checksums.get(k) != baseline.get(k)
        )
        return _json({"match": not mismatches, "mismatches": mismatches})

    # -- collective_rpc ------------------------------------------------------------------------------
    async def collective_rpc(self, request: web.Request) -> web.Response:
        """Body ``{"method", "args"?, "kwargs"?, "timeout"?}``; answers ``{"results": [one per rank]}``."""
        try:
            body = json.loads(await request.read())
        except json.JSONDecodeError as e:
            return bad_request(f"JSON decode error: {e}")
        except ValueError as e:  # not UTF-8: vLLM's catch-all handler makes a ValueError a 400
            return error_response(400, str(e), "BadRequestError")
        if not isinstance(body, dict):
            return bad_request("Request body must be a JSON object")
        method = body.get("method")
        if method is None:
            return bad_request("Missing 'method' in request body")
        args = body.get("args", [])
        if not isinstance(args, (list, str, dict)):
            return error_response(400, f"'{type(args).__name__}' object is not iterable", "BadRequestError")
        kwargs = body.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            return rpc_failure(
                "collective_rpc", f"argument after ** must be a mapping, not {type(kwargs).__name__}"
            )
        got = await self._rpc(method, tuple(args), kwargs)
        if not isinstance(got, _Result):
            return got
        value = got.value if got.value is None or isinstance(got.value, (dict, list)) else str(got.value)
        return _json({"results": [value] * self.config.world_size})

    # -- the weight-transfer routes ------------------------------------------------------------------
    async def _fields(self, request: web.Request) -> dict[str, Any] | web.Response:
        """A FastAPI ``Body(embed=True)`` body: the JSON object (``{}`` when absent) or the 400."""
        raw = await request.read()
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError as e:
            msg = getattr(e, "msg", str(e))
            return validation_error([field_error("body", "json_invalid", "JSON decode error", {}, error=msg)])
        return body if isinstance(body, dict) else {}

    async def _transfer(
        self, method: str, message: str, kwargs: dict[str, Any] | None = None
    ) -> web.Response:
        got = await self._rpc(method, (), kwargs or {})
        return _json({"message": message}) if isinstance(got, _Result) else got

    async def init_weight_transfer_engine(self, request: web.Request) -> web.Response:
        body = await self._fields(request)
        if isinstance(body, web.Response):
            return body
        info = body.get("init_info")
        if not isinstance(info, dict):
            kind, msg = (
                ("missing", "Field required")
                if info is None
                else ("dict_type", "Input should be a valid dictionary")
            )
            return validation_error([field_error("body.init_info", kind, msg, info)])
        return await self._transfer(
            "init_weight_transfer_engine", "Weight transfer initialized", {"init_info": info}
        )

    async def shutdown_weight_transfer_engine(self, request: web.Request) -> web.Response:
        return await self._transfer("shutdown_weight_transfer_engine", "Weight transfer shut down")

    async def start_weight_update(self, request: web.Request) -> web.Response:
        return await self._transfer("start_weight_update", "Weight update started")

    async def start_draft_weight_update(self, request: web.Request) -> web.Response:
        return await self._transfer("start_draft_weight_update", "Draft weight update started")

    async def update_weights(self, request: web.Request) -> web.Response:
        body = await self._fields(request)
        if isinstance(body, web.Response):
            return body
        info = body.get("update_info")
        loc = "body.update_info"
        if info is None:
            return validation_error([field_error(loc, "missing", "Field required", None)])
        if isinstance(info, list):
            bad = [i for i, item in enumerate(info) if not isinstance(item, dict)]
            if bad:
                errors = [
                    field_error(f"{loc}.{i}", "dict_type", "Input should be a valid dictionary", info[i])
                    for i in bad
                ]
                first = field_error(loc, "dict_type", "Input should be a valid dictionary", info)
                return validation_error([first, *errors])
        elif not isinstance(info, dict):
            return validation_error(
                [
                    field_error(loc, "dict_type", "Input should be a valid dictionary", info),
                    field_error(loc, "list_type", "Input should be a valid list", info),
                ]
            )
        return await self._transfer("update_weights", "Weights updated", {"update_info": info})

    async def finish_weight_update(self, request: web.Request) -> web.Response:
        body = await self._fields(request)
        if isinstance(body, web.Response):
            return body
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            return validation_error(
                [field_error("body.weight_version", "string_type", "Input should be a valid string", version)]
            )
        answer = await self._transfer("finish_weight_update", "Weight update finished")
        if answer.status == 200 and version is not None:
            self.weight_version = version  # vLLM stamps it after the worker finished
        return answer

    # -- the HTTP server's own state -----------------------------------------------------------------
    async def get_world_size(self, request: web.Request) -> web.Response:
        raw = request.query.get("include_dp", "true")
        if raw.lower() not in _TRUE | _FALSE:
            return validation_error(
                [
                    field_error(
                        "query.include_dp",
                        "bool_parsing",
                        "Input should be a valid boolean, unable to interpret input",
                        raw,
                    )
                ]
            )
        dp = self.config.data_parallel_size if raw.lower() in _TRUE else 1
        return _json({"world_size": self.config.world_size * dp})

    async def server_info(self, request: web.Request) -> web.Response:
        fmt = request.query.get("config_format", "text")
        if fmt not in ("text", "json"):
            expected = "'text' or 'json'"
            return validation_error(
                [
                    field_error(
                        "query.config_format",
                        "literal_error",
                        f"Input should be {expected}",
                        fmt,
                        expected=expected,
                    )
                ]
            )
        if not self.env_collected and self.config.env_collect_s > 0:
            self.env_collections += 1
            await asyncio.sleep(self.config.scaled(self.config.env_collect_s))
        self.env_collected = True
        self.server_info_reads += 1
        return _json(server_info(self.config, fmt == "json"))


class _Result:
    """A worker call's return value (apart from an error response)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value
