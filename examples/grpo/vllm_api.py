"""The example GRPO trainer's second way to refit: vLLM's own control API over plain HTTP, in the order
NeMo-RL's ``remote_vllm`` generation backend calls it (``--refit-via vllm-api``).

Why this exists: a trainer that drives a vLLM server it does not own speaks vLLM's API, not
``FleetClient``. NeMo-RL's ``remote_vllm`` backend (``nemo_rl/models/generation/remote_vllm/``: client.py,
preflight.py, remote_vllm_generation.py; the refit in ``nemo_rl/weight_sync/
remote_vllm_checkpoint_weight_synchronizer.py``; as docs/trainer-calls.md section 1 records them)
preflights once and then, each refit, pauses, reloads the weights from a checkpoint directory through
``/collective_rpc`` and resumes. rl-launch's
router answers that API for the whole fleet at its control URL (the fleet URL's origin; the same API is
also under ``/control``) and runs each
``/pause`` ... ``/resume`` as its refit transaction (check, canary, every engine, verify, reset, stamp).
This module is what such a trainer writes: the standard library only (urllib), nothing of rl-launch, so
that the example trains through exactly the calls an outside trainer sends, and a run that learns here
says the control URL is enough.

The calls, one client (one Bearer key, as NeMo-RL's ``api_key_env_var``):

* preflight, once: ``GET /health`` on the generation URL and on the control URL (a control ``/health``
  whose ``total_backends`` is an integer other than 1 without ``"control_fanout": true`` is refused, as
  NeMo-RL refuses it: a plain proxy would reload one replica of several); ``GET /v1/models`` must list the
  served model; ``GET /server_info`` must be a JSON object;
* each refit: ``POST /pause?mode=<inflight policy>&clear_cache=true`` (NeMo-RL's synchronizer passes
  ``clear_cache=True``), ``POST /collective_rpc`` ``{"method": "reload_weights", "kwargs":
  {"weights_path": DIR}}``, ``POST /resume``; then, only with ``reset_after_resume`` (NeMo-RL's
  ``recompute_kv_cache_after_weight_updates: true``, false by default there), ``POST /reset_prefix_cache``
  after the resume, where NeMo-RL's loop sends it (``invalidate_kv_cache``). NeMo-RL sends no reset inside
  the pause; the router resets every engine's cache inside the transaction anyway. Any answer that is not
  2xx, or no answer, raises ``ControlError`` at once, and nothing after it is sent (NeMo-RL's rule: a
  failed reload may have moved only some workers of one vLLM, so it never resumes after one). On
  rl-launch the fleet serves on regardless: a refused or failed reload ends the transaction on the
  fleet's previous version, and a trainer that died mid-sequence is ended by the transaction's lease.

Where the paths go: each is appended to its URL (``$RL_CONTROL_BASE_URL`` + ``/pause``). NeMo-RL's own
client instead resolves every path against the *origin* of its URLs (``service_url``: the URL's path is
dropped); both land on the same routes, the control URL being the fleet URL's origin, so NeMo-RL's
default paths work unchanged (docs/trainers.md). ``/v1/models`` is asked of the control URL; the
generation URL's model list takes the admin token too (NeMo-RL sends its one key to both URLs).

The weight version: NeMo-RL keeps its own and never sends one; the router derives one for each refit and
names it on every answer (the ``x-rl-weight-version`` header, and in the JSON). The example trainer reads
it there (``/server_info`` before the first refit, ``/resume`` after each), because its version filter
keeps only samples of the weights it trained: in this mode the fleet names the version, not the trainer.

The URL and key come from the environment the driver gives the training command:
``$RL_CONTROL_BASE_URL`` (the fleet URL's origin) and ``$RL_CONTROL_API_KEY_FILE`` (the 0600 file of the
job's admin token, read here; ``$RL_CONTROL_API_KEY``, when set, wins). Never in argv or the spec.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONTROL_URL_ENV = "RL_CONTROL_BASE_URL"
CONTROL_KEY_ENV = "RL_CONTROL_API_KEY"
CONTROL_KEY_FILE_ENV = "RL_CONTROL_API_KEY_FILE"
VERSION_HEADER = "x-rl-weight-version"
INFLIGHT_POLICIES = ("keep", "wait", "abort")
"""vLLM's pause modes; NeMo-RL's ``refit.inflight_policy`` defaults to ``keep`` (vLLM's ``/pause`` to
``abort``)."""


class ControlError(RuntimeError):
    """A control call answered with an error status (``status``; ``body``: its text, vLLM's error JSON)
    or not at all (``status`` None)."""

    def __init__(self, message: str, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


@dataclass
class Answer:
    """One call's answer: its JSON (None for an empty or non-JSON body), the version header, its time."""

    data: Any
    version: str | None
    seconds: float


def version_of(answer: Answer) -> str | None:
    """The fleet's weight version an answer names: its header, else a ``version``/``weight_version``
    field of its JSON (the router's control answers carry both; a stock vLLM neither)."""
    if answer.version:
        return answer.version
    if isinstance(answer.data, dict):
        for key in ("weight_version", "version"):
            value = answer.data.get(key)
            if isinstance(value, str) and value:
                return value
    return None


class VllmControl:
    """A plain-HTTP client of vLLM's control API: NeMo-RL's preflight and refit, in its order."""

    def __init__(
        self,
        control_base_url: str,
        base_url: str,
        api_key: str | None,
        served_model_name: str,
        inflight_policy: str = "keep",
        clear_cache: bool = True,
        reset_after_resume: bool = False,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        refit_timeout_s: float = 1800.0,
    ) -> None:
        if inflight_policy not in INFLIGHT_POLICIES:
            raise ValueError(
                f"inflight policy {inflight_policy!r}: choose one of {', '.join(INFLIGHT_POLICIES)}"
            )
        for name, url in (("control_base_url", control_base_url), ("base_url", base_url)):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{name} {url!r} must start with http:// or https://")
        self.control_base_url = control_base_url.rstrip("/")
        base = base_url.rstrip("/")
        self.base_url = base[: -len("/v1")] if base.endswith("/v1") else base
        self.api_key = api_key
        self.served_model_name = served_model_name
        self.inflight_policy = inflight_policy
        self.clear_cache = clear_cache
        self.reset_after_resume = reset_after_resume
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.refit_timeout_s = refit_timeout_s

    @classmethod
    def from_env(
        cls,
        base_url: str,
        served_model_name: str,
        inflight_policy: str = "keep",
        reset_after_resume: bool = False,
        env: Mapping[str, str] = os.environ,
    ) -> VllmControl:
        """The control URL from ``$RL_CONTROL_BASE_URL``, the key from ``$RL_CONTROL_API_KEY`` or else the
        file ``$RL_CONTROL_API_KEY_FILE`` names (the driver exports the file, never the token: every
        process of the training command inherits its environment); a clear error naming the variable
        when either is missing."""
        url, key = env.get(CONTROL_URL_ENV), env.get(CONTROL_KEY_ENV)
        if not key and env.get(CONTROL_KEY_FILE_ENV):
            try:
                key = Path(env[CONTROL_KEY_FILE_ENV]).read_text().strip()
            except OSError as exc:
                raise ValueError(
                    f"${CONTROL_KEY_FILE_ENV}: cannot read {env[CONTROL_KEY_FILE_ENV]}: {exc}"
                ) from None
        if not url:
            raise ValueError(
                f"${CONTROL_URL_ENV} is not set: --refit-via vllm-api needs the fleet's control URL "
                "(the driver exports it to a job whose front serves the control API; or set it to the "
                "fleet URL)"
            )
        if not key:
            raise ValueError(
                f"neither ${CONTROL_KEY_ENV} nor ${CONTROL_KEY_FILE_ENV} is set: the control URL takes the "
                "job's admin token as its Bearer (the driver exports its file beside the control URL)"
            )
        return cls(
            url, base_url, key, served_model_name, inflight_policy, reset_after_resume=reset_after_resume
        )

    # -- transport ----------------------------------------------------------------------------------
    def _request(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, str] | None = None,
        body: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        control: bool = True,
    ) -> Answer:
        url = (self.control_base_url if control else self.base_url) + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        headers = {"Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.request_timeout_s) as resp:
                raw = resp.read()
                version = resp.headers.get(VERSION_HEADER)
        except urllib.error.HTTPError as exc:
            text = exc.read(2048).decode("utf-8", errors="replace")
            raise ControlError(f"{method} {url}: HTTP {exc.code}: {text}", exc.code, text) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ControlError(f"{method} {url}: no answer: {getattr(exc, 'reason', exc)}") from None
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = None  # a stock vLLM's /health answers an empty body: the status says enough
        return Answer(parsed, version, time.perf_counter() - t0)

    # -- NeMo-RL's preflight ------------------------------------------------------------------------
    def preflight(self) -> dict[str, Any]:
        """Health of both URLs, the fan-out check, the served model listed, ``/server_info`` an object;
        returns ``/server_info`` (with the version it names under ``"_version"`` when there is one)."""
        self._request("GET", "/health", timeout_s=self.connect_timeout_s, control=False)
        health = self._request("GET", "/health", timeout_s=self.connect_timeout_s).data
        if isinstance(health, dict) and isinstance(health.get("total_backends"), int):
            if health["total_backends"] != 1 and health.get("control_fanout") is not True:
                raise ControlError(
                    f"{self.control_base_url}/health reports {health['total_backends']} backends and no "
                    '"control_fanout": true: a refit through it would reload one replica of several'
                )
        models = self._request("GET", "/v1/models", timeout_s=self.connect_timeout_s).data
        entries = models.get("data") if isinstance(models, dict) else None
        if not isinstance(entries, list):
            raise ControlError(f"{self.control_base_url}/v1/models: no data list in {models!r:.200}")
        ids = {e.get("id") for e in entries if isinstance(e, dict) and isinstance(e.get("id"), str)}
        if self.served_model_name not in ids:
            raise ControlError(
                f"{self.control_base_url}/v1/models lists {sorted(ids)}, not {self.served_model_name!r}"
            )
        info = self._request("GET", "/server_info", timeout_s=self.connect_timeout_s)
        if not isinstance(info.data, dict):
            raise ControlError(
                f"{self.control_base_url}/server_info is not a JSON object: {info.data!r:.200}"
            )
        version = version_of(info)
        return {**info.data, "_version": version} if version else dict(info.data)

    # -- NeMo-RL's refit ----------------------------------------------------------------------------
    def refit(self, weights_path: str) -> dict[str, Any]:
        """Pause, reload from ``weights_path`` (an HF checkpoint directory every engine reads), resume (and
        reset the prefix cache after, with ``reset_after_resume``); the first failure raises
        ``ControlError`` and nothing after it is sent.
        Returns a report shaped as the trainer logs a ``FleetClient`` refit: ``version`` (the fleet's,
        from the ``/resume`` answer), ``elapsed_s`` (from the pause's call to the resume's answer, on the
        trainer's clock), ``steps`` (each call's ``phase`` and ``took_s``), ``answers`` (each call's
        JSON) and ``quarantined`` (engines the router reports left behind, if any)."""
        t0 = time.perf_counter()
        calls: list[tuple[str, Answer]] = []
        query = {"mode": self.inflight_policy, "clear_cache": str(self.clear_cache).lower()}
        calls.append(("pause", self._request("POST", "/pause", query=query)))
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(weights_path)}}
        reload = self._request("POST", "/collective_rpc", body=rpc, timeout_s=self.refit_timeout_s)
        calls.append(("reload_weights", reload))
        resume = self._request("POST", "/resume")
        calls.append(("resume", resume))
        paused_s = time.perf_counter() - t0
        if self.reset_after_resume:
            calls.append(("reset_prefix_cache", self._request("POST", "/reset_prefix_cache")))
        quarantined: dict[str, Any] = {}
        for _, answer in calls:  # rl-launch's answers summarise the transaction under "refit"
            refit = answer.data.get("refit") if isinstance(answer.data, dict) else None
            if isinstance(refit, dict) and isinstance(refit.get("quarantined"), dict):
                quarantined.update(refit["quarantined"])
        return {
            "version": version_of(resume),
            "elapsed_s": paused_s,
            "steps": [{"phase": name, "took_s": a.seconds} for name, a in calls],
            "answers": {name: a.data for name, a in calls},
            "quarantined": quarantined,
        }
