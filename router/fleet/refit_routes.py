"""The refit transaction's admin routes (``/fleet/refit*``) and the weight-transfer set-up.

The set-up routes are ``/fleet/weight_transfer/*``.

One call per trainer step loads a checkpoint directory into every engine (``POST /fleet/refit``); a
trainer that streams its weights drives the same transaction in steps (``begin``, ``update`` once per
round, ``commit``; ``lease`` keeps it alive between them, ``abort`` gives up). Bad input is refused here,
before anything is paused: a version that is not a non-empty string, a directory that is missing,
unreadable, cut short, of another model or another user's (``router.fleet.checkpoint``, run off the
loop under its deadline; ``"allow_foreign_checkpoint": true`` loads another user's), a lease or
deadline that is not a positive number below its bound (``MAX_LEASE_S``, ``MAX_DEADLINE_S``). A
transaction that ran answers 200 when the fleet moved to the new version (engines quarantined on the
way are listed; ``ok`` is then false) and 500 when it did not; a refit from a directory also says what
its check read and compared (``checkpoint_check``).

The weight-transfer set-up checks every engine before anything is sent to it, because on vLLM 0.32 a
failed weight-transfer call can leave an engine without weights (``start_weight_update`` without a group
detaches them; the next generation step kills the engine core): an engine on the CPU with a backend that
needs GPUs (every backend vLLM ships; ``router.fleet.transfer_backends``) or one started without
``--weight-transfer-config`` is refused with the reason, and nothing is sent to any engine. The rank plan
gives the trainer rank 0 and each engine ``rank_offset`` = 1 + the TP x PP sizes of the engines before
it, in the serving set's order; the group's ``world_size`` is 1 + their sum.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from aiohttp import web

from router.fleet.checkpoint import ALLOW_FOREIGN, CheckpointGuard, CheckpointRefused
from router.fleet.engine import PAUSE_MODES, EngineClient
from router.fleet.fleet import Fleet, device_of
from router.fleet.ops import fan_out
from router.fleet.refit import DEFAULT_DEADLINE_S, DEFAULT_LEASE_S, SOURCES, RefitCoordinator, RefitRefused
from router.fleet.tensor_manifest import CheckedTensors, check_checkpoints
from router.fleet.transfer_backends import CPU_BACKENDS, runs_on_cpu
from router.http.auth import Access, RouteTable, holder_of
from router.state.backends import canonical_backend_url

log = logging.getLogger(__name__)

PLAN_TIMEOUT_S = 60.0
"""How long the set-up waits for each engine's ``/server_info`` (vLLM collects its environment once)."""
INIT_TIMEOUT_S = 600.0
"""How long ``init_weight_transfer_engine`` may take: the engines wait there for the trainer to join."""
MAX_LEASE_S = 300.0
"""The longest lease a trainer may ask for: a holder that dies (or is revoked) leaves the fleet paused
until its lease runs out, so the lease is short and renewed; 5 minutes covers any renewal gap."""
MAX_DEADLINE_S = 3600.0
"""The longest deadline of one refit: the largest model's reload takes minutes; an hour-long refit is a
fleet paused for nothing (``lease_s: 1e9`` was accepted, and held every consumer's requests)."""


def _json(status: int, payload: object) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


def _refused(exc: RefitRefused | CheckpointRefused | ValueError) -> web.Response:
    status = exc.status if isinstance(exc, RefitRefused) else 400
    return _json(status, {"ok": False, "error": str(exc)})


def _positive(body: dict[str, Any], key: str, default: float, maximum: float) -> float:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= maximum:
        raise ValueError(f'"{key}" must be a positive number of seconds, at most {maximum:g}, got {value!r}')
    return float(value)


def _text(body: dict[str, Any], key: str, required: bool = True) -> str | None:
    value = body.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f'body needs "{key}": a non-empty string')
    return value


def rank_plan(sizes: list[tuple[str, int]]) -> dict[str, Any]:
    """The trainer is rank 0; each engine's ranks follow the engines before it (``(url, TP x PP)`` in
    order); the group's world size is 1 + their sum."""
    engines, offset = [], 1
    for url, size in sizes:
        engines.append({"url": url, "world_size": size, "rank_offset": offset})
        offset += size
    return {"trainer_rank": 0, "world_size": offset, "engines": engines}


