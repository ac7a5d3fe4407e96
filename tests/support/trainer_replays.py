"""Each trainer's own control calls, replayed over plain HTTP against a URL that answers vLLM's API.

Why a replay and not the trainers: NeMo-RL, prime-rl and TRL cannot run here (Megatron, NCCL, GPUs), but
what reaches a vLLM server they do not own is a short, fixed sequence of HTTP calls. A test that sends
exactly those calls (method, path, query string, JSON body, headers, what status makes the client raise)
shows what that trainer meets on rl-launch's control URL, unmodified. Each replay follows the trainer's
source as docs/trainer-calls.md records it (repo, path and commit for each call); where the
replay departs from the trainer it says so below.

* ``NemoRlRemoteVllm``: NeMo-RL's ``remote_vllm`` backend (``client.py``, ``preflight.py``, the checkpoint
  weight synchronizer). Its client resolves every path against the *origin* of its URL (``service_url``:
  the URL's own path is dropped): on rl-launch its default paths land on the control routes at the
  router's root (the control URL is the fleet URL's origin); ``control_paths`` gives the ``/control``
  ones the router also serves. One Bearer (``api_key_env_var``) goes to the generation and the control
  URL alike. Refit:
  ``/pause?mode=<inflight_policy>&clear_cache=true``, ``/collective_rpc reload_weights``, ``/resume``;
  any status >= 400 raises and nothing after it is sent (a failed reload is never followed by a
  resume). ``/reset_prefix_cache`` is its own call, sent after the resume and only by the async GRPO
  loop (``invalidate_kv_cache``).
* ``prime_rl_update_weights``: prime-rl's orchestrator client: ``/pause?mode=keep&clear_cache=false``, an
  empty ``NCCL_READY`` file written into the checkpoint directory, ``/update_weights {"weight_dir": DIR}``
  (prime-rl's own server route), and ``/resume`` in a ``finally``; every call is retried on 5xx and on
  no answer (up to 10 attempts, waits 1, 2, 4, 8, 10... s), never on 4xx.
* ``TrlAsyncGrpo``: TRL 1.16's ``AsyncGRPOTrainer`` (``VLLMClient`` + ``WeightTransferClient``): once
  ``/health``, ``/server_info?config_format=json`` (the served dtype), ``/get_world_size`` and
  ``/init_weight_transfer_engine``; each sync ``/pause?mode=keep``, ``/start_weight_update``,
  ``/update_weights {"update_info": ...}``, ``/finish_weight_update``, ``/resume``. The NCCL broadcast that
  runs beside ``/update_weights`` is not replayed (no NCCL on CPU). TRL sends no ``Authorization`` header;
  ``api_key`` exists only so a test can get past a closed URL and says so where it does.

Run as a program (``python -m tests.support.trainer_replays nemo-rl-hold ...``) it is a trainer that
pauses the fleet through NeMo-RL's calls and then waits to be killed, with its key read from the
environment variable ``--key-env`` names (never argv).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

VERSION_HEADER = "x-rl-weight-version"


@dataclass
class Call:
    """One request as sent and its answer: the body parsed as JSON when it is JSON, else its text."""

    method: str
    url: str
    body: Any
    status: int | None
    answer: Any
    version: str | None
    seconds: float

    @property
    def fleet_version(self) -> str | None:
        """The weight version the answer names: rl-launch's version header, else a ``weight_version``
        field of its JSON (a stock vLLM names neither on these routes)."""
        if self.version:
            return self.version
        named = self.answer.get("weight_version") if isinstance(self.answer, dict) else None
        return named if isinstance(named, str) and named else None

    def brief(self) -> str:
        path = urlsplit(self.url).path + (f"?{urlsplit(self.url).query}" if urlsplit(self.url).query else "")
        return f"{self.method} {path} -> {self.status} {json.dumps(self.answer)[:200]}"


class ReplayError(RuntimeError):
    """The trainer's client would raise here: the call's status (None: no answer) and answer."""

    def __init__(self, call: Call) -> None:
        super().__init__(f"{call.method} {call.url}: HTTP {call.status}: {json.dumps(call.answer)[:400]}")
        self.call = call


@dataclass
class Transport:
    """urllib, as NeMo-RL's client (and the same bytes as ``requests``/``httpx`` send): every call is
    kept in ``calls``, in order, so a test can read the whole sequence and its answers."""

    api_key: str | None = None
    calls: list[Call] = field(default_factory=list)

    def send(
        self,
        method: str,
        url: str,
        *,
        query: dict[str, str] | None = None,
        body: Any = None,
        timeout_s: float = 600.0,
        raise_on_error: bool = True,
    ) -> Call:
        if query:
            url = f"{url}?{urllib.parse.urlencode(query)}"
        headers = {"Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        t0 = time.perf_counter()
        status: int | None
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                status, raw, version = resp.status, resp.read(), resp.headers.get(VERSION_HEADER)
        except urllib.error.HTTPError as exc:
            status, raw, version = exc.code, exc.read(), exc.headers.get(VERSION_HEADER)
        except (urllib.error.URLError, OSError) as exc:
            status, raw, version = None, str(getattr(exc, "reason", exc)).encode(), None
        try:
            answer: Any = json.loads(raw) if raw else None
        except ValueError:
            answer = raw.decode("utf-8", errors="replace")
        call = Call(method, url, body, status, answer, version, time.perf_counter() - t0)
        self.calls.append(call)
        if raise_on_error and (status is None or status >= 400):
            raise ReplayError(call)
        return call


# ----------------------------------------------------------------------------------------------------
# NeMo-RL remote_vllm
# ----------------------------------------------------------------------------------------------------
NEMO_RL_PATHS = {
    "health_path": "/health",
    "models_path": "/v1/models",
    "server_info_path": "/server_info",
    "pause_path": "/pause",
    "resume_path": "/resume",
    "collective_rpc_path": "/collective_rpc",
    "reset_prefix_cache_path": "/reset_prefix_cache",
}
"""``RemoteVllmServiceConfig``'s path settings and their defaults."""


