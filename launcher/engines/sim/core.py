"""The simulated engine core's life and death, and the error bodies vLLM 0.32's server answers with.

Why: what kills a vLLM engine during a refit is not the failing call but the next step. Measured on vLLM
0.32 CPU: a failed ``reload_weights`` (or a ``start_weight_update``) answers, and the engine keeps
answering (``/health`` 200), on weights left on the meta device; the first generation step then crashes
the worker, and ~1.4 s later that request answers 500 "EngineCore encountered an issue...". From then on
``/health`` answers 503 and every route that reaches the core answers that 500, while routes the HTTP
server answers alone (``/v1/models``, ``/server_info``, ``/get_world_size``, ``/tokenize``) still
answer 200. Then the HTTP server exits: right after it answered an ``EngineDeadError`` (uvicorn's next
tick; ~20 ms measured) or, if none was answered, at its watchdog (every 5 s); connections are refused
from then on. ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH`` (``SimConfig.keep_alive_on_engine_death``) keeps it up.

``SimCore`` holds that state machine; the server wires it to its scheduler (``step_gate``), its routes
(``dead_response``) and its exit (the ``kill`` fault, without revival).
"""

from __future__ import annotations

import asyncio
import enum
import re
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from .config import SimConfig

ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
EXIT_AFTER_ANSWER_S = 0.05
"""From the first ``EngineDeadError`` answered to the HTTP server's exit (uvicorn's ``should_exit``, seen
on its next tick). Wall-clock, not scaled by ``speed``: the answer must reach its client first."""
WATCHDOG_S = 5.0
"""vLLM's ``watchdog_loop`` period: the exit when no request answered the death (scaled by ``speed``)."""


class CoreState(enum.Enum):
    ALIVE = "alive"
    DYING = "dying"  # a step ran on detached weights: the worker crashed, the executor has not noticed
    DEAD = "dead"


def sanitize_message(message: str) -> str:
    """vLLM's ``sanitize_message``: error messages lose addresses, tracebacks and file paths."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


def error_response(status: int, message: str, err_type: str, param: str | None = None) -> web.Response:
    """vLLM's ``ErrorResponse`` body (message sanitized, as its exception handlers do)."""
    body = {"error": {"message": sanitize_message(message), "type": err_type, "param": param, "code": status}}
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def rpc_failure(method: str, worker_message: str) -> web.Response:
    """A worker method that raised, through the executor and the engine core, as vLLM answers it."""
    return error_response(
        500,
        f"Call to {method} method failed: Worker failed with error '{worker_message}', "
        "please check the stack trace above for the root cause",
        "InternalServerError",
    )


def bad_request(message: str) -> web.Response:
    """An ``HTTPException(400)`` of a vLLM route."""
    return error_response(400, message, "Bad Request")


def validation_error(errors: list[dict[str, Any]]) -> web.Response:
    """FastAPI's ``RequestValidationError`` as vLLM renders it: 400, one line per pydantic error."""
    label = "error" if len(errors) == 1 else "errors"
    lines = "".join(f"  {_error_line(e)}\n" for e in errors)
    message = f"{len(errors)} validation {label}:\n{lines}".rstrip()
    return error_response(400, message, "Bad Request", errors[0]["loc"])


def _error_line(err: dict[str, Any]) -> str:
    value = err.get("input")
    if isinstance(value, (list, tuple, dict)):
        shown: Any = f"<{type(value).__name__} of {len(value)} items>"
    else:
        shown = str(value)[:200]
    return str({**err, "input": shown})


def field_error(loc: str, kind: str, msg: str, value: Any, **ctx: Any) -> dict[str, Any]:
    err: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": value}
    if ctx:
        err["ctx"] = ctx
    return err


class SimCore:
    """One engine core's state. ``on_dead`` runs once when it dies (abort everything), ``on_exit`` when
    the HTTP server would exit after it (unless ``keep_alive_on_engine_death``)."""

    def __init__(
        self,
        config: SimConfig,
        detached: Callable[[], bool],
        on_dead: Callable[[], None],
        on_exit: Callable[[], Any],
    ) -> None:
        self.config = config
        self._detached = detached
        self._on_dead = on_dead
        self._on_exit = on_exit
        self.state = CoreState.ALIVE
        self._dead = asyncio.Event()
        self._exiting = False
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def alive(self) -> bool:
        return self.state == CoreState.ALIVE

    def step_gate(self) -> bool:
        """Called by the scheduler before each step: ``False`` (and the core starts dying) when the step
        would run on detached weights."""
        if self.state != CoreState.ALIVE:
            return False
        if not self._detached():
            return True
        self.state = CoreState.DYING
        self._spawn(self._die())
        return False

    async def wait_verdict(self) -> None:
        """Return once the core is alive or dead (a call reaching a dying core waits for its death)."""
        if self.state == CoreState.DYING:
            await self._dead.wait()

    def dead_response(self) -> web.Response:
        """vLLM's answer to a call reaching a dead core (``EngineDeadError``); it makes the server exit."""
        self.answered_dead()
        return error_response(500, ENGINE_DEAD, "InternalServerError")

    def answered_dead(self) -> None:
        if not self.config.keep_alive_on_engine_death:
            self._spawn(self._exit_after(EXIT_AFTER_ANSWER_S))

    @property
    def exiting(self) -> bool:
        return self._exiting

    async def _die(self) -> None:
        await asyncio.sleep(self.config.scaled(self.config.engine_death_s))
        self.state = CoreState.DEAD
        self._dead.set()
        self._on_dead()
        if not self.config.keep_alive_on_engine_death:
            await self._exit_after(self.config.scaled(WATCHDOG_S))

    async def _exit_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        if self._exiting:
            return
        self._exiting = True
        result = self._on_exit()
        if asyncio.iscoroutine(result):
            await result

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro, name="sim-core")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel(self) -> None:
        """Forget pending deaths and exits (the engine is stopped or restarted)."""
        for t in list(self._tasks):
            if t is not asyncio.current_task():
                t.cancel()
