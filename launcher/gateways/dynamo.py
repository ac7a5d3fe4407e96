"""``router.kind: dynamo``: a launcher-owned NVIDIA Dynamo fleet behind ``python -m dynamo.frontend``.

What the launcher runs on the driver node, all as child process groups it stops at teardown:

* **the runtime** (``prepare_engines``, before any worker starts): with ``discovery: etcd``, an etcd on two
  free ports (client, peer) and ``nats-server -js`` (JetStream, for KV events) on a third, each with its
  data directory under ``<job>/dynamo/``; with ``discovery: file``, only the directory ``<job>/dynamo/kv``
  (``DYN_FILE_KV``) on the shared filesystem. The engine hosts receive where it is (``DynamoPlanes``).
* **the frontend** (``start``): ``python -m dynamo.frontend`` on the reserved port (the stable URL Gym and
  the training command get) with the spec's ``--router-mode`` and ``--migration-limit`` (a request on a
  worker that dies is re-routed instead of failing). Ready when its ``/health`` lists every worker
  instance and ``/v1/models`` shows the model.

Membership (``set_serving``): Dynamo's discovery decides which workers the frontend routes to; there is no
"add/remove this URL" call. The controller's serving set is therefore enforced through the workers
themselves: an engine it condemns is stopped and restarted in place by its engine host, which removes its
registration (lease / file) and the replacement registers anew. ``set_serving`` keeps the set to report
the difference in ``view`` and checks that the runtime and the frontend are alive; a dead one sets
``failed()``, which fails the job with the reason.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from launcher.engines.dynamo import DynamoPlanes, dynamo_python
from launcher.gateways.base import Gateway, GatewayError, GatewayMember, GatewayView

_GENERATE = "generate"
_PER_WORKER_ENDPOINT = "worker_kv_query_source_"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ManagedProcess:
    """One runtime process (etcd, NATS, the frontend) in its own session, logged to a file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            out.write(f"# rl-launch: starting {self.name}: {shlex.join(self.argv)}\n".encode())
            out.flush()
            try:
                self.proc = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,
                )
            except OSError as exc:
                raise GatewayError(f"cannot start {self.name} ({self.argv[0]}): {exc}") from exc
        return self

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 5.0) -> None:
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # The group may hold children after the leader exited (the frontend's helpers): SIGKILL them.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


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
    kind = "dynamo"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        ctx = self.context
        self.options = ctx.spec.router.dynamo
        self.data_dir = ctx.job.path / "dynamo"
        self.python = ""
        self.runtime: list[ManagedProcess] = []
        self.frontend: ManagedProcess | None = None
        self.planes: DynamoPlanes | None = None
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
        self.data_dir.mkdir(parents=True, exist_ok=True)
        host = ctx.host
        env = {"DYN_NAMESPACE": "rl-launch"}
        if opts.discovery == "file":
            kv = self.data_dir / "kv"
            kv.mkdir(exist_ok=True)
            env["DYN_FILE_KV"] = str(kv)
            ctx.job.log_event("gateway_runtime", f"Dynamo file discovery in {kv}")
        else:
            env.update(self._start_etcd_nats(host))
        self.planes = DynamoPlanes(opts.discovery, opts.request_plane, env)
        return asdict(self.planes)

    def _start_etcd_nats(self, host: str) -> dict[str, str]:
        etcd_bin, nats_bin = shutil.which("etcd"), shutil.which("nats-server")
        if etcd_bin is None or nats_bin is None:
            missing = " and ".join(n for n, b in (("etcd", etcd_bin), ("nats-server", nats_bin)) if not b)
            raise GatewayError(
                f"router.dynamo.discovery is 'etcd' but {missing} is not on PATH on the driver node "
                "(Debian: apt-get install etcd-server nats-server), or use discovery: file"
            )
        client, peer, nats = _free_port(host), _free_port(host), _free_port(host)
        logs = self.context.job.logs
        etcd = ManagedProcess(
            "etcd",
            [
                etcd_bin,
                "--name", "rl-launch",
                "--data-dir", str(self.data_dir / "etcd"),
                "--listen-client-urls", f"http://{host}:{client}",
                "--advertise-client-urls", f"http://{host}:{client}",
                "--listen-peer-urls", f"http://{host}:{peer}",
                "--initial-advertise-peer-urls", f"http://{host}:{peer}",
                "--initial-cluster", f"rl-launch=http://{host}:{peer}",
            ],
            logs / "dynamo-etcd.log",
        ).start()  # fmt: skip
        self.runtime.append(etcd)
        nats_proc = ManagedProcess(
            "nats-server",
            [nats_bin, "-js", "-sd", str(self.data_dir / "nats"), "-a", host, "-p", str(nats)],
            logs / "dynamo-nats.log",
        ).start()
        self.runtime.append(nats_proc)
        deadline = time.monotonic() + 30
        while True:
            dead = self._dead_runtime()
            if dead:
                raise GatewayError(dead)
            if _etcd_healthy(host, client) and _accepts(host, nats):
                break
            if time.monotonic() > deadline:
                raise GatewayError(
                    f"Dynamo runtime not ready in 30 s (etcd {host}:{client}, NATS {host}:{nats}); logs "
                    f"{etcd.log}, {nats_proc.log}"
                )
            time.sleep(0.2)
        up = f"Dynamo runtime up: etcd {host}:{client}, NATS {host}:{nats} (JetStream)"
        self.context.say(up)
        self.context.job.log_event("gateway_runtime", up)  # `submit --follow` and `status` show events
        return {
            "ETCD_ENDPOINTS": f"http://{host}:{client}",
            "NATS_SERVER": f"nats://{host}:{nats}",
            # How long a dead worker stays in the frontend's instance list (its etcd lease).
            "ETCD_LEASE_TTL": str(self.options.lease_ttl_s),
        }

    def _dead_runtime(self) -> str | None:
        for proc in [*self.runtime, *([self.frontend] if self.frontend else [])]:
            code = proc.exited()
            if code is not None:
                return f"Dynamo {proc.name} exited with {code}; log {proc.log}:\n{proc.tail()}"
        return None

    # -- the frontend ------------------------------------------------------------------------------
    def frontend_command(self) -> list[str]:
        ctx, opts = self.context, self.options
        assert self.planes is not None, "prepare_engines() first"
        argv = [
            self.python, "-m", "dynamo.frontend",
            "--http-host", ctx.host,
            "--http-port", str(ctx.port),
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
        env = {**os.environ, **self.planes.env, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
        env.pop("DYN_SYSTEM_PORT", None)
        for var in ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST"):
            env[var] = ctx.host  # else Dynamo advertises the node's first interface
        self.frontend = ManagedProcess(
            "frontend", self.frontend_command(), ctx.job.logs / "dynamo-frontend.log", env
        ).start()
        self._url = f"http://{ctx.host}:{ctx.port}"
        self._serving = tuple(engine_urls)
        self._wait_ready(len(engine_urls))
        return self._url

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
                seen = len(worker_instances(_get_json(f"{self._url}/health")))
                models = [m.get("id") for m in (_get_json(f"{self._url}/v1/models").get("data") or [])]
            except (OSError, ValueError, urllib.error.URLError):
                seen, models = 0, []
            if seen >= workers and model in models:
                return
            now = time.monotonic()
            if now > deadline:
                raise GatewayError(
                    f"Dynamo frontend {self._url} not ready in {self.options.ready_timeout_s:g} s: "
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
            if self._failure is None and not self._stopped and self.frontend is not None:
                self._failure = self._dead_runtime()
            return self._failure

    def instance(self) -> str | None:
        return str(self.frontend.proc.pid) if self.frontend and self.frontend.proc else None

    def view(self) -> GatewayView:
        try:
            health = _get_json(f"{self._url}/health")
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
            f"discovery, {len(self._serving)} engine(s) serving by our probes"
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
        procs = [*([self.frontend] if self.frontend else []), *reversed(self.runtime)]
        for proc in procs:
            proc.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)


def _etcd_healthy(host: str, port: int) -> bool:
    try:
        return bool(_get_json(f"http://{host}:{port}/health", 1.0).get("health") == "true")
    except (OSError, ValueError, AttributeError, urllib.error.URLError):
        return False


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False