def control_paths(prefix: str = "/control") -> dict[str, str]:
    """NeMo-RL's path settings with every path under ``prefix``: the router's ``/control`` mount of the
    same API (``health_path`` is shared by the generation and the control URL, so both checks then read
    the control ``/health``); its defaults (``prefix`` empty) are what docs/trainers.md sets."""
    return {k: prefix + v for k, v in NEMO_RL_PATHS.items()}


def service_url(base_url: str, absolute_path: str) -> str:
    """NeMo-RL's ``service_url``: ``absolute_path`` on the origin of ``base_url`` (its path dropped)."""
    parsed = urlsplit(base_url)
    return urlunsplit((parsed.scheme, parsed.netloc, absolute_path, "", ""))


@dataclass
class NemoRlRemoteVllm:
    """NeMo-RL's ``remote_vllm_cfg`` and the calls its client makes with it."""

    base_url: str
    served_model_name: str
    api_key: str | None
    control_base_url: str | None = None
    paths: dict[str, str] = field(default_factory=lambda: dict(NEMO_RL_PATHS))
    inflight_policy: str = "keep"
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    refit_timeout_s: float = 1800.0
    transport: Transport = field(default_factory=Transport)

    def __post_init__(self) -> None:
        self.transport.api_key = self.api_key

    def _url(self, name: str, control: bool) -> str:
        base = (self.control_base_url or self.base_url) if control else self.base_url
        return service_url(base, self.paths[name])

    def _json_object(self, call: Call, what: str) -> dict[str, Any]:
        if not isinstance(call.answer, dict):
            raise RuntimeError(f"External vLLM returned a non-object from {call.url} ({what})")
        return call.answer

    def preflight(self) -> dict[str, Any]:
        """``preflight_remote_vllm_service``: health of both URLs, the fan-out check, the model listed on
        the generation URL, ``/server_info`` an object on the control URL; returns ``/server_info``."""
        t = self.transport
        health = t.send("GET", self._url("health_path", False), timeout_s=self.connect_timeout_s)
        if self.control_base_url is not None:
            health = t.send("GET", self._url("health_path", True), timeout_s=self.connect_timeout_s)
        control_health = health.answer if isinstance(health.answer, dict) else None
        if control_health is not None and isinstance(control_health.get("total_backends"), int):
            total = control_health["total_backends"]
            if total != 1 and control_health.get("control_fanout") is not True:
                raise RuntimeError(
                    "External vLLM refit requires exactly one engine deployment behind the configured URL; "
                    f"the load balancer reports {total} independent backends. Add control-plane fan-out "
                    "before using multiple replicas."
                )
        models = t.send("GET", self._url("models_path", False), timeout_s=self.connect_timeout_s)
        entries = self._json_object(models, "models").get("data")
        if not isinstance(entries, list):
            raise RuntimeError("External vLLM /v1/models response has no data list")
        ids = {e.get("id") for e in entries if isinstance(e, dict) and isinstance(e.get("id"), str)}
        if self.served_model_name not in ids:
            raise RuntimeError(
                f"External vLLM model mismatch: controller expects {self.served_model_name!r}, "
                f"service reports {sorted(ids)!r}"
            )
        info = t.send("GET", self._url("server_info_path", True), timeout_s=self.connect_timeout_s)
        return self._json_object(info, "server_info")

    def pause(self) -> Call:
        query = {"mode": self.inflight_policy, "clear_cache": "true"}  # pause_generation_for_refit(True)
        return self.transport.send(
            "POST", self._url("pause_path", True), query=query, timeout_s=self.request_timeout_s
        )

    def reload_weights(self, weights_path: str | Path) -> Call:
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(weights_path)}}
        return self.transport.send(
            "POST", self._url("collective_rpc_path", True), body=body, timeout_s=self.refit_timeout_s
        )

    def resume(self) -> Call:
        return self.transport.send("POST", self._url("resume_path", True), timeout_s=self.request_timeout_s)

    def invalidate_kv_cache(self) -> Call:
        return self.transport.send(
            "POST", self._url("reset_prefix_cache_path", True), timeout_s=self.request_timeout_s
        )

    def refit(self, weights_path: str | Path) -> list[Call]:
        """``RemoteVllmCheckpointWeightSynchronizer.sync_weights`` after its export: pause, reload,
        resume; the first error raises ``ReplayError`` and nothing after it is sent."""
        return [self.pause(), self.reload_weights(weights_path), self.resume()]


