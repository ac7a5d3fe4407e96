"""vLLM 0.32's control API for the whole fleet, on the fleet URL's origin and under ``/control`` there.

What a trainer written for one vLLM sends (``control_base_url: <fleet_url>`` and the job's admin token as
its Bearer): the same paths, query parameters, bodies, status codes and error JSON as vLLM 0.32's
own handlers (``vllm/entrypoints/rl/online/api_router.py``, ``serve/dev/*``, ``serve/lora/api_router.py``),
so its client works unchanged; the call sequence runs as the fleet's refit transaction
(``router.fleet.control_session``), which no single vLLM has: canary, verify, quarantine, version.

* Reads: ``GET /health`` (JSON: ``total_backends``, ``healthy_backends``, ``"control_fanout": true``:
  NeMo-RL refuses a control URL whose ``/health`` counts several backends without it; vLLM's own is an
  empty 200, and the generation URL's ``/health`` stays what probes expect), ``/v1/models`` (a serving
  engine's list, without roots), ``/server_info`` (an engine's ``vllm_config`` and the fleet: engines,
  version), ``/is_paused``, ``/weight_info``, ``/get_world_size`` (the fleet's engines' ranks summed: what
  a streaming trainer sizes its group with).
* The refit: ``/pause``, ``/collective_rpc`` (``reload_weights`` only) or prime-rl's directory
  ``/update_weights {"weight_dir": DIR}`` (its server's route, told from vLLM's streamed one by the
  body), ``/reset_prefix_cache``, ``/update_weight_version``, ``/resume``; streamed:
  ``/init_weight_transfer_engine`` (each engine joins at its own rank offset in the fleet's world size:
  ``router.fleet.refit_routes.rank_plan``), ``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``.
* LoRA: ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter`` (and prime-rl's ``/load_lora_adapter``)
  as the adapter transaction (``router.fleet.control_lora``), under the tenant rules.
* Anything else under ``/control/`` (``/sleep``, ``/wake_up``, another ``collective_rpc`` method) is
  refused in vLLM's error shape naming what is supported, and never forwarded: a raw call to every
  engine is exactly the untransacted fan-out this URL replaces.

Two mounts of one route list (``add_routes``): at the root, because NeMo-RL's ``remote_vllm`` client keeps
only the origin of its ``control_base_url`` (its default paths land there), and under ``/control`` (the
first mount; docs and clients use it). At the root of the builtin router ``/health`` and ``/v1/models``
stay the generation URL's (``router.http.app``: its ``/health`` says ``"control_fanout": true``, its
``/v1/models`` takes the admin token too; the driver's fleet endpoint, where nothing else serves them,
mounts the control ones there: ``add_root_reads``); vLLM's other control paths are refused at the root,
unknown paths get the router's 404.

Error JSON: the RL routes' ``{"error": "..."}`` where vLLM answers so (``/pause``, ``/resume``), else
vLLM's ``ErrorResponse`` ``{"error": {"message", "type", "param", "code"}}``. Every answer carries the
``x-rl-weight-version`` header and every JSON answer but an ``ErrorResponse`` a ``weight_version`` field:
the open transaction's target, else the fleet's version (a stock vLLM's client reads neither).

Access: every route is the admin token's (``Access.ADMIN``; the refit routes ``Access.OWNER`` on a fleet
of LoRA tenants, like ``/fleet/refit``); the LoRA routes stay ``ADMIN`` there, as ``/fleet/adapters/*``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from router.fleet.adapter_refit import AdapterRefits
from router.fleet.adapter_routes import AdapterRoutes
from router.fleet.control_answers import (
    field_missing,
    flag,
    json_answer,
    not_json,
    read_json,
    validation,
    vllm_error,
)
from router.fleet.control_lora import ControlLora
from router.fleet.control_session import ControlError, ControlSession
from router.fleet.engine import PAUSE_MODES, EngineClient, has
from router.fleet.ops import fan_out
from router.fleet.refit import RefitRefused
from router.fleet.refit_routes import INIT_TIMEOUT_S, PLAN_TIMEOUT_S
from router.http.auth import Access, Handler, RouteTable, account_of, holder_of
from router.http.headers import header_safe
from router.state.versions import VERSION_HEADER

PREFIX = "/control"
READS = ("/health", "/v1/models", "/server_info", "/is_paused", "/weight_info", "/get_world_size")
REFIT = (
    "/pause",
    "/resume",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/update_weight_version",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
)
LORA = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/load_lora_adapter")
RPC_METHODS = ("reload_weights",)
SUPPORTED = (
    f"GET {', '.join(READS)}; POST {', '.join(REFIT + LORA)} (collective_rpc: {', '.join(RPC_METHODS)})"
)
ROOT_SHARED = ("/health", "/v1/models")
"""Paths the generation URL serves at the root of the builtin router's origin (probes, Gym): kept there."""
UNSUPPORTED = tuple(
    "/abort_requests /inference/v1/abort_requests /shutdown_weight_transfer_engine /weight_checker "
    "/start_draft_weight_update /sleep /wake_up /is_sleeping /release_kv_cache_memory /reset_mm_cache "
    "/reset_encoder_cache /start_profile /stop_profile /scale_elastic_ep /is_scaling_elastic_ep "
    "/fault_tolerance/apply /fault_tolerance/status".split()
)
"""vLLM 0.32's other control routes (``rl/online``, ``serve/dev``, ``serve/profile``, ``serve/elastic_ep``,
``serve/fault_tolerance``, the abort of ``scale_out``): refused at the root as under ``PREFIX``."""
READ_TIMEOUT_S = 30.0


