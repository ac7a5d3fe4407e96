"""The control URL's LoRA routes: vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` as the
fleet's adapter transaction (``router.fleet.adapter_refit``), under the tenant rules.

A trainer written for one vLLM (SkyRL, prime-rl's multi-run LoRA) loads an adapter with one call; sent
to every engine of a fleet as it comes, a broken adapter directory fails on every engine at once and a
tenant could load over another's adapter. Here each load is the adapter transaction: the directory
checked before any engine reads it, a canary, every engine, verify, stamp (a new version of
``lora_name``, served as ``NAME@VERSION``), the old version drained; ``AdapterTable.may_change``
decides who may (an admin consumer changes only its own adapters: 403 otherwise). Bodies, statuses and
answers are vLLM's: 200 with its text ("Success: LoRA adapter 'x' added successfully."), 400
``InvalidUserInput`` for a name already loaded without ``load_inplace`` (vLLM's own rule), 404
``NotFoundError`` for an unload of a name not loaded, 500 when the canary failed (the adapter stays on
its version). The served name loaded (``NAME@VERSION``) is in the ``x-rl-adapter-served-name`` header
(the body is vLLM's text). prime-rl's own ``/load_lora_adapter`` is served too (always in place).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from router.adapters.names import check_adapter_name
from router.adapters.table import AdapterForbidden
from router.fleet.adapter_check import AdapterRefused
from router.fleet.adapter_refit import DEFAULT_DEADLINE_S, AdapterRefits
from router.fleet.control_answers import field_missing, not_json, read_json, validation, vllm_error
from router.fleet.refit import RefitRefused
from router.http.auth import account_of

ADAPTER_HEADER = "x-rl-adapter-served-name"
"""The served name (``NAME@VERSION``) a load made current: the body is vLLM's text."""
REBUILD_WAIT_S = 60.0
"""How long a load sent to a router that just started waits for its adapter table's rebuild."""


class _NoLora(Exception):
    pass


class ControlLora:
    def __init__(self, adapters: Callable[[], AdapterRefits | None]) -> None:
        """``adapters``: the fleet's adapter transactions, asked per call (None: no LoRA on this fleet)."""
        self.adapters = adapters

    async def _body(self, request: web.Request, fields: tuple[str, ...]) -> dict[str, Any] | web.Response:
        try:
            body = await read_json(request)
        except ValueError as exc:
            return not_json(exc)
        if not isinstance(body, dict):
            return validation("body", "model_attributes_type", "Input should be a valid dictionary", body)
        for field in fields:
            if not isinstance(body.get(field), str):
                return field_missing(f"body.{field}", body.get(field))
        return body

    def _refits(self) -> AdapterRefits | None:
        return self.adapters()

    @staticmethod
    def _not_mounted() -> web.Response:
        return vllm_error(
            404,
            "this fleet serves no LoRA adapters (generation.lora is not set): the LoRA routes are not "
            "mounted, as on a vLLM started without VLLM_ALLOW_RUNTIME_LORA_UPDATING",
            "Not Found",
        )

    async def load(self, request: web.Request) -> web.Response:
        """``{"lora_name", "lora_path", "load_inplace"?}``: a new version of ``lora_name`` (module doc)."""
        return await self._load(request, inplace=False)

    async def load_inplace(self, request: web.Request) -> web.Response:
        """prime-rl's ``/load_lora_adapter`` (its server's route): vLLM's, always ``load_inplace``."""
        return await self._load(request, inplace=True)

    async def _load(self, request: web.Request, inplace: bool) -> web.Response:
        body = await self._body(request, ("lora_name", "lora_path"))
        if isinstance(body, web.Response):
            return body
        refits = self._refits()
        if refits is None:
            return self._not_mounted()
        name, path = body["lora_name"], body["lora_path"]
        try:
            check_adapter_name(name)
            await refits.table.until_rebuilt(REBUILD_WAIT_S)
            if name in refits.table.adapters and not (inplace or body.get("load_inplace")):
                return vllm_error(
                    400,
                    f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                    "in place, set 'load_inplace' to True.",
                    "InvalidUserInput",
                )
            txn = refits.begin(name, path, None, account_of(request), DEFAULT_DEADLINE_S)
        except AdapterForbidden as exc:
            return vllm_error(403, str(exc), "Forbidden")
        except RefitRefused as exc:
            return vllm_error(exc.status, str(exc), "Conflict")
        except ValueError as exc:
            return vllm_error(400, str(exc), "InvalidUserInput", "lora_name")
        try:
            checked = await refits.check(txn)
        except AdapterRefused as exc:
            return vllm_error(400, str(exc), "InvalidUserInput", "lora_path")
        done = await refits.coordinator.run(refits.run(txn, checked))
        if not done.moved:
            return vllm_error(500, done.error or "the adapter did not load", "InternalServerError")
        text = f"Success: LoRA adapter '{name}' added successfully."
        return web.Response(status=200, text=text, headers={ADAPTER_HEADER: done.served})

    async def unload(self, request: web.Request) -> web.Response:
        body = await self._body(request, ("lora_name",))
        if isinstance(body, web.Response):
            return body
        refits = self._refits()
        if refits is None:
            return self._not_mounted()
        name = body["lora_name"]
        try:
            await refits.table.until_rebuilt(REBUILD_WAIT_S)
            await refits.coordinator.run(refits.unload(name, account_of(request)))
        except AdapterForbidden as exc:
            return vllm_error(403, str(exc), "Forbidden")
        except RefitRefused as exc:
            if exc.status == 404:
                return vllm_error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
            return vllm_error(exc.status, str(exc), "Conflict")
        except ValueError as exc:
            return vllm_error(400, str(exc), "InvalidUserInput", "lora_name")
        return web.Response(status=200, text=f"Success: LoRA adapter '{name}' removed successfully.")
