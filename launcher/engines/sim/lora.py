"""vLLM 0.32's runtime LoRA adapters on the simulator: ``POST /v1/load_lora_adapter``,
``POST /v1/unload_lora_adapter``, adapters on ``/v1/models``, and requests naming an adapter as their model.

Why a model of vLLM's own behaviour, not a safer stand-in: the router's adapter table
(``router.adapters``) exists because vLLM protects little, and its tests must meet what a real fleet does.
Measured on vLLM 0.32 CPU (``--enable-lora --max-loras 2 --max-lora-rank 8 --max-cpu-loras 4``,
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``):

* Without ``--enable-lora`` or without the variable the two routes are not mounted (404).
* A load answers 200 ``Success: LoRA adapter 'NAME' added successfully.`` (plain text); the same name
  again 400 ``InvalidUserInput`` (unless ``load_inplace``); a directory that is not there 404
  ``Loading lora NAME failed: No adapter found for <path>``; a rank above ``--max-lora-rank`` and a
  garbage ``adapter_model.safetensors`` 500 ``Call to add_lora method failed: Worker failed with error
  '...'``. After any of these the engine serves on, the adapters it had included.
* ``--max-cpu-loras`` is no limit on names: six adapters registered with 4. vLLM keeps that many loaded
  (least recently used evicted) and reloads an evicted one from its directory on its next request; the
  simulator keeps the same order, and a request whose reload fails answers 500 with the loader's reason
  (that answer is modelled, not measured: the directory deleted under a registered adapter).
* An unload answers 200 ``Success: LoRA adapter 'NAME' removed successfully.``; an unknown name 404.
* A request whose ``model`` is a loaded adapter is served, answering ``"model": NAME``; its text is the
  adapter's (the digest of its files, as ``checkpoint`` derives the base weights' text), so two adapters,
  and an adapter and the base model, answer differently.

The adapter directory is PEFT's: ``adapter_config.json`` (``r``, and ``rank_pattern`` whose ranks count
too: the engine's slots must hold the largest) and ``adapter_model.safetensors``, whose header is checked
by the parser ``checkpoint`` uses (``adapter_model.bin`` is taken by its bytes, unparsed).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .checkpoint import SIM_CONFIG, CheckpointError, check_safetensors
from .config import SimConfig
from .core import SimCore, error_response, field_error, rpc_failure, sanitize_message, validation_error
from .protocol import ApiError
from .scheduler import ReqState, SimRequest

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
ADAPTER_CONFIG = "adapter_config.json"
TENSOR_FILES = ("adapter_model.safetensors", "adapter_model.bin")
"""What vLLM's LoRA loader reads, in its order of preference."""


class AdapterNotFound(Exception):
    """No adapter at the path (vLLM: a 404, "No adapter found for PATH")."""


class AdapterError(Exception):
    """The worker's load failed; ``str`` is its message (vLLM: a 500 through ``add_lora``)."""


@dataclass
class Adapter:
    name: str
    path: str
    digest: str
    rank: int
    int_id: int
    lm_head: bool = False
    """It adapts ``lm_head`` (``target_modules``): on vLLM 0.32's CPU build its delta leaks into requests
    of the base model (``SimLora.salt``)."""


def adapts_lm_head(config: Any) -> bool:
    targets = config.get("target_modules") if isinstance(config, dict) else None
    if isinstance(targets, str):
        return targets == "lm_head" or targets.endswith(".lm_head")
    return isinstance(targets, list) and any(t == "lm_head" or str(t).endswith(".lm_head") for t in targets)


def adapter_rank(config: Any) -> int:
    """The largest rank of a PEFT ``adapter_config.json``: ``r`` and every ``rank_pattern`` value."""
    if not isinstance(config, dict) or not isinstance(config.get("r"), int):
        raise AdapterError("PEFTHelper.__init__() missing 1 required positional argument: 'r'")
    pattern = config.get("rank_pattern") or {}
    ranks = [v for v in pattern.values() if isinstance(v, int)] if isinstance(pattern, dict) else []
    return max([config["r"], *ranks])


def _check_shapes(file: str) -> None:
    """Each ``lora_A`` must take, and each ``lora_B`` give, the model's width, as vLLM's worker requires
    when it stacks them into the layer (measured: a ``lora_A`` of 131 columns on a width-128 model is a
    500 "The size of tensor a (128) must match the size of tensor b (131) at non-singleton dimension 1",
    the engine up): an adapter of another base model, which no header check catches."""
    hidden = int(SIM_CONFIG["hidden_size"])
    with open(file, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(size))
    for name, info in header.items():
        shape = info.get("shape") if isinstance(info, dict) else None
        if not isinstance(shape, list) or len(shape) != 2:
            continue
        dim, got = (
            (1, shape[1]) if ".lora_A." in name else (0, shape[0]) if ".lora_B." in name else (0, hidden)
        )
        if got != hidden:
            raise AdapterError(
                f"The size of tensor a ({hidden}) must match the size of tensor b ({got}) at non-singleton "
                f"dimension {dim}"
            )


