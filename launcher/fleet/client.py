"""The trainer's handle on the generation fleet: the refit window and per-step metrics, through the front.

A trainer imports this (no Ray; its calls are blocking urllib calls, so no event loop is needed, though the
report types it shares with the router import aiohttp), points it at a job directory or at the router's URL
plus the admin token, and drives the whole fleet with one call per operation::

    from launcher.fleet.client import FleetClient

    fleet = FleetClient.from_job_dir("~/rl-launch/jobs/1234")   # or FleetClient(url, admin_token)
    for step in range(steps):
        fleet.begin_step()
        ...                                      # rollouts through the router
        with fleet.refit(version=f"step-{step}"):  # pause(keep) ... reset caches, stamp, resume
            update_weights_on_every_engine()     # NCCL / IPC, outside rl-launch
        log(fleet.step_metrics())                # one dict: tokens, cache hits, finish reasons...
        for url in fleet.stale_engines():        # engines restarted meanwhile: refit, then stamp
            refit_engine(url); fleet.set_weight_version(fleet_version, engines=[url])

Every call fans out to every engine behind the router (``router.fleet.api``) and raises ``FleetOpError``
(carrying the per-engine ``FleetOpReport``) when any engine did not comply, so a half-paused or
half-stamped fleet never passes silently; ``check=False`` returns the report instead.
The builtin router serves these routes itself; for ``router.kind: vllm-router`` and ``ray-serve`` the driver
serves them beside the front (``launcher.gateways.fleet_endpoint``: same routes, but the engines, not the
front, hold the requests that arrive during a pause). ``from_job_dir`` finds the right URL in the job state
(``fleet_url``; a job on a standing fleet uses its own admin key there) and refuses fronts without these
routes (Dynamo) with the reason.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.net.http_call import bearer, open_url
from router.fleet.engine import PAUSE_MODES
from router.fleet.ops import FleetOpReport
from router.fleet.refit import DEFAULT_DEADLINE_S, DEFAULT_LEASE_S

if TYPE_CHECKING:
    from launcher.jobdir import JobDir


class FleetOpError(RuntimeError):
    """A fleet operation that some engine did not comply with; ``report`` says which and why."""

    def __init__(self, report: FleetOpReport) -> None:
        super().__init__(f"fleet {report.op} failed: {report.why()}")
        self.report = report


class FleetHttpError(RuntimeError):
    """The front answered an error status (``status``) the operation does not turn into a report."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class RefitError(RuntimeError):
    """A refit transaction that did not move the fleet to its version; ``txn`` is the router's report."""

    def __init__(self, txn: dict[str, Any]) -> None:
        bad = txn.get("quarantined") or {}
        super().__init__(
            f"refit to {txn.get('version')!r} did not move the fleet ({txn.get('phase')}): "
            f"{txn.get('error')}; quarantined: {bad}"
        )
        self.txn = txn


class RefitHandle:
    """The body's side of ``FleetClient.refit``: move the weights inside the transaction."""

    def __init__(self, client: FleetClient, txn: dict[str, Any]) -> None:
        self._client = client
        self.id: str = txn["id"]
        self.begun = txn
        """The transaction as it stood after the pause (``engines``, ``quarantined``...)."""
        self.result: dict[str, Any] | None = None
        """The transaction's end, set on exit."""

    def load_weights(
        self, path: str | Path, per_engine: dict[str, str | Path] | None = None
    ) -> dict[str, Any]:
        """Every engine still in the transaction reloads from ``path`` (checked before it is sent);
        ``per_engine``: ``{engine url: directory}`` for engines that read a node-local copy instead, as
        in ``FleetClient.load_weights``."""
        body: dict[str, Any] = {"id": self.id, "from": str(Path(path).expanduser().absolute())}
        if per_engine:
            body["from_by_engine"] = {u: str(Path(p).expanduser().absolute()) for u, p in per_engine.items()}
        return self._client._txn_call("/fleet/refit/load", body, check=False)

    def update_weights(
        self, names: list[str], dtype_names: list[str], shapes: list[list[int]], **extra: Any
    ) -> dict[str, Any]:
        """One streamed round (``source="stream"``): the engines receive while the trainer broadcasts, so
        call this from a thread and broadcast from rank 0 meanwhile."""
        info = {"names": names, "dtype_names": dtype_names, "shapes": shapes, **extra}
        return self._client._txn_call(
            "/fleet/refit/update", {"id": self.id, "update_info": info}, check=False
        )


