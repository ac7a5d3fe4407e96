"""One Serve replica = one engine instance: it starts the engine (vLLM or the simulator) on a free local
port and proxies to it, streaming.

Why a replica owns its engine process (NeMo-Gym's ``ray_serve_gateway`` design): Serve then places,
health-checks and replaces instances. ``check_health`` fails when the engine process died or its
``/health`` does not answer in time (a wedged engine), so Serve kills the replica (and, with it, the
engine's process group) and starts a fresh one.

Streaming: ``forward`` is an async generator. Its first item is ``(status, headers, replica_id, node)``,
then the body as it arrives from the engine, chunk by chunk, so SSE tokens reach the client as the engine
emits them (NeMo-Gym's proxy read whole responses).

The refit window: a replica whose engine the fleet endpoint holds out (``fleet_state``: stale, quarantined
by a refit, or joined after a stamp and not checked yet) refuses to forward, answering only a head that
carries ``HELD_OUT_HEADER``; the ingress then tries another replica without counting an attempt. The
ingress excludes held-out replicas itself; this refusal is for the replicas it cannot name (a replacement
the file does not list yet) and for Serve routing that does not honour the exclusion.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from launcher.gateways.ray_serve.fleet_state import FleetStateReader
from launcher.gateways.ray_serve.plan import ServePlan
from launcher.jobdir import write_json_atomic
from launcher.jobdir.paths import serve_registry_dir

# Hop-by-hop headers (RFC 9110 7.6.1) and what aiohttp sets itself: never forwarded either way.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
NODE_HEADER = "x-rl-launch-node"
"""Response header naming the node the answering engine runs on (placement is observable from outside)."""
REPLICA_HEADER = "x-rl-launch-replica"
"""Response header naming the Serve replica that answered (affinity is observable from outside)."""
HELD_OUT_HEADER = "x-rl-launch-held-out"
"""On a replica's refusal head only (never sent to a client): why its engine may not serve now."""
HELD_OUT_STATUS = 503


def registry_dir(job_dir: str) -> Path:
    """Where each replica records ``{replica, node, url, pid, log}`` (the job directory, shared by every
    node): the gateway's view joins these with the replicas Ray reports alive, so a record a killed
    replica could not remove is never shown."""
    path = serve_registry_dir(job_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


def engine_host_address(local: bool) -> str:
    """Where the engine listens: loopback in local mode, else this node's own address (the dashboard
    and the bench scrape engines' /metrics from other nodes)."""
    if local:
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


class EngineReplica:
    """The engines deployment's replica class (wrapped by ``serve.deployment`` in ``gateway``)."""

    def __init__(self, plan: dict[str, Any]) -> None:
        from ray import serve

        from launcher.engines.host import build_engine
        from launcher.engines.host_config import EngineHostConfig
        from launcher.engines.kinds import engine_kind

        self.plan = ServePlan(**plan)
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.node = socket.gethostname()
        rank = context.rank.rank if context.rank is not None else -1
        fields = {**self.plan.engine, **self.plan.engine_overrides.get(rank, {})}
        fields["host"] = engine_host_address(self.plan.local)
        if engine_kind(fields["kind"]).spans_nodes_with_ray:
            fields["extra_args"] = [*self.plan.executor_args, *fields.get("extra_args", [])]
            if self.plan.executor_args and "RAY_ADDRESS" not in fields.get("env", {}):
                import ray

                fields["env"] = {
                    **fields.get("env", {}),
                    "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
                }
        cfg = EngineHostConfig(**fields)
        # A stable number per replica for its log name (engine-node<n>-<i>.log in the job directory).
        self.engine = build_engine(cfg, zlib.crc32(self.replica_id.encode()) % 100_000, [])
        self.engine.start()
        pid = getattr(self.engine, "pid", None)
        if pid is not None:  # started in its own session: the engine's pid is its group id
            self.reaper = subprocess.Popen(
                [sys.executable, "-m", "launcher.gateways.ray_serve.reaper", str(os.getpid()), str(pid)],
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            self.engine.wait_ready(time.monotonic() + cfg.startup_timeout_s)
        except BaseException:
            self.engine.stop()
            raise
        self.url = self.engine.url if not getattr(self.engine, "urls", None) else self.engine.urls[0]
        self._http: aiohttp.ClientSession | None = None
        self.fleet = FleetStateReader(cfg.job_dir)
        self.record = registry_dir(cfg.job_dir) / f"{self.replica_id}.json"
        write_json_atomic(
            self.record,
            {
                "replica": self.replica_id,
                "node": self.node,
                "url": self.url,
                "pid": os.getpid(),
                "engine_pid": getattr(self.engine, "pid", None),
                "kind": cfg.kind,
                "log": str(getattr(self.engine, "log_path", "") or ""),
            },
        )

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.plan.backend_timeout_s, connect=5),
                connector=aiohttp.TCPConnector(limit=0),
                auto_decompress=False,
            )
        return self._http

    async def forward(
        self, method: str, path: str, query: str, headers: dict[str, str], body: bytes, **_: Any
    ) -> AsyncIterator[Any]:
        """Proxy one request to the engine; yields the head first, then body chunks as they come (or only a
        refusal head, when the refit window holds this replica's engine out)."""
        state = await self.fleet.get()
        why = state.refusal(self.replica_id) if state is not None else None
        if why is not None:
            yield (HELD_OUT_STATUS, [(HELD_OUT_HEADER, why), *self._where()], self.replica_id, self.node)
            return
        url = self.url + path + (f"?{query}" if query else "")
        out = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}
        async with self._session().request(
            method, url, headers=out, data=body, allow_redirects=False
        ) as resp:
            head = [(k, v) for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP]
            head += self._where()
            yield (resp.status, head, self.replica_id, self.node)
            async for chunk in resp.content.iter_any():
                yield chunk

    def _where(self) -> list[tuple[str, str]]:
        return [(NODE_HEADER, self.node), (REPLICA_HEADER, self.replica_id)]

    async def where(self) -> dict[str, Any]:
        """Which replica, on which node, serving which engine URL (the gateway's view and the tests)."""
        return {"replica": self.replica_id, "node": self.node, "url": self.url, "pid": os.getpid()}

    async def check_health(self) -> None:
        """Raise (Serve then replaces this replica) when the engine died or does not answer /health."""
        if not self.engine.is_alive():
            raise RuntimeError(f"engine {self.url} on {self.node} exited")
        try:
            async with self._session().get(
                self.url + "/health",
                timeout=aiohttp.ClientTimeout(total=self.plan.health_check_timeout_s / 2),
            ) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"engine {self.url} on {self.node}: /health answered {resp.status}")
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise RuntimeError(f"engine {self.url} on {self.node}: /health failed: {exc!r}") from exc

    def __del__(self) -> None:
        # Serve calls __del__ when it stops a replica (scale down, replacement, shutdown): the engine's
        # whole process group goes with it, never left running on the node.
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop(grace_s=5)
        record = getattr(self, "record", None)
        if record is not None:
            record.unlink(missing_ok=True)