def read_adapter(path: str, max_rank: int) -> tuple[str, int, bool]:
    """Check an adapter directory as vLLM's worker loads it (its config, the rank against the engine's
    ``max_lora_rank``, then the tensors); returns (digest of its files, rank, whether it adapts
    ``lm_head``). Blocking: run in a thread."""
    where = os.path.expanduser(path)
    try:
        with open(os.path.join(where, ADAPTER_CONFIG), "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise AdapterNotFound(path) from None
    except OSError as e:
        raise AdapterError(str(e)) from None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise AdapterError(str(e)) from None
    rank = adapter_rank(config)
    if rank > max_rank:
        raise AdapterError(f"LoRA rank {rank} is greater than max_lora_rank {max_rank}.")
    tensors = next((f for f in TENSOR_FILES if os.path.isfile(os.path.join(where, f))), None)
    if tensors is None:
        raise AdapterError(f"{where} doesn't contain tensors")
    file = os.path.join(where, tensors)
    if tensors.endswith(".safetensors"):
        try:
            check_safetensors(file)
        except CheckpointError as e:
            raise AdapterError(str(e)) from None
        _check_shapes(file)
    digest = hashlib.sha256(raw + b"\0")
    with open(file, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest(), rank, adapts_lm_head(config)


def _text(body: str, status: int = 200) -> web.Response:
    return web.Response(text=body, status=status)


class SimLora:
    """One engine's adapters: the HTTP server's table (names, paths), the worker's loaded set in LRU
    order (at most ``max_cpu_loras``), and the requests in flight on each (the metrics' gauge)."""

    def __init__(self, config: SimConfig, core: Callable[[], SimCore]) -> None:
        self.config = config
        self._core = core  # the current core (a restart replaces it)
        self.adapters: dict[str, Adapter] = {}
        self._resident: OrderedDict[str, None] = OrderedDict()
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._next_id = 1
        self._in_flight: dict[str, tuple[str, SimRequest]] = {}

    @property
    def enabled(self) -> bool:
        return self.config.enable_lora

    @property
    def cpu_slots(self) -> int:
        return self.config.max_cpu_loras or self.config.max_loras

    def reset(self) -> None:
        """A restarted engine (``server._new_core``) has no adapter loaded, as a restarted vLLM."""
        self.adapters.clear()
        self._resident.clear()

    def add_routes(self, app: web.Application) -> None:
        """Mount the routes only where vLLM does: ``--enable-lora`` and the runtime variable."""
        if self.enabled and self.config.allow_runtime_lora_updating:
            app.router.add_post(LOAD_PATH, self.load)
            app.router.add_post(UNLOAD_PATH, self.unload)

    def register(self, registry: CollectorRegistry) -> None:
        if self.enabled:
            registry.register(_LoraCollector(self))

    # -- the engine side -------------------------------------------------------------------------------
    def names(self) -> tuple[str, ...]:
        return tuple(self.adapters)

    def _touch(self, name: str) -> None:
        self._resident[name] = None
        self._resident.move_to_end(name)
        while len(self._resident) > self.cpu_slots:
            self._resident.popitem(last=False)

    async def salt(self, model: str, base: int | None) -> int | None:
        """The output salt of a request naming ``model``: ``base`` for the base model; an adapter's mixes
        its digest in, after reloading it from its directory if it was evicted (``ApiError`` 500 with the
        loader's reason if that fails)."""
        adapter = self.adapters.get(model)
        if adapter is None:
            # What vLLM 0.32's CPU build does (measured): a request of the base model is computed with
            # the lm_head delta of the adapter in the last slot (punica_cpu reads the index -1 "no
            # adapter" as the last slot), so its answer is a tenant's, not the base model's. The
            # simulator takes the most recently loaded lm_head adapter as that slot's.
            leaking = [a for n in self._resident if (a := self.adapters.get(n)) is not None and a.lm_head]
            if model not in self.adapters and leaking:
                return int(leaking[-1].digest[:16], 16) ^ (base or 0)
            return base
        if model not in self._resident:
            try:
                rank = self.config.max_lora_rank
                adapter.digest, _, _ = await asyncio.to_thread(read_adapter, adapter.path, rank)
            except AdapterNotFound:
                why = f"Loading lora {model} failed: No adapter found for {adapter.path}"
                raise ApiError(500, sanitize_message(why), "InternalServerError") from None
            except AdapterError as e:
                raise ApiError(500, sanitize_message(str(e)), "InternalServerError") from None
        self._touch(model)
        return int(adapter.digest[:16], 16) ^ (base or 0)

    def track(self, model: str, req: SimRequest) -> None:
        if model in self.adapters:
            self._in_flight[req.rid] = (model, req)

    def untrack(self, req: SimRequest) -> None:
        self._in_flight.pop(req.rid, None)

    def cards(self, created: int) -> list[dict[str, Any]]:
        """The adapters' entries of ``/v1/models``, as vLLM lists them (``parent``: the base model)."""
        return [
            {
                "id": a.name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": a.path,
                "parent": self.config.model_name,
                "max_model_len": None,
                "permission": [],
            }
            for a in self.adapters.values()
        ]

    # -- the routes --------------------------------------------------------------------------------------
    async def _body(self, request: web.Request, fields: tuple[str, ...]) -> dict[str, Any] | web.Response:
        """FastAPI's validation of vLLM's request model: a JSON object with string ``fields``."""
        try:
            body = orjson.loads(await request.read() or b"null")
        except orjson.JSONDecodeError as e:
            bad = field_error("body", "json_invalid", "JSON decode error", {}, error=str(e))
            return validation_error([bad])
        if not isinstance(body, dict):
            what = "Input should be a valid dictionary or object to extract fields from"
            return validation_error([field_error("body", "model_attributes_type", what, body)])
        errors = [
            field_error(f"body.{f}", "missing", "Field required", body)
            if f not in body
            else field_error(f"body.{f}", "string_type", "Input should be a valid string", body[f])
            for f in fields
            if not isinstance(body.get(f), str)
        ]
        return validation_error(errors) if errors else body

    async def load(self, request: web.Request) -> web.Response:
        body = await self._body(request, ("lora_name", "lora_path"))
        if isinstance(body, web.Response):
            return body
        name, path, inplace = body["lora_name"], body["lora_path"], bool(body.get("load_inplace", False))
        async with self._locks[name]:
            if not name or not path:
                return error_response(
                    400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"
                )
            if name in self.adapters and not inplace:
                return error_response(
                    400,
                    f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                    "in place, set 'load_inplace' to True.",
                    "InvalidUserInput",
                )
            core = self._core()
            await core.wait_verdict()
            if not core.alive:
                return core.dead_response()
            try:
                digest, rank, lm_head = await asyncio.to_thread(read_adapter, path, self.config.max_lora_rank)
            except AdapterNotFound:
                message = f"Loading lora {name} failed: No adapter found for {path}"
                return error_response(404, message, "NotFoundError")
            except AdapterError as e:
                return rpc_failure("add_lora", str(e))
            old = self.adapters.get(name)
            int_id = old.int_id if old is not None else self._new_id()
            self.adapters[name] = Adapter(name, path, digest, rank, int_id, lm_head)
            self._touch(name)  # vLLM's add_lora loads it: the first request finds it in place
        return _text(f"Success: LoRA adapter '{name}' added successfully.")

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    async def unload(self, request: web.Request) -> web.Response:
        body = await self._body(request, ("lora_name",))
        if isinstance(body, web.Response):
            return body
        name = body["lora_name"]
        async with self._locks[name]:
            if not name:
                return error_response(
                    400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput"
                )
            if name not in self.adapters:
                return error_response(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
            del self.adapters[name]
            self._resident.pop(name, None)
        return _text(f"Success: LoRA adapter '{name}' removed successfully.")

    # -- metrics -------------------------------------------------------------------------------------------
    def running_waiting(self) -> tuple[list[str], list[str]]:
        running, waiting = set(), set()
        for name, req in self._in_flight.values():
            if req.state == ReqState.RUNNING:
                running.add(name)
            elif req.state == ReqState.WAITING:
                waiting.add(name)
        return sorted(running), sorted(waiting)


class _LoraCollector(Collector):
    """vLLM's ``vllm:lora_requests_info``: one sample, the scrape time, labelled with the adapters that
    have requests running and waiting, and ``--max-loras``."""

    def __init__(self, lora: SimLora) -> None:
        self.lora = lora

    def collect(self) -> Iterator[GaugeMetricFamily]:
        running, waiting = self.lora.running_waiting()
        g = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        g.add_metric([str(self.lora.config.max_loras), ",".join(waiting), ",".join(running)], time.time())
        yield g