class _LeaseRenewer:
    """Renews a transaction's lease every third of it while the trainer's body runs."""

    def __init__(self, client: FleetClient, txn_id: str, lease_s: float) -> None:
        self._client, self._id, self._every = client, txn_id, max(0.2, lease_s / 3)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="refit-lease", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self._client.timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self._client._call("POST", "/fleet/refit/lease", {"id": self._id})
            except RuntimeError:  # it ended (expired) or the router is gone: the commit will say which
                return


def why_no_fleet_url(jd: JobDir, state: dict[str, Any]) -> str:
    """Why a job whose state has no ``fleet_url`` has no ``/fleet`` routes (nor the vLLM control API under
    them): a plain consumer of a standing fleet, or a front without them. One wording for the client's
    refusal and the driver's log."""
    from launcher.gateways.kinds import GATEWAY_KINDS, front_kind

    if state.get("attached_to"):
        return (
            f"job directory {jd.path}: attached to standing fleet "
            f"{state['attached_to'].get('fleet')!r} as a plain consumer (no pause or refit; the "
            "fleet's spec names admin consumers under fleet.consumers)"
        )
    from launcher.spec.snapshot import read_spec

    kind = read_spec(jd).router.kind
    having = ", ".join(name for name, front in GATEWAY_KINDS.items() if front.has_fleet_routes)
    why = front_kind(kind).no_fleet_routes_why
    return (
        f"job directory {jd.path}: router.kind {kind!r} has no /fleet routes (router.kind {having} "
        "have them; rl-launch fleet reset-cache works for every front)" + (f": {why}" if why else "")
    )