def nemo_rl_version_dir(checkpoint_dir: Path, version: int) -> Path:
    """Where NeMo-RL publishes export ``version`` (``version_%08d`` under ``refit.checkpoint_dir``)."""
    return checkpoint_dir / f"version_{version:08d}"


# ----------------------------------------------------------------------------------------------------
# prime-rl
# ----------------------------------------------------------------------------------------------------
PRIME_RL_ATTEMPTS = 10
PRIME_RL_TIMEOUT_S = 300.0
PRIME_RL_UPDATE_TIMEOUT_S = 720.0


def _prime_rl_post(transport: Transport, url: str, attempts: int, timeout_s: float, **kw: Any) -> Call:
    """``_admin_post``: retried on 5xx and on no answer (tenacity, exponential wait 1..10 s), not 4xx."""
    deadline = time.monotonic() + 2 * timeout_s
    for attempt in range(1, attempts + 1):
        call = transport.send("POST", url, timeout_s=timeout_s, raise_on_error=False, **kw)
        retryable = call.status is None or call.status >= 500
        if call.status is not None and call.status < 400:
            return call
        if not retryable or attempt == attempts or time.monotonic() >= deadline:
            raise ReplayError(call)
        time.sleep(min(10.0, 2.0 ** (attempt - 1)))
    raise AssertionError("unreachable")


def prime_rl_update_weights(
    admin_url: str,
    weight_dir: str | Path,
    api_key: str | None,
    attempts: int = PRIME_RL_ATTEMPTS,
    transport: Transport | None = None,
) -> list[Call]:
    """prime-rl's ``update_weights`` for one admin URL (its ``base_url`` minus ``/v1``, path kept)."""
    t = transport or Transport()
    t.api_key = api_key
    base = admin_url.rstrip("/").removesuffix("/v1")
    query = {"mode": "keep", "clear_cache": "false"}
    first = len(t.calls)
    _prime_rl_post(t, base + "/pause", attempts, PRIME_RL_TIMEOUT_S, query=query)
    try:
        marker = Path(weight_dir) / "NCCL_READY"
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        body = {"weight_dir": Path(weight_dir).as_posix()}
        _prime_rl_post(t, base + "/update_weights", attempts, PRIME_RL_UPDATE_TIMEOUT_S, body=body)
    finally:
        _prime_rl_post(t, base + "/resume", attempts, PRIME_RL_TIMEOUT_S)
    return t.calls[first:]


