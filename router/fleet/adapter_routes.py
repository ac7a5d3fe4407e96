"""The adapter admin routes: ``GET /fleet/adapters``, ``POST /fleet/adapters/load`` and ``/unload``.

``load``: ``{"adapter", "from", "version"?, "deadline_s"?, "allow_foreign_checkpoint"?}``, the whole
adapter refit (``router.fleet.adapter_refit``) in one call: 200 when the adapter moved to the new version
(engines that did not take it are listed in ``missing``, ``ok`` is then false); 500 when it did not (its
canary failed); 400 for a body that is not what is asked or a directory the check refused (no engine
was asked); 403 for an adapter another consumer owns; 409 when the plan has no room, a refit of it or
a full refit is running, or the version was used before. ``unload``: ``{"adapter"}``.

``GET /v1/models`` (a client route on a fleet with adapters; proxied to an engine on any other): the
engines' list as each caller may see it, the base model and the caller's own adapters' served names, and
no ``root``. The engines list every tenant's served names with their directories; proxied as it was,
that list told any client key which names to ask for, and where each tenant keeps its run.

Who may: the admin routes' check (``router.http.auth``) lets in the fleet's owner and the admin keys of
consumers it marked admin; here an admin consumer may change only its own adapters (the ones the
fleet's spec reserved for it, or that it created by loading them first), never another's.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from router.adapters.names import check_adapter_name, check_version, split_served
from router.adapters.table import AdapterForbidden
from router.consumers import OWNER
from router.fleet.adapter_check import AdapterRefused
from router.fleet.adapter_refit import DEFAULT_DEADLINE_S, AdapterRefits
from router.fleet.checkpoint import ALLOW_FOREIGN
from router.fleet.engine import EngineClient, has
from router.fleet.fleet import Fleet
from router.fleet.refit import RefitRefused
from router.http.auth import Access, RouteTable, account_of
from router.http.status import error_body

MAX_DEADLINE_S = 3600.0


def _json(status: int, payload: object) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


def _refused(status: int, message: str) -> web.Response:
    return _json(status, {"ok": False, "error": message})


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.Response(
        status=status, body=error_body(message, kind, status), content_type="application/json"
    )


def _refusal(exc: Exception) -> web.Response:
    """The answer to a call refused before anything was read or sent: 403 for another's adapter, the
    refusal's own status (409, 404), 400 for a body that is not what is asked."""
    if isinstance(exc, AdapterForbidden):
        return _refused(403, str(exc))
    if isinstance(exc, RefitRefused):
        return _refused(exc.status, str(exc))
    return _refused(400, str(exc))


MODELS_TIMEOUT_S = 30.0
REBUILD_WAIT_S = 60.0
"""How long a load or unload sent to a router that just started waits for its table to be rebuilt
(``router.fleet.adapter_rebuild``) before it is refused (409, retry)."""


