"""``router.kind: dynamo``: a launcher-owned NVIDIA Dynamo fleet behind ``python -m dynamo.frontend``, with
the job's API key checked in front of it.

What the launcher runs on the driver node, all stopped at teardown:

* **the runtime** (``prepare_engines``, before any worker starts): with ``discovery: etcd``, etcd and
  ``nats-server -js`` requiring the job's own credentials (``launcher.gateways.dynamo.runtime``); with
  ``discovery: file``, only the directory ``<job>/dynamo/kv`` (``DYN_FILE_KV``, 0700) on the shared
  filesystem. The engine hosts receive where it is and which secret files to read (``DynamoPlanes``).
* **the frontend** (``start``): ``python -m dynamo.frontend`` with the spec's ``--router-mode`` and
  ``--migration-limit`` (a request on a worker that dies is re-routed instead of failing), listening on
  **loopback** on a free port: it checks no key (Dynamo 1.6 has no client authentication; its own
  security guide puts an authenticating gateway in front). Ready when its ``/health`` lists every worker
  instance and ``/v1/models`` shows the model; the gateway keeps reading both there.
* **the front** (``start``): our ``router.server.GenerationRouter`` on the reserved port (the stable URL
  Gym and the training command get), in the driver's process, with the job's API key and admin token and
  one backend, the frontend. It answers only the proxied OpenAI routes (streams pass through), 401 without
  the key, and keeps our status contract; its ``/health`` and ``/metrics`` are the router's own (open, as
  for every kind). Why our router and not a new proxy: it already does all of this, and one proxy is one
  set of limits, timeouts and tests. Where the frontend listens is announced in the job's events
  (``gateway_frontend``, ``frontend_url``) for operators and tests on the driver node.

Not authenticated by Dynamo 1.6, and therefore only on loopback in local mode and refused on ``cluster:
slurm`` without ``router.dynamo.allow_insecure_network`` (docs/fronts.md, "Behind Dynamo"): each worker's
request plane (TCP, ``DYN_TCP_RPC_HOST``) and system status server (``/health``, ``/engine/*``; the engine
URL our probes use), the frontend's TCP response-stream listener, and with ``discovery: file`` the ZMQ
event plane. They listen on the nodes' addresses because the other nodes must reach them.

Membership (``set_serving``): Dynamo's discovery decides which workers the frontend routes to; there is no
"add/remove this URL" call. The controller's serving set is therefore enforced through the workers
themselves: an engine it condemns is stopped and restarted in place by its engine host, which removes its
registration (lease / file) and the replacement registers anew. ``set_serving`` keeps the set to report
the difference in ``view`` and checks that the runtime, the frontend and the front are alive; a dead one
sets ``failed()``, which fails the job with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from launcher.engines.dynamo.worker import DynamoPlanes, dynamo_python
from launcher.gateways.base import Gateway, GatewayError, GatewayMember, GatewayView
from launcher.gateways.dynamo.kind import DYNAMO
from launcher.gateways.dynamo.runtime import EtcdNats, ManagedProcess, private_dir
from launcher.jobdir.paths import dynamo_dir
from router.ports import free_port

if TYPE_CHECKING:
    from router.server import GenerationRouter

FRONT_SETTINGS: dict[str, Any] = {"continuation_max_moves": 0}
"""What the key-checking front sets apart from our router's defaults. No continuation
(``router.continuation``, on by default elsewhere): its one backend is the frontend, so a move has nowhere
to go; Dynamo re-routes a request whose worker dies itself (``--migration-limit``); and the frontend
refuses the ``return_token_ids`` a continued request's first part adds (400: the router would fall back to
the client's bytes on each engine once, for nothing)."""

_GENERATE = "generate"
_PER_WORKER_ENDPOINT = "worker_kv_query_source_"


def _get_json(url: str, timeout_s: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read() or b"null")


def worker_instances(health: dict[str, Any]) -> dict[str, str]:
    """``{instance_id: transport address}`` of the workers serving ``generate`` in the frontend's
    ``/health`` (each worker also lists its other endpoints; they are the same instance)."""
    out: dict[str, str] = {}
    for inst in health.get("instances") or []:
        if inst.get("endpoint") != _GENERATE:
            continue
        transport = inst.get("transport") or {}
        address = next(iter(transport.values()), "") if isinstance(transport, dict) else str(transport)
        out[str(inst.get("instance_id"))] = str(address).split("/", 1)[0]
    return out