# ----------------------------------------------------------------------------------------------------
# TRL 1.16 AsyncGRPOTrainer
# ----------------------------------------------------------------------------------------------------
@dataclass
class TrlAsyncGrpo:
    """TRL's ``VLLMClient`` as ``WeightTransferClient`` drives it; ``server_url`` is used as given
    (a path prefix is kept). ``api_key``: TRL has none (see the module doc)."""

    server_url: str
    api_key: str | None = None
    control_timeout_s: float = 300.0
    weight_sync_timeout_s: float = 1800.0
    transport: Transport = field(default_factory=Transport)
    dtype: str | None = None

    def __post_init__(self) -> None:
        self.server_url = self.server_url.rstrip("/")
        self.transport.api_key = self.api_key

    def _ok(self, call: Call) -> Call:
        if call.status != 200:  # TRL: "Request failed: {status}, {text}"
            raise ReplayError(call)
        return call

    def init_weight_transfer(self, master_address: str, master_port: int) -> dict[str, Any]:
        """Ready check, dtype, world size, then ``/init_weight_transfer_engine``; returns the init_info."""
        t, url = self.transport, self.server_url
        self._ok(t.send("GET", url + "/health", timeout_s=5, raise_on_error=False))
        info = t.send("GET", url + "/server_info", query={"config_format": "json"})
        self.dtype = info.answer["vllm_config"]["model_config"]["dtype"]  # TRL: KeyError if missing
        world = t.send("GET", url + "/get_world_size", raise_on_error=False).answer["world_size"]
        init_info = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": 1,
            "world_size": world + 1,
            "packed": True,
        }
        body = {"init_info": init_info}
        self._ok(
            t.send(
                "POST",
                url + "/init_weight_transfer_engine",
                body=body,
                timeout_s=self.weight_sync_timeout_s,
                raise_on_error=False,
            )
        )
        return init_info

    def sync(self, update_info: dict[str, Any]) -> list[Call]:
        """One ``_sync_weight_merged``: pause, start, update (NCCL not replayed), finish, resume."""
        t, url, first = self.transport, self.server_url, len(self.transport.calls)
        send = {"raise_on_error": False}
        self._ok(
            t.send("POST", url + "/pause", query={"mode": "keep"}, timeout_s=self.control_timeout_s, **send)
        )
        self._ok(
            t.send(
                "POST",
                url + "/start_weight_update",
                body={"is_checkpoint_format": True},
                timeout_s=self.control_timeout_s,
                **send,
            )
        )
        try:
            self._ok(
                t.send(
                    "POST",
                    url + "/update_weights",
                    body={"update_info": update_info},
                    timeout_s=self.weight_sync_timeout_s,
                    **send,
                )
            )
        except ReplayError:
            t.send("POST", url + "/finish_weight_update", timeout_s=self.weight_sync_timeout_s, **send)
            raise
        self._ok(t.send("POST", url + "/finish_weight_update", timeout_s=self.weight_sync_timeout_s, **send))
        self._ok(t.send("POST", url + "/resume", timeout_s=self.control_timeout_s, **send))
        return t.calls[first:]


# ----------------------------------------------------------------------------------------------------
# A trainer process that dies between /pause and /resume
# ----------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="replay a trainer's control calls, then hold until killed")
    p.add_argument("what", choices=["nemo-rl-hold"])
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--key-env", required=True, help="the environment variable holding the Bearer key")
    p.add_argument("--prefix", default="", help="a prefix for NeMo-RL's *_path settings (default: none)")
    p.add_argument("--mode", default="keep", choices=["keep", "wait", "abort"])
    p.add_argument("--reload", default=None, help="also reload this directory before holding")
    p.add_argument("--hold-s", type=float, default=600.0)
    args = p.parse_args(argv)
    key = os.environ.get(args.key_env)
    if not key:
        p.error(f"${args.key_env} is empty: it must hold the control URL's Bearer key")
    nemo = NemoRlRemoteVllm(
        args.base_url, args.model, key, paths=control_paths(args.prefix), inflight_policy=args.mode
    )
    nemo.pause()
    if args.reload:
        nemo.reload_weights(args.reload)
    print(json.dumps({"held": [c.brief() for c in nemo.transport.calls]}), flush=True)
    time.sleep(args.hold_s)  # killed here, between /pause and /resume
    return 0


if __name__ == "__main__":
    sys.exit(main())