class AdapterRoutes:
    def __init__(self, refits: AdapterRefits, no_healthy_status: int = 409) -> None:
        self.refits = refits
        self.no_healthy_status = no_healthy_status

    def add_routes(self, table: RouteTable) -> None:
        table.add(
            "GET", "/v1/models", self.models, Access.LISTING
        )  # a read: admin keys too (router.http.auth)
        table.add("GET", "/fleet/adapters", self.view, Access.ADMIN)
        table.add("POST", "/fleet/adapters/load", self.load, Access.ADMIN)
        table.add("POST", "/fleet/adapters/unload", self.unload, Access.ADMIN)

    async def view(self, request: web.Request) -> web.Response:
        return _json(200, self.state(account_of(request)))

    def state(self, caller: str = OWNER) -> dict[str, Any]:
        """The table and each adapter's refits; an admin consumer sees its own adapters only (another
        tenant's directories and versions are that tenant's business)."""
        refits = self.refits
        view = refits.table.to_json()
        active = {n: t.to_json() for n, t in refits.active.items()}
        last = {n: t.to_json() for n, t in refits.last.items()}
        if caller != OWNER:
            mine = {n for n in (*view["adapters"], *active, *last) if refits.table.owner_of(n) == caller}
            view["adapters"] = {n: a for n, a in view["adapters"].items() if n in mine}
            view["reserved"] = {n: c for n, c in view["reserved"].items() if c == caller}
            view["engines"] = {
                u: [s for s in names if s.rpartition("@")[0] in mine] for u, names in view["engines"].items()
            }
            active = {n: t for n, t in active.items() if n in mine}
            last = {n: t for n, t in last.items() if n in mine}
        return {**view, "active": active, "last": last}

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models`` for this caller (module doc): read from a serving engine (a second one when
        the first fails: a failed backend is a 500 after one retry elsewhere, as on proxied routes)."""
        caller = account_of(request)
        backends = self.refits.fleet.backends
        urls = sorted(backends.serving, key=backends.load.in_flight)[:2]
        if not urls:
            status = self.no_healthy_status
            return _error(status, "no healthy backend serves the fleet's models now", "no_healthy_backend")
        why = ""
        async with EngineClient.open(self.refits.fleet.engine_key, MODELS_TIMEOUT_S) as engines:
            for url in urls:
                answer = await engines.call(url, "GET", "/v1/models", check=has("data"))
                if answer.ok and isinstance(answer.body["data"], list):
                    listed = [m for m in answer.body["data"] if isinstance(m, dict)]
                    return _json(200, {**answer.body, "data": self.visible(listed, caller)})
                why = answer.detail or "/v1/models data is not a list"
        return _error(500, f"the engines did not list their models: {why}", "backend_error")

    def visible(self, listed: list[dict[str, Any]], caller: str) -> list[dict[str, Any]]:
        """The entries ``caller`` may see, without ``root``: every base model, and the served names
        whose owner is the caller (every one for the fleet's owner)."""
        table = self.refits.table
        out = []
        for entry in listed:
            name = entry.get("id")
            if not isinstance(name, str):
                continue
            if split_served(name) is not None:
                owner = table.owner_of_served(name)
                if owner is None or (caller != OWNER and owner != caller):
                    continue
            out.append({k: v for k, v in entry.items() if k != "root"})
        return out

    async def load(self, request: web.Request) -> web.Response:
        try:
            body = await Fleet.read_body(request)
            name = check_adapter_name(body.get("adapter"))
            path = body.get("from")
            if not isinstance(path, str) or not path:
                raise ValueError('body needs "from": the adapter directory to load')
            version = body.get("version")
            if version is not None:
                check_version(version)
            deadline_s = body.get("deadline_s", DEFAULT_DEADLINE_S)
            if isinstance(deadline_s, bool) or not isinstance(deadline_s, int | float):
                raise ValueError(f'"deadline_s" must be a number of seconds, got {deadline_s!r}')
            if not 0 < deadline_s <= MAX_DEADLINE_S:
                raise ValueError(f'"deadline_s" must be in (0, {MAX_DEADLINE_S:g}], got {deadline_s!r}')
            allow_foreign = body.get(ALLOW_FOREIGN, False)
            if not isinstance(allow_foreign, bool):
                raise ValueError(f'"{ALLOW_FOREIGN}" must be true or false, got {allow_foreign!r}')
            await self.refits.table.until_rebuilt(min(float(deadline_s), REBUILD_WAIT_S))
            txn = self.refits.begin(name, path, version, account_of(request), float(deadline_s))
        except (AdapterForbidden, ValueError) as exc:  # RefitRefused is a ValueError
            return _refusal(exc)
        try:
            checked = await self.refits.check(txn, allow_foreign)
        except AdapterRefused as exc:
            return _json(400, {"ok": False, "error": str(exc), **txn.to_json()} | {"ok": False})
        done = await self.refits.coordinator.run(self.refits.run(txn, checked))
        return _json(200 if done.moved else 500, done.to_json())

    async def unload(self, request: web.Request) -> web.Response:
        try:
            body = await Fleet.read_body(request)
            name = check_adapter_name(body.get("adapter"))
            await self.refits.table.until_rebuilt(REBUILD_WAIT_S)
            result = await self.refits.coordinator.run(self.refits.unload(name, account_of(request)))
        except (AdapterForbidden, ValueError) as exc:
            return _refusal(exc)
        return _json(200, {"ok": True, **result})