class FleetClient:
    def __init__(self, url: str, admin_token: str | None, timeout_s: float = 300.0) -> None:
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        self._token = admin_token
        self.timeout_s = timeout_s
        self.last_refit: dict[str, Any] | None = None
        """The last ``refit`` transaction as the router reported its end (``router.fleet.refit``)."""

    @classmethod
    def from_job_dir(cls, path: str | Path, timeout_s: float = 300.0) -> FleetClient:
        """The router URL and admin token of a running job (its job directory)."""
        from launcher.jobdir import JobDir

        jd = JobDir(Path(path).expanduser())
        state = jd.read_state()
        if not state.get("router_url") or state.get("torn_down"):
            raise ValueError(f"job directory {jd.path}: no serving router (phase: {state.get('phase')})")
        url = state.get("fleet_url")
        if not url:
            raise ValueError(why_no_fleet_url(jd, state))
        # A job on a standing fleet refits with its own admin token, which the fleet registered as its
        # admin key when its owner made it an admin consumer (fleet.consumers.<job>.admin); the driver
        # records fleet_url only then. Never the client key: that one is every rollout worker's.
        token = jd.read_admin_token()
        return cls(url, token, timeout_s)

    # -- transport ----------------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: Any = None, query: dict[str, str] | None = None) -> Any:
        url = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        headers = {"Content-Type": "application/json", **bearer(self._token)}
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            # Never a redirect: the admin token goes to the fleet URL and nowhere else.
            with open_url(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            text = exc.read()
            if exc.code == 500:  # the report of an operation some engine did not comply with
                try:
                    return json.loads(text)
                except ValueError:
                    pass
            raise FleetHttpError(
                exc.code, f"{method} {url}: HTTP {exc.code} ({exc.reason}): {text[:300]!r}"
            ) from None
        except OSError as exc:
            raise RuntimeError(f"{method} {url}: router unreachable: {exc}") from None

    def _op(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: dict[str, str] | None = None,
        check: bool = True,
    ) -> FleetOpReport:
        report = FleetOpReport.from_json(self._call(method, path, body, query))
        if check and not report.ok:
            raise FleetOpError(report)
        return report

    # -- operations -----------------------------------------------------------------------------------
    def pause(self, mode: str = "keep", check: bool = True) -> FleetOpReport:
        """Pause every engine (``keep``: freeze in-flight requests until resume; ``wait``: let them
        finish; ``abort``: abort them); the router holds new requests until ``resume``."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode={mode!r}: choose one of {', '.join(PAUSE_MODES)}")
        return self._op("POST", "/fleet/pause", query={"mode": mode}, check=check)

    def resume(self, check: bool = True) -> FleetOpReport:
        """Resume every engine, then release the held requests in arrival order; ``result`` holds
        ``released`` and ``held_longest_wait_s``."""
        return self._op("POST", "/fleet/resume", check=check)

    def is_paused(self) -> bool:
        """True when the router holds requests and every engine reports paused."""
        return bool(self._op("GET", "/fleet/is_paused").result["paused"])

    def abort(self, request_ids: list[str] | None = None, check: bool = True) -> FleetOpReport:
        """Abort the named requests (vLLM's external ids, e.g. ``chatcmpl-<X-Request-Id>``), or all."""
        return self._op("POST", "/fleet/abort", {"request_ids": request_ids or []}, check=check)

    def set_weight_version(
        self, version: str, engines: list[str] | None = None, check: bool = True
    ) -> FleetOpReport:
        """Stamp every serving engine (the fleet moves to ``version``), or only ``engines`` (refit stale
        ones, which are then readmitted)."""
        body: dict[str, Any] = {"version": version}
        if engines is not None:
            body["engines"] = engines
        return self._op("POST", "/fleet/weight_version", body, check=check)

    def weight_version(self, check: bool = True) -> FleetOpReport:
        """Each engine's version (``result["engines"]``) and the fleet's (``result["current"]``)."""
        return self._op("GET", "/fleet/weight_version", check=check)

    def stale_engines(self) -> dict[str, str]:
        """``{engine url: why}`` for engines held out until they are refit and stamped."""
        return dict(self._call("GET", "/fleet/stale")["stale"])

    def checksum(self, check: bool = True) -> FleetOpReport:
        """Compare the serving engines' weight checksums; fails when they do not all agree."""
        return self._op("POST", "/fleet/checksum", check=check)

    def reset_prefix_cache(self, check: bool = True) -> dict[str, Any]:
        """Flush every engine's prefix cache and the router's prefix index (``router.fleet.cache_reset``)."""
        data = self._call("POST", "/fleet/reset_prefix_cache")
        if check and not data.get("ok"):
            bad = [e for e in data.get("engines", []) if not e.get("ok")]
            raise FleetOpError(
                FleetOpReport("reset_prefix_cache", error=f"engines did not flush: {bad or 'none serving'}")
            )
        return dict(data)

    # -- the refit transaction (router.fleet.refit) -----------------------------------------------------
    def load_weights(
        self,
        path: str | Path,
        version: str,
        expected_checksum: str | None = None,
        deadline_s: float = DEFAULT_DEADLINE_S,
        mode: str = "keep",
        reset_cache: bool = True,
        check: bool = True,
        per_engine: dict[str, str | Path] | None = None,
    ) -> dict[str, Any]:
        """The whole refit from a checkpoint directory every node sees, run by the router in one call:
        pause -> every engine reloads from ``path`` -> verify checksums (equal, and equal to
        ``expected_checksum`` when given) -> reset prefix caches -> stamp ``version`` -> resume. Engines
        that fail a step or miss ``deadline_s`` are quarantined (``result["quarantined"]``: url -> why)
        and the others serve ``version``. A bad directory is refused before anything pauses
        (``ValueError``). Raises ``RefitError`` when the fleet did not move to ``version`` (``check``).
        ``per_engine``: ``{engine url: directory}`` for engines that read a node-local copy instead."""
        body: dict[str, Any] = {
            "version": version,
            "from": str(Path(path).expanduser().absolute()),
            "deadline_s": deadline_s,
            "mode": mode,
            "reset_cache": reset_cache,
        }
        if expected_checksum is not None:
            body["expected_checksum"] = expected_checksum
        if per_engine:
            body["from_by_engine"] = {u: str(Path(p).expanduser().absolute()) for u, p in per_engine.items()}
        return self._txn_call("/fleet/refit", body, check)

    @contextmanager
    def refit(
        self,
        version: str,
        mode: str = "keep",
        reset_cache: bool = True,
        source: str = "external",
        lease_s: float = DEFAULT_LEASE_S,
        deadline_s: float = DEFAULT_DEADLINE_S,
        expected_checksum: str | None = None,
    ) -> Iterator[RefitHandle]:
        """A refit transaction the trainer drives: the fleet pauses on entry, the body moves the weights
        (``handle.load_weights(dir)``, ``handle.update_weights(...)`` for a stream, or the trainer's own
        means with ``source="external"``), and on exit the router verifies, resets caches, stamps
        ``version`` and resumes (``handle.result``). The pause is a lease this client renews from a
        thread while the body runs: a trainer that dies lets it run out, and the router then resumes on
        its own, keeping out every engine whose weights were touched and not verified. A body that raises
        aborts the transaction the same way (nothing unverified serves), and the exception propagates."""
        txn = self._txn_call(
            "/fleet/refit/begin",
            {
                "version": version,
                "source": source,
                "mode": mode,
                "lease_s": lease_s,
                "deadline_s": deadline_s,
            },
            check=False,
        )
        handle = RefitHandle(self, txn)
        renewer = _LeaseRenewer(self, txn["id"], lease_s)
        renewer.start()
        committed = False
        try:
            yield handle
            renewer.stop()
            body: dict[str, Any] = {"id": txn["id"], "reset_cache": reset_cache}
            if expected_checksum is not None:
                body["expected_checksum"] = expected_checksum
            committed = True
            handle.result = self._txn_call("/fleet/refit/commit", body, check=False)
            if not handle.result.get("moved"):
                raise RefitError(handle.result)
        finally:
            renewer.stop()
            if not committed:
                handle.result = self._txn_call("/fleet/refit/abort", {"id": txn["id"]}, check=False)
            self.last_refit = handle.result

    # -- LoRA adapters (router.adapters) ------------------------------------------------------------------
    def load_adapter(
        self,
        name: str,
        path: str | Path,
        version: str | None = None,
        deadline_s: float = 300.0,
        check: bool = True,
    ) -> dict[str, Any]:
        """Refit adapter ``name`` from the directory ``path`` (a peft ``save_pretrained`` directory every
        node sees) as one transaction, without pausing anything: the router checks it (rank within the
        fleet's ``max_lora_rank``, the base model), loads it on a canary engine, then on every engine,
        under the served name ``name@version``, verifies each, and from then on routes requests whose
        ``model`` is ``name`` to it; the version before drains and is unloaded. ``version``: default
        ``v<n>``. Returns the report (``moved``, ``served_name``, ``missing``: engines that did not take
        it, ``steps``...). A directory refused before any engine was asked is ``ValueError``; an adapter
        another consumer owns, a full plan or a refit of it running is ``FleetHttpError`` (403, 409);
        with ``check``, ``RefitError`` when the adapter did not move (its canary failed)."""
        body: dict[str, Any] = {
            "adapter": name,
            "from": str(Path(path).expanduser().absolute()),
            "deadline_s": deadline_s,
        }
        if version is not None:
            body["version"] = version
        return self._txn_call("/fleet/adapters/load", body, check)

    def unload_adapter(self, name: str) -> dict[str, Any]:
        """Stop serving adapter ``name``: its requests are refused from now on, and every version is
        unloaded from the engines once its requests in flight end."""
        return dict(self._call("POST", "/fleet/adapters/unload", {"adapter": name}))

    def adapters(self) -> dict[str, Any]:
        """The fleet's adapters: the plan, each adapter's owner, version, engines and draining versions,
        the served names per engine, and the last refit of each."""
        return dict(self._call("GET", "/fleet/adapters"))

    def refit_state(self) -> dict[str, Any]:
        """``{"active", "last", "current", "known_versions"}``: the transaction running now and the last."""
        return dict(self._call("GET", "/fleet/refit"))

    def weight_transfer_plan(self) -> dict[str, Any]:
        """The NCCL rank plan over the serving engines: ``{"trainer_rank": 0, "world_size", "engines":
        [{"url", "world_size", "rank_offset"}]}``. Refused (``RuntimeError``) when an engine's backend
        cannot run where it is (on a CPU engine only ``rl_launch_gloo`` can) or it has no
        ``--weight-transfer-config``, before anything is sent to any engine."""
        return dict(self._call("GET", "/fleet/weight_transfer/plan"))

    def init_weight_transfer(
        self, master_address: str, master_port: int, init_info: dict[str, Any] | None = None
    ) -> FleetOpReport:
        """Every serving engine joins the trainer's NCCL group at its rank offset; the trainer must join
        as rank 0 (``world_size`` from ``weight_transfer_plan``) at the same time, e.g. from a thread,
        since the engines wait for it. ``init_info``: the trainer's wire parameters (``packed``...)."""
        body = {"master_address": master_address, "master_port": master_port, "init_info": init_info or {}}
        return self._op("POST", "/fleet/weight_transfer/init", body)

    def _txn_call(self, path: str, body: dict[str, Any], check: bool) -> dict[str, Any]:
        try:
            data = self._call("POST", path, body)
        except FleetHttpError as exc:
            if exc.status == 400:  # refused before anything paused: the input names the field
                raise ValueError(str(exc)) from None
            raise
        if check and not data.get("moved"):
            raise RefitError(data)
        return dict(data)

    # -- per-step metrics -------------------------------------------------------------------------------
    def begin_step(self) -> int:
        """Snapshot every engine's counters; ``step_metrics`` answers the delta since. Returns the step."""
        data = self._call("POST", "/fleet/step/begin")
        if data.get("errors"):
            raise RuntimeError(f"engines' counters unreadable: {data['errors']}")
        return int(data["step"])

    def step_metrics(self) -> dict[str, Any]:
        """``{"step", "seconds", "fleet": {...}, "engines": {url: {...}}, "prefix_hit_rate"}``: the
        engines' own counters since ``begin_step`` (``router.fleet.engine_counters`` names the keys)."""
        data = dict(self._call("GET", "/fleet/step"))
        if data.get("errors"):
            raise RuntimeError(f"engines' counters unreadable: {data['errors']}")
        return data

    def counters(self) -> dict[str, Any]:
        """The engines' counters now (totals since they started)."""
        return dict(self._call("GET", "/fleet/counters"))


def flatten(step: dict[str, Any], prefix: str = "generation") -> dict[str, float]:
    """A step dict as flat ``{"generation/prompt_tokens": ..., "generation/engine0/...": ...}`` for a
    metrics logger (engines numbered in URL order)."""
    out: dict[str, float] = {f"{prefix}/{k}": v for k, v in step.get("fleet", {}).items()}
    if step.get("prefix_hit_rate") is not None:
        out[f"{prefix}/prefix_hit_rate"] = step["prefix_hit_rate"]
    for i, url in enumerate(sorted(step.get("engines", {}))):
        for k, v in step["engines"][url].items():
            out[f"{prefix}/engine{i}/{k}"] = v
    return out