def _refused(exc: ControlError) -> web.Response:
    return vllm_error(exc.status, str(exc), exc.kind, exc.param)


class ControlApi:
    """The ``/control/*`` routes of one fleet (``router.fleet.api.FleetApi`` registers them)."""

    def __init__(self, session: ControlSession, adapters: Callable[[], AdapterRefits | None]) -> None:
        """``adapters``: the fleet's adapter transactions, asked per call (None: no LoRA on this fleet)."""
        self.session = session
        self.fleet = session.fleet
        self.adapters = adapters
        self.lora = ControlLora(adapters)

    def routes(self, base: Access = Access.ADMIN) -> list[tuple[str, str, Handler, Access]]:
        """Every control route, unprefixed: ``(method, path, handler, access)``; ``base``: the refit
        routes' mark (``Access.OWNER`` on a fleet of LoRA tenants)."""
        reads = (
            ("/health", self.health),
            ("/v1/models", self.models),
            ("/server_info", self.server_info),
            ("/is_paused", self.is_paused),
            ("/weight_info", self.weight_info),
            ("/get_world_size", self.world_size),
        )
        refit = (
            ("/pause", self.pause),
            ("/resume", self.resume),
            ("/collective_rpc", self.collective_rpc),
            ("/reset_prefix_cache", self.reset_prefix_cache),
            ("/update_weight_version", self.update_weight_version),
            ("/init_weight_transfer_engine", self.init_weight_transfer),
            ("/start_weight_update", self.start_weight_update),
            ("/update_weights", self.update_weights),
            ("/finish_weight_update", self.finish_weight_update),
        )
        lora = (
            ("/v1/load_lora_adapter", self.lora.load),
            ("/v1/unload_lora_adapter", self.lora.unload),
            ("/load_lora_adapter", self.lora.load_inplace),  # prime-rl's own route (its server's)
        )
        return [
            *(("GET", p, h, Access.ADMIN) for p, h in reads),
            *(("POST", p, h, base) for p, h in refit),
            *(("POST", p, h, Access.ADMIN) for p, h in lora),
        ]

    def add_routes(self, table: RouteTable, base: Access = Access.ADMIN) -> None:
        """The control routes twice: under ``PREFIX`` (with a catch-all refusal) and at the root of the
        URL's origin (``ROOT_SHARED`` excepted: ``add_root_reads``), which is where NeMo-RL's client sends
        them whatever path its ``control_base_url`` has. At the root, vLLM's other control paths
        (``UNSUPPORTED``) and the control paths' other methods get the same refusal; any other path
        stays the router's 404."""
        for method, path, handler, access in self.routes(base):
            table.add(method, PREFIX + path, self._versioned(handler), access)
            if path not in ROOT_SHARED:
                table.add(method, path, self._versioned(handler), access)
                table.add("*", path, self._versioned(self.unsupported), Access.ADMIN)
        table.add("*", PREFIX + "/{tail:.*}", self._versioned(self.unsupported), Access.ADMIN)
        for path in UNSUPPORTED:
            table.add("*", path, self._versioned(self.unsupported), Access.ADMIN)

    def add_root_reads(self, table: RouteTable) -> None:
        """``ROOT_SHARED`` at the root too, where nothing else serves them (the driver's fleet endpoint
        beside vllm-router / Ray Serve; on the builtin router they are the generation URL's own)."""
        for method, path, handler, access in self.routes():
            if path in ROOT_SHARED:
                table.add(method, path, self._versioned(handler), access)

    def _versioned(self, handler: Handler) -> Handler:
        """Every answer names the weights it concerns (``x-rl-weight-version``, as every generation does):
        the open transaction's target, else the fleet's version."""

        async def versioned(request: web.Request) -> web.StreamResponse:
            response = await handler(request)
            version = self.session.version()
            if version is not None:
                response.headers[VERSION_HEADER] = header_safe(version)
            return response

        return versioned

    def _with_version(self, payload: dict[str, Any], status: int = 200) -> web.Response:
        return json_answer(status, {**payload, "weight_version": self.session.version()})

    # -- reads ----------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        backends = self.fleet.backends
        serving = len(backends.serving)
        return self._with_version(
            {
                "status": "ok" if serving else "no healthy backend",
                "total_backends": len(backends.members),
                "healthy_backends": serving,
                "control_fanout": True,
                "transactional": True,
            },
            200 if serving else 409,
        )

    async def models(self, request: web.Request) -> web.Response:
        """A serving engine's ``/v1/models`` (a second one when the first fails), roots left out; on a
        fleet of LoRA tenants only the caller's own adapters (``AdapterRoutes.visible``'s rule)."""
        urls = sorted(self.fleet.backends.serving, key=self.fleet.backends.load.in_flight)[:2]
        why = "no engine is serving"
        async with EngineClient.open(self.fleet.engine_key, READ_TIMEOUT_S) as engines:
            for url in urls:
                answer = await engines.call(url, "GET", "/v1/models", check=has("data"))
                if answer.ok and isinstance(answer.body["data"], list):
                    listed = [m for m in answer.body["data"] if isinstance(m, dict)]
                    return json_answer(
                        200, {**answer.body, "data": self._visible(listed, account_of(request))}
                    )
                why = answer.detail or "/v1/models data is not a list"
        return vllm_error(500, f"the engines did not list their models: {why}", "InternalServerError")

    def _visible(self, listed: list[dict[str, Any]], caller: str) -> list[dict[str, Any]]:
        """The entries ``caller`` may see, without ``root``: on a fleet of LoRA tenants the adapter
        routes' rule (``AdapterRoutes.visible``: the base model and the caller's own served names)."""
        refits = self.adapters()
        if refits is not None:
            return AdapterRoutes(refits).visible(listed, caller)
        return [{k: v for k, v in entry.items() if k != "root"} for entry in listed]

    async def server_info(self, request: web.Request) -> web.Response:
        """A JSON object: a serving engine's ``vllm_config`` (``config_format`` as vLLM takes it) and the
        fleet's engines, served model and version. The engine's part is what ``Fleet.server_infos`` kept (an
        engine already read first): an engine's first answer takes seconds."""
        fmt = request.query.get("config_format", "text")
        if fmt not in ("text", "json"):
            return validation("query.config_format", "literal_error", "Input should be 'text' or 'json'", fmt)
        backends = self.fleet.backends
        urls = self.fleet.server_infos.read_first(list(backends.serving), fmt)
        info: dict[str, Any] = {}
        if urls:
            got = await self.fleet.server_infos.of(urls[0], fmt)
            if got.ok:
                info = dict(got.body)
        config = info.get("vllm_config")
        model = config.get("model_config", {}).get("served_model_name") if isinstance(config, dict) else None
        stale = backends.stale
        info["fleet"] = {
            "served_model": model,
            "total_backends": len(backends.members),
            "engines": [
                {"url": u, "serving": u in backends.serving, "stale": stale.get(u)} for u in backends.members
            ],
            "weight_version": self.fleet.current_version,
            "paused": self.session.paused(),
            "control_fanout": True,
        }
        return self._with_version(info)

    async def is_paused(self, request: web.Request) -> web.Response:
        return self._with_version({"is_paused": self.session.paused()})

    async def weight_info(self, request: web.Request) -> web.Response:
        return json_answer(200, {"weight_version": self.session.version()})

    async def world_size(self, request: web.Request) -> web.Response:
        """The serving engines' TP x PP ranks summed: a trainer makes its group ``1 +`` this, as it would
        for one vLLM, and that is the group the rank plan forms. ``include_dp`` is parsed as vLLM parses
        it but changes nothing: an engine's DP replicas are not members of the fleet's transfer group."""
        include_dp = flag(request.query.get("include_dp"), True)
        if include_dp is None:
            return validation(
                "query.include_dp",
                "bool_parsing",
                "Input should be a valid boolean, unable to interpret input",
                request.query.get("include_dp"),
            )
        urls = list(self.fleet.backends.serving)
        sizes = await fan_out(
            urls, lambda e, u: e.world_size(u), api_key=self.fleet.engine_key, timeout_s=PLAN_TIMEOUT_S
        )
        unread = [f"{s.url}: {s.error}" for s in sizes if s.value is None]
        if unread or not urls:
            why = "; ".join(unread) or "no engine is serving"
            return vllm_error(500, f"world size unreadable: {why}", "InternalServerError")
        return self._with_version({"world_size": sum(int(s.value or 0) for s in sizes)})

    # -- the refit -------------------------------------------------------------------------------------
    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return validation(
                "query.mode", "literal_error", "Input should be 'abort', 'wait' or 'keep'", mode
            )
        if flag(request.query.get("clear_cache"), True) is None:
            return validation(
                "query.clear_cache",
                "bool_parsing",
                "Input should be a valid boolean, unable to interpret input",
                request.query.get("clear_cache"),
            )
        try:
            txn = await self.session.pause(mode, holder_of(request))
        except ControlError as exc:
            return json_answer(exc.status, {"error": str(exc), "weight_version": self.session.version()})
        return self._with_version({"status": "paused", "refit": txn.id, "mode": mode})

    async def resume(self, request: web.Request) -> web.Response:
        try:
            txn, what = await self.session.resume()
        except ControlError as exc:
            return json_answer(exc.status, {"error": str(exc), "weight_version": self.session.version()})
        summary = None if txn is None else _summary(txn.to_json())
        return self._with_version({"status": "resumed", "refit": summary, "note": what})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        """vLLM's dev route, parsed as vLLM does; ``reload_weights`` alone is run (module doc)."""
        try:
            body = await read_json(request)
        except ValueError as exc:
            return vllm_error(400, f"JSON decode error: {exc}", "Bad Request")
        if not isinstance(body, dict):
            return vllm_error(400, "Request body must be a JSON object", "Bad Request")
        method = body.get("method")
        if method is None:
            return vllm_error(400, "Missing 'method' in request body", "Bad Request")
        if method not in RPC_METHODS:
            return vllm_error(
                400,
                f"collective_rpc method {method!r} is not run on this fleet's control URL: it supports "
                f"{', '.join(RPC_METHODS)} (as the fleet's refit transaction); nothing was sent to the "
                f"engines. Supported here: {SUPPORTED}",
                "BadRequestError",
                "method",
            )
        kwargs = body.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            return vllm_error(400, "kwargs must be an object", "BadRequestError", "kwargs")
        unknown = sorted(set(kwargs) - {"weights_path", "is_checkpoint_format"})
        if unknown or body.get("args"):
            return vllm_error(
                400,
                f"reload_weights takes kwargs.weights_path (a checkpoint directory) on this fleet; "
                f"got args={body.get('args')!r}, kwargs {unknown}",
                "BadRequestError",
                "kwargs",
            )
        path = kwargs.get("weights_path")
        if path is not None and not isinstance(path, str):
            return vllm_error(
                400, "kwargs.weights_path must be a string", "BadRequestError", "kwargs.weights_path"
            )
        try:
            txn = await self.session.reload(path, holder_of(request))
        except ControlError as exc:
            return _refused(exc)
        return self._with_version({"results": [None for _ in txn.live()], "refit": _summary(txn.to_json())})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        try:
            success = await self.session.reset_prefix_cache()
        except ControlError as exc:
            return _refused(exc)
        return self._with_version({"success": success})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
        except ValueError as exc:
            return not_json(exc)
        version = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(version, str):
            return field_missing("body.new_version", version, "string")
        if not version:  # vLLM takes "", a version nobody could ask for by name
            return validation(
                "body.new_version", "string_too_short", "String should have at least 1 character", ""
            )
        try:
            self.session.update_weight_version(version)
        except ControlError as exc:
            return _refused(exc)
        return self._with_version({"success": True, "new_version": version})

    # -- streamed weights ----------------------------------------------------------------------------
    async def init_weight_transfer(self, request: web.Request) -> web.Response:
        """``{"init_info": {...}}``: every serving engine joins the trainer's group at its own
        ``rank_offset`` in the fleet's ``world_size`` (the trainer's ``world_size``, if it gives one,
        must be that: it sized its group from ``/get_world_size``). Refused before anything is sent when
        an engine cannot join (``RefitRoutes``' plan: CPU engines, no ``--weight-transfer-config``)."""
        try:
            body = await read_json(request)
        except ValueError as exc:
            return not_json(exc)
        info = body.get("init_info") if isinstance(body, dict) else None
        if not isinstance(info, dict):
            return field_missing("body.init_info", info, "dictionary")
        routes, refit = self.session.routes, self.session.refit
        if (busy := refit.busy()) is not None and self.session.open is None:
            return vllm_error(409, busy, "Conflict")
        try:
            plan = await routes._plan()
        except RefitRefused as exc:
            return vllm_error(exc.status, str(exc), "Conflict")
        asked = info.get("world_size")
        if asked is not None and asked != plan["world_size"]:
            return vllm_error(
                400,
                f"init_info.world_size is {asked!r}, the fleet's group is {plan['world_size']} (the trainer "
                f"and {len(plan['engines'])} engines: GET /get_world_size answers their ranks); nothing was "
                "sent to the engines",
                "BadRequestError",
                "init_info.world_size",
            )
        offsets = {e["url"]: e["rank_offset"] for e in plan["engines"]}

        def init(e: EngineClient, u: str) -> Any:
            mine = {**info, "rank_offset": offsets[u], "world_size": plan["world_size"]}
            return e.init_weight_transfer(u, mine)

        report = await refit.run(self.fleet.fan("init_weight_transfer", list(offsets), init, INIT_TIMEOUT_S))
        if not report.ok:
            failed = {a.url: a.detail for a in report.failures()}
            return vllm_error(500, f"init_weight_transfer_engine failed on {failed}", "InternalServerError")
        routes.plan = plan
        return self._with_version({"message": "Weight transfer initialized", "plan": plan})

    async def start_weight_update(self, request: web.Request) -> web.Response:
        try:
            self.session.start_weight_update()
        except ControlError as exc:
            return _refused(exc)
        return self._with_version({"message": "Weight update started"})

    async def update_weights(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
        except ValueError as exc:
            return not_json(exc)
        if isinstance(body, dict) and "weight_dir" in body and "update_info" not in body:
            return await self._update_from_directory(request, body["weight_dir"])
        info = body.get("update_info") if isinstance(body, dict) else None
        if not isinstance(info, dict | list):
            return field_missing("body.update_info", info, "dictionary")
        try:
            txn = await self.session.update_weights(info)
        except ControlError as exc:
            return _refused(exc)
        return self._with_version({"message": "Weights updated", "refit": _summary(txn.to_json())})

    async def _update_from_directory(self, request: web.Request, weight_dir: Any) -> web.Response:
        """prime-rl's ``/update_weights {"weight_dir": DIR}`` (its server's route, beside vLLM's streamed
        one of the same path): the directory reload, as ``reload_weights``; answered as prime-rl's server
        answers, ``{"status": "ok"}``."""
        if not isinstance(weight_dir, str) or not weight_dir:
            return field_missing("body.weight_dir", weight_dir)
        try:
            await self.session.reload(weight_dir, holder_of(request))
        except ControlError as exc:
            return _refused(exc)
        return self._with_version({"status": "ok"})

    async def finish_weight_update(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
        except ValueError as exc:
            return not_json(exc)
        version = body.get("weight_version") if isinstance(body, dict) else None
        if version is not None and not isinstance(version, str):
            return validation("body.weight_version", "string_type", "Input should be a valid string", version)
        try:
            self.session.finish_weight_update(version)
        except ControlError as exc:
            return _refused(exc)
        return self._with_version({"message": "Weight update finished"})

    # -- the rest -------------------------------------------------------------------------------------
    async def unsupported(self, request: web.Request) -> web.Response:
        """Every other path or method under ``/control/``, and the root's (``add_routes``): refused here,
        never forwarded."""
        path = request.path
        if path == PREFIX or path.startswith(PREFIX + "/"):
            path = path[len(PREFIX) :] or "/"
        known = path in READS or path in REFIT or path in LORA
        message = (
            f"{request.method} {path} is not served by this fleet's control URL"
            + (" (wrong method)" if known else "")
            + f": it serves vLLM's control API as the fleet's refit transaction: {SUPPORTED}. "
            "Nothing was sent to the engines."
        )
        status = 405 if known else 404
        return vllm_error(status, message, "Method Not Allowed" if known else "Not Found")


def _summary(txn: dict[str, Any]) -> dict[str, Any]:
    """What a control answer says of the transaction (``GET /fleet/refit`` has the whole record)."""
    keys = ("id", "version", "phase", "canary", "verified", "quarantined", "error", "moved", "checksum")
    return {k: txn.get(k) for k in keys}
