"""vLLM 0.32's RL routes (``VLLM_SERVER_DEV_MODE=1``) on the simulator, with the same semantics.

A test of the refit window (pause, abort, version stamp, checksum, resume) against simulated fleets
proves something only if the simulator answers those routes as vLLM does
(``vllm/entrypoints/rl/online/api_router.py``): same paths, query and body fields, same answer keys.

``/weight_checker``: the simulator has no weights; its "weights" are the model name and
``SimConfig.weights_tag`` (the CLI's ``--weights-tag``), so two engines started with different tags
disagree on their checksums the way two vLLM engines loaded from different checkpoints do. A version
stamp does not change them (it is a label, as in vLLM).
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
from aiohttp import web

from .scheduler import Scheduler

PAUSE_MODES = ("abort", "wait", "keep")
SIM_PARAMETERS = ("model.embed_tokens.weight", "model.layers.0.weight", "lm_head.weight")


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


class SimRl:
    def __init__(self, scheduler: Scheduler, model_name: str, weights_tag: str = "") -> None:
        self.scheduler = scheduler
        self.model_name = model_name
        self.weights_tag = weights_tag
        self.weight_version = "default"  # vLLM's EngineCore starts with "default"

    def add_routes(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/pause", self.pause)
        r.add_post("/resume", self.resume)
        r.add_get("/is_paused", self.is_paused)
        r.add_post("/abort_requests", self.abort_requests)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_get("/weight_info", self.weight_info)
        r.add_post("/weight_checker", self.weight_checker)

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return _json({"detail": f"mode must be one of {PAUSE_MODES}"}, 422)
        await self.scheduler.pause_generation(mode)
        return _json({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self.scheduler.resume_generation()
        return _json({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
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
        ids = body.get("request_ids") or []
        n = self.scheduler.abort_ids([str(i) for i in ids])
        return _json({"status": "aborted", "aborted": len(ids) if ids else n})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        version = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(version, str):
            return _json({"detail": "new_version (string) is required"}, 422)
        self.weight_version = version
        return _json({"success": True, "new_version": version})

    async def weight_info(self, request: web.Request) -> web.Response:
        return _json({"weight_version": self.weight_version})

    def checksums(self) -> dict[str, str]:
        return {
            p: hashlib.sha256(f"{self.model_name}/{self.weights_tag}/{p}".encode()).hexdigest()[:16]
            for p in SIM_PARAMETERS
        }

    async def weight_checker(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        action = body.get("action") if isinstance(body, dict) else None
        if action == "reset":
            return _json({"status": "reset"})
        if action not in ("checksum", "compare"):
            return _json({"detail": "action must be checksum, reset or compare"}, 422)
        checksums = self.checksums()
        if action == "checksum":
            return _json({"checksums": checksums})
        baseline = body.get("baseline")
        if not isinstance(baseline, dict):
            return _json({"detail": "action='compare' requires a 'baseline' object"}, 400)
        mismatches = sorted(
            k for k in checksums.keys() | baseline.keys() if checksums.get(k) != baseline.get(k)
        )
        return _json({"match": not mismatches, "mismatches": mismatches})