class DynamoGateway(Gateway):
    kind = DYNAMO.name
    binds_beside_port_hold = True  # the key-checking front is our router, in the driver

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        ctx = self.context
        self.options = ctx.spec.router.dynamo
        self.data_dir = dynamo_dir(ctx.job.path)
        self.python = ""
        self.runtime: EtcdNats | None = None
        self.frontend: ManagedProcess | None = None
        self.front: GenerationRouter | None = None
        self.planes: DynamoPlanes | None = None
        self._frontend_url = ""
        """The frontend itself, on loopback: readiness and ``view`` read its ``/health`` here."""
        self._url = ""
        self._serving: tuple[str, ...] = ()
        self._failure: str | None = None
        self._lock = threading.Lock()
        self._stopped = False

    # -- runtime -----------------------------------------------------------------------------------
    def prepare_engines(self) -> dict[str, Any]:
        """Start the runtime; return the workers' ``DynamoPlanes`` (as a dict, for the host config)."""
        ctx, opts = self.context, self.options
        try:
            self.python = dynamo_python()
        except ValueError as exc:
            raise GatewayError(str(exc)) from None
        private_dir(self.data_dir)
        env = {"DYN_NAMESPACE": "rl-launch"}
        secret_files: dict[str, str] = {}
        if opts.discovery == "file":
            kv = private_dir(self.data_dir / "kv")
            env["DYN_FILE_KV"] = str(kv)
            ctx.job.log_event("gateway_runtime", f"Dynamo file discovery in {kv}")
        else:
            self.runtime = EtcdNats(ctx.job, ctx.host, self.data_dir, ctx.say)
            runtime_env, secret_files = self.runtime.start(opts.lease_ttl_s)
            env.update(runtime_env)
        self.planes = DynamoPlanes(opts.discovery, opts.request_plane, env, secret_files)
        return asdict(self.planes)

    def _dead_runtime(self) -> str | None:
        dead = self.runtime.dead() if self.runtime is not None else None
        if dead is None and self.frontend is not None and (code := self.frontend.exited()) is not None:
            dead = f"Dynamo frontend exited with {code}; log {self.frontend.log}:\n{self.frontend.tail()}"
        if dead is None and self.front is not None and not self.front.is_serving():
            dead = f"the key-checking front on {self._url} stopped serving"
        return dead

    # -- the frontend ------------------------------------------------------------------------------
    def frontend_command(self, port: int) -> list[str]:
        opts = self.options
        assert self.planes is not None, "prepare_engines() first"
        argv = [
            self.python, "-m", "dynamo.frontend",
            "--http-host", "127.0.0.1",
            "--http-port", str(port),
            "--router-mode", opts.router_mode,
            "--migration-limit", str(opts.migration_limit),
            *self.planes.flags(),
        ]  # fmt: skip
        return [*argv, *opts.frontend_args]

    def start(self, engine_urls: Sequence[str]) -> str:
        ctx = self.context
        if self.planes is None:
            self.prepare_engines()
        assert self.planes is not None
        try:
            env = self.planes.apply(os.environ)
        except ValueError as exc:
            raise GatewayError(str(exc)) from None
        env["HF_HUB_OFFLINE"] = os.environ.get("HF_HUB_OFFLINE", "1")
        env["DYN_DISABLE_FRONTEND_ADMIN_API"] = "1"  # its /busy_threshold tunables: nobody here uses them
        env.pop("DYN_SYSTEM_PORT", None)
        for var in ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST"):
            env[var] = ctx.host  # where the workers reach it: else Dynamo advertises the first interface
        port = free_port("127.0.0.1")
        self.frontend = ManagedProcess(
            "frontend", self.frontend_command(port), ctx.job.logs / "dynamo-frontend.log", env
        ).start()
        self._frontend_url = f"http://127.0.0.1:{port}"
        self._serving = tuple(engine_urls)
        self._wait_ready(len(engine_urls))
        self._url = self._start_front()
        where = (
            f"Dynamo frontend on {self._frontend_url} (loopback), behind the key-checking front {self._url}"
        )
        ctx.say(where)
        ctx.job.log_event("gateway_frontend", where, frontend_url=self._frontend_url, front_url=self._url)
        return self._url

    def _start_front(self) -> str:
        """Our router on the reserved port, in front of the frontend: the job's key on every proxied
        route (``router.http.auth``), one backend that the driver owns (``health_managed``: no probing, the
        runtime's liveness is watched here), with our router's default settings but ``FRONT_SETTINGS`` (the
        spec's router settings configure our router only where it is the front; Dynamo's own are
        ``router.dynamo``)."""
        from router.config import RouterConfig, RouterSettings
        from router.http.app import RouterBindError
        from router.server import GenerationRouter

        ctx = self.context
        try:
            config = RouterConfig.from_settings(
                RouterSettings(**FRONT_SETTINGS),
                host=ctx.host,
                port=ctx.port,
                port_held=True,  # beside the driver's placeholder (binds_beside_port_hold)
                health_managed=True,
                api_key=ctx.api_key,
                admin_token=ctx.admin_token,
                **self.record_settings(),  # every request's engine is the frontend here
            )
            self.front = GenerationRouter(config, [f"{self._frontend_url}/v1"])
            return self.front.serve_in_background()
        except (RouterBindError, RuntimeError, ValueError) as exc:
            raise GatewayError(
                f"the key-checking front on {ctx.host}:{ctx.port} did not start: {exc}"
            ) from None

    def _wait_ready(self, workers: int) -> None:
        ctx = self.context
        model = ctx.spec.generation.served_model_name
        deadline = time.monotonic() + self.options.ready_timeout_s
        last_say = 0.0
        seen, models = 0, []
        while True:
            dead = self._dead_runtime()
            if dead:
                raise GatewayError(dead)
            try:
                seen = len(worker_instances(_get_json(f"{self._frontend_url}/health")))
                models = [
                    m.get("id") for m in (_get_json(f"{self._frontend_url}/v1/models").get("data") or [])
                ]
            except (OSError, ValueError, urllib.error.URLError):
                seen, models = 0, []
            if seen >= workers and model in models:
                return
            now = time.monotonic()
            if now > deadline:
                raise GatewayError(
                    f"Dynamo frontend {self._frontend_url} not ready in {self.options.ready_timeout_s:g} s: "
                    f"{seen}/{workers} worker instances, models {models} (want {model!r}); log "
                    f"{self.frontend.log if self.frontend else '?'}"
                )
            if now - last_say >= 5:
                last_say = now
                ctx.say(f"Dynamo frontend: {seen}/{workers} worker instances registered, models {models}")
                ctx.job.log_event(
                    "gateway_progress",
                    f"dynamo frontend: {seen}/{workers} worker instances",
                    instances=seen,
                    workers=workers,
                )
            time.sleep(0.5)

    # -- the Gateway interface ---------------------------------------------------------------------
    def base_url(self) -> str:
        return self._url

    def set_serving(self, urls: Sequence[str]) -> None:
        with self._lock:
            self._serving = tuple(urls)
            if self._failure is None and not self._stopped:
                self._failure = self._dead_runtime()

    def failed(self) -> str | None:
        with self._lock:
            if self._failure is None and not self._stopped and self.front is not None:
                self._failure = self._dead_runtime()
            return self._failure

    def instance(self) -> str | None:
        return str(self.frontend.proc.pid) if self.frontend and self.frontend.proc else None

    def view(self) -> GatewayView:
        try:
            health = _get_json(f"{self._frontend_url}/health")
            instances = worker_instances(health)
        except (OSError, ValueError, urllib.error.URLError) as exc:
            return GatewayView(self.kind, self._url, False, detail=f"frontend unreachable: {exc}")
        engine_of = self._engines_by_instance(health)
        members = tuple(
            GatewayMember(engine_of.get(iid, f"dyn://{iid}"), True, f"worker instance {iid} at {addr}")
            for iid, addr in sorted(instances.items())
        )
        detail = (
            f"router mode {self.options.router_mode}; {len(instances)} worker instance(s) in Dynamo's "
            f"discovery, {len(self._serving)} engine(s) serving by our probes; frontend "
            f"{self._frontend_url} behind the key-checking front"
        )
        return GatewayView(self.kind, self._url, True, members, detail)

    def _engines_by_instance(self, health: dict[str, Any]) -> dict[str, str]:
        """``{instance_id: engine URL}`` for the serving engines, so the dashboard can line the
        frontend's instances up with our engines. A worker's own ``/health`` names its per-worker
        endpoint (``worker_kv_query_source_<id>``), which the frontend lists under the worker's
        instance id; a worker without one stays ``dyn://<instance id>`` in the view."""
        by_endpoint = {
            str(i.get("endpoint")): str(i.get("instance_id"))
            for i in health.get("instances") or []
            if str(i.get("endpoint", "")).startswith(_PER_WORKER_ENDPOINT)
        }

        def endpoints(url: str) -> tuple[str, list[str]]:
            try:
                return url, list((_get_json(f"{url}/health", 1.0) or {}).get("endpoints") or {})
            except (OSError, ValueError, AttributeError, urllib.error.URLError):
                return url, []

        out: dict[str, str] = {}
        urls = [u.removesuffix("/v1") for u in self._serving]
        if not urls:
            return out
        with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
            for url, names in pool.map(endpoints, urls):
                for name in names:
                    if name in by_endpoint:
                        out[by_endpoint[name]] = url
        return out

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        if self.front is not None:
            self.front.stop()
        if self.frontend is not None:
            self.frontend.stop()
        if self.runtime is not None:
            self.runtime.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)