class RefitRoutes:
    def __init__(self, fleet: Fleet, coordinator: RefitCoordinator) -> None:
        self.fleet = fleet
        self.refit = coordinator
        self.plan: dict[str, Any] | None = None
        """The weight-transfer group the engines joined (``init``), or None."""

    def add_routes(self, table: RouteTable, access: Access = Access.ADMIN) -> None:
        """``access``: the transaction's routes' (``Access.OWNER`` on a fleet of LoRA tenants, where the
        base weights are the owner's: ``router.fleet.api.FleetApi.add_routes``); reading the state stays
        an admin route."""
        table.add("GET", "/fleet/refit", self.state, Access.ADMIN)
        for method, path, handler in (
            ("POST", "/fleet/refit", self.refit_from_directory),
            ("POST", "/fleet/refit/begin", self.begin),
            ("POST", "/fleet/refit/lease", self.lease),
            ("POST", "/fleet/refit/load", self.load),
            ("POST", "/fleet/refit/update", self.update),
            ("POST", "/fleet/refit/commit", self.commit),
            ("POST", "/fleet/refit/abort", self.abort),
            ("GET", "/fleet/weight_transfer/plan", self.transfer_plan),
            ("POST", "/fleet/weight_transfer/init", self.transfer_init),
        ):
            table.add(method, path, handler, access)

    # -- helpers ----------------------------------------------------------------------------------------
    async def _directories(self, body: dict[str, Any]) -> tuple[str, dict[str, str], CheckedTensors]:
        """``"from"`` and ``"from_by_engine"`` (``{engine url: directory}``, node-local copies), each
        checked (``router.fleet.checkpoint``: every file read in a thread under a deadline; its tensors,
        ``router.fleet.tensor_manifest``) against the served model, or ``CheckpointRefused`` /
        ``ValueError``: nothing is paused yet."""
        path = _text(body, "from", required=False)
        if path is None:
            raise CheckpointRefused('body needs "from": the checkpoint directory to load')
        raw = body.get("from_by_engine") or {}
        if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
            raise ValueError('"from_by_engine" must map engine URLs to directories')
        allow_foreign = body.get(ALLOW_FOREIGN, False)
        if not isinstance(allow_foreign, bool):
            raise ValueError(f'"{ALLOW_FOREIGN}" must be true or false, got {allow_foreign!r}')
        members = set(self.fleet.backends.members)
        per_engine = {}
        for url, where in raw.items():
            key = canonical_backend_url(url)
            if key not in members:
                raise ValueError(f'"from_by_engine": {url} is not an engine of the fleet')
            per_engine[key] = where
        last = self.refit.last
        last_path = last.path if last is not None and last.moved else None
        directories = [path, *per_engine.values()]
        served, checks = await self.fleet.served_root(), self.fleet.checks
        checked = await checks.run(check_checkpoints, directories, served, last_path, allow_foreign)
        log.info("refit from %s: %s", path, checked.summary())
        return path, per_engine, checked

    @property
    def checks(self) -> CheckpointGuard:
        """The fleet's checkpoint checks (``Fleet.checks``; ``router.server`` still reads them here)."""
        return self.fleet.checks

    async def served_root(self) -> str | None:
        """``Fleet.served_root`` (``router.server`` still reads it here)."""
        return await self.fleet.served_root()

    def _answer(self, txn_json: dict[str, Any], moved_or_open: bool) -> web.Response:
        return _json(200 if moved_or_open else 500, txn_json)

    # -- the one-call refit from a directory --------------------------------------------------------------
    async def refit_from_directory(self, request: web.Request) -> web.Response:
        """``{"version", "from", "from_by_engine"?, "expected_checksum"?, "deadline_s"?, "mode"?,
        "reset_cache"?}``: the whole transaction, run by the router (a trainer killed meanwhile does not
        stop it)."""
        try:
            body = await self.fleet.read_body(request)
            version = _text(body, "version")
            path, per_engine, checked = await self._directories(body)
            expected = _text(body, "expected_checksum", required=False)
            deadline_s = _positive(body, "deadline_s", DEFAULT_DEADLINE_S, MAX_DEADLINE_S)
            mode = self._mode(body)
            reset_cache = bool(body.get("reset_cache", True))
        except (ValueError, CheckpointRefused) as exc:
            return _refused(exc)
        assert version is not None

        async def whole() -> dict[str, Any]:
            txn = await self.refit.begin(
                version,
                "directory",
                mode,
                deadline_s=deadline_s,
                path=path,
                held_by_router=True,
                holder=holder_of(request),
            )
            await self.refit.load(txn.id, path, per_engine, expected, checked.records)
            if not txn.ended:  # a canary that failed ended it: the fleet stays on its version
                await self.refit.commit(txn.id, expected, reset_cache)
            return {**txn.to_json(), "checkpoint_check": checked.summary()}

        try:
            result = await self.refit.run(whole())
        except RefitRefused as exc:
            return _refused(exc)
        return self._answer(result, result["moved"])

    @staticmethod
    def _mode(body: dict[str, Any]) -> str:
        mode = body.get("mode", "keep")
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode={mode!r}: choose one of {', '.join(PAUSE_MODES)}")
        return str(mode)

    # -- the transaction in steps ---------------------------------------------------------------------
    async def state(self, request: web.Request) -> web.Response:
        active, last = self.refit.active, self.refit.last
        return _json(
            200,
            {
                "active": active.to_json() if active is not None else None,
                "last": last.to_json() if last is not None else None,
                "current": self.fleet.current_version,
                "known_versions": self.fleet.backends.versions.known(),
            },
        )

    async def begin(self, request: web.Request) -> web.Response:
        """``{"version", "source": "stream"|"external"|"directory", "lease_s"?, "deadline_s"?, "mode"?}``."""
        try:
            body = await self.fleet.read_body(request)
            version = _text(body, "version")
            source = body.get("source", "external")
            if source not in SOURCES:
                raise ValueError(f"source={source!r}: choose one of {', '.join(SOURCES)}")
            if source == "stream" and self.plan is None:
                raise RefitRefused(
                    "source 'stream' needs the engines in a weight-transfer group first "
                    "(POST /fleet/weight_transfer/init)",
                    409,
                )
            lease_s = _positive(body, "lease_s", DEFAULT_LEASE_S, MAX_LEASE_S)
            deadline_s = _positive(body, "deadline_s", DEFAULT_DEADLINE_S, MAX_DEADLINE_S)
            mode = self._mode(body)
        except (ValueError, RefitRefused) as exc:
            return _refused(exc)
        assert version is not None
        try:
            txn = await self.refit.run(
                self.refit.begin(
                    version,
                    str(source),
                    mode,
                    lease_s=lease_s,
                    deadline_s=deadline_s,
                    holder=holder_of(request),
                )
            )
        except RefitRefused as exc:
            return _refused(exc)
        return _json(200, txn.to_json())

    async def lease(self, request: web.Request) -> web.Response:
        try:
            body = await self.fleet.read_body(request)
            txn = self.refit.renew(str(_text(body, "id")))
        except (ValueError, RefitRefused) as exc:
            return _refused(exc)
        return _json(200, txn.to_json())

    async def load(self, request: web.Request) -> web.Response:
        try:
            body = await self.fleet.read_body(request)
            txn_id = str(_text(body, "id"))
            self.refit.find(txn_id)
            path, per_engine, checked = await self._directories(body)
            txn = await self.refit.run(self.refit.load(txn_id, path, per_engine, records=checked.records))
        except (ValueError, RefitRefused, CheckpointRefused) as exc:
            return _refused(exc)
        ok = bool(txn.live()) and not txn.ended  # ended: its canary failed
        return _json(200 if ok else 500, {**txn.to_json(), "checkpoint_check": checked.summary()})

    async def update(self, request: web.Request) -> web.Response:
        """``{"id", "update_info": {...}}``: one streamed round; the trainer broadcasts meanwhile."""
        try:
            body = await self.fleet.read_body(request)
            txn_id = str(_text(body, "id"))
            info = body.get("update_info")
            if not isinstance(info, dict):
                raise ValueError('body needs "update_info": the round\'s names, dtype_names and shapes')
            txn = self.refit.find(txn_id)
            if txn.source != "stream":
                raise RefitRefused(f"refit {txn_id} takes its weights from {txn.source!r}, not a stream", 409)
            group = {e["url"] for e in (self.plan or {}).get("engines", [])}
            txn = await self.refit.run(self.refit.receive(txn_id, info, group))
        except (ValueError, RefitRefused) as exc:
            return _refused(exc)
        return _json(200 if txn.live() else 500, txn.to_json())

    async def commit(self, request: web.Request) -> web.Response:
        try:
            body = await self.fleet.read_body(request)
            txn_id = str(_text(body, "id"))
            expected = _text(body, "expected_checksum", required=False)
            reset_cache = bool(body.get("reset_cache", True))
            txn = await self.refit.run(self.refit.commit(txn_id, expected, reset_cache))
        except (ValueError, RefitRefused) as exc:
            return _refused(exc)
        return self._answer(txn.to_json(), txn.moved)

    async def abort(self, request: web.Request) -> web.Response:
        try:
            body = await self.fleet.read_body(request)
            txn_id = _text(body, "id", required=False)
            why = str(body.get("why") or "aborted by the trainer")
            txn = await self.refit.run(self.refit.abort(txn_id, why))
        except (ValueError, RefitRefused) as exc:
            return _refused(exc)
        return _json(200, txn.to_json())

    # -- the weight-transfer group ------------------------------------------------------------------------
    async def _plan(self) -> dict[str, Any]:
        """The rank plan over the serving engines, or ``RefitRefused`` naming every engine that cannot
        join an NCCL group (nothing is sent to any engine then)."""
        urls = list(self.fleet.backends.serving)
        if not urls:
            raise RefitRefused("no engine is serving: no weight-transfer group to form", 409)
        key = self.fleet.engine_key
        infos = await fan_out(urls, lambda e, u: e.server_info(u), api_key=key, timeout_s=PLAN_TIMEOUT_S)
        sizes = await fan_out(urls, lambda e, u: e.world_size(u), api_key=key, timeout_s=PLAN_TIMEOUT_S)
        problems = []
        for info, size in zip(infos, sizes, strict=True):
            if info.value is None:
                problems.append(f"{info.url}: /server_info unreadable ({info.error})")
                continue
            device = device_of(info.value)
            if device == "cpu" and not runs_on_cpu(info.value):
                problems.append(
                    f"{info.url} runs on the CPU: NCCL weight transfer needs GPU engines "
                    f'(on CPUs use {CPU_BACKENDS[0]}, or POST /fleet/refit with "from")'
                )
            if not info.value.get("weight_transfer_config"):
                problems.append(
                    f"{info.url} was started without --weight-transfer-config (add "
                    '[--weight-transfer-config, \'{"backend": "nccl"}\'] to generation.vllm_args)'
                )
            if size.value is None:
                problems.append(f"{size.url}: /get_world_size unreadable ({size.error})")
        if problems:
            raise RefitRefused("weight transfer refused: " + "; ".join(problems), 409)
        return rank_plan([(size.url, int(size.value or 0)) for size in sizes])

    async def transfer_plan(self, request: web.Request) -> web.Response:
        try:
            plan = await self._plan()
        except RefitRefused as exc:
            return _refused(exc)
        return _json(200, plan)

    async def transfer_init(self, request: web.Request) -> web.Response:
        """``{"master_address", "master_port", "init_info"?}``: every serving engine joins the trainer's
        group at its rank offset (the trainer joins as rank 0 meanwhile); ``init_info`` passes the
        trainer's wire parameters (``packed``, buffer sizes) through."""
        try:
            body = await self.fleet.read_body(request)
            address = _text(body, "master_address")
            port = body.get("master_port")
            if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(f'"master_port" must be a port number, got {port!r}')
            extra = body.get("init_info") or {}
            if not isinstance(extra, dict):
                raise ValueError('"init_info" must be an object')
            if busy := self.refit.busy():
                raise RefitRefused(busy, 409)
            plan = await self._plan()
        except (ValueError, RefitRefused) as exc:
            return _refused(exc)
        offsets = {e["url"]: e["rank_offset"] for e in plan["engines"]}

        def init(e: EngineClient, u: str) -> Any:
            info = {
                **extra,
                "master_address": address,
                "master_port": port,
                "rank_offset": offsets[u],
                "world_size": plan["world_size"],
            }
            return e.init_weight_transfer(u, info)

        report = await self.refit.run(
            self.fleet.fan("init_weight_transfer", list(offsets), init, INIT_TIMEOUT_S)
        )
        report.result = plan
        if report.ok:
            self.plan = plan
        return _json(200 if report.ok else 500, report.to_json())
