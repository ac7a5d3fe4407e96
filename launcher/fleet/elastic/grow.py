"""The grow lifecycle of the elastic fleet: a grow job's nodes become generation nodes, join, or end.

Split out of ``manager.py`` (issue 29: one job a module) as a mixin of ``ElasticFleet``: a grow moves
PENDING (its Slurm job queues; the reason is shown) -> STARTING (one engine host per node, started into
the grow job) -> JOINED (every host published its engines and the controller took them), or ends
FAILED / CANCELLED / ENDED with the reason, its hosts stopped and its allocation handed back. The methods
read and write the manager's own records (``nodes``, ``grows``) on the manager's one thread, so they stay
methods of it rather than a second object with a copy of that state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from launcher.fleet.elastic import shapes, slurm_ops

if TYPE_CHECKING:
    from launcher.fleet.controller import FleetController
    from launcher.fleet.elastic.hosts import EngineHostFleet
    from launcher.jobdir import JobDir
    from launcher.spec import ResolvedSpec


@dataclass
class NodeRow:
    """One generation node of the fleet, from when it is held until it goes back to Slurm."""

    index: int
    name: str
    job_id: str | None
    """The Slurm job holding it (the fleet's own or a grow); None in local mode."""
    since: float
    state: str = shapes.NODE_SERVING
    grow_id: str = ""
    released_at: float | None = None
    detail: str = ""


@dataclass
class Grow:
    """One grow request: its Slurm job (None in local mode), where it stands and why."""

    id: str
    nodes: int
    by: str
    requested_at: float
    job_id: str | None = None
    state: str = shapes.GROW_PENDING
    reason: str = ""
    started_at: float | None = None
    indices: list[int] = field(default_factory=list)
    detail: str = ""


class GrowLifecycle:
    """``ElasticFleet``'s grow lifecycle, advanced once a tick by ``_advance_grows``."""

    spec: ResolvedSpec
    job: JobDir
    controller: FleetController
    engines: EngineHostFleet
    nodes: dict[int, NodeRow]
    grows: dict[str, Grow]
    _event: Callable[..., None]
    _finish_node: Callable[..., None]
    _forget_listing: Callable[[int], None]

    def _start_hosts(self, g: Grow, names: list[str]) -> None:
        """The grow's nodes become generation nodes (new indices, never reused) and get their hosts."""
        g.state, g.started_at, g.reason = shapes.GROW_STARTING, time.time(), ""
        for name in names:
            index = len(self.engines.generation_nodes)
            self.engines.generation_nodes.append(name)
            if g.job_id is not None:
                self.engines.node_jobs[index] = g.job_id
            g.indices.append(index)
            self.nodes[index] = NodeRow(index, name, g.job_id, time.time(), grow_id=g.id, detail="starting")
            self.engines.hosts.launch(index)
        self._event(
            "grow_starting",
            f"grow {g.id}: engine hosts starting on {', '.join(names)}",
            grow_id=g.id,
            nodes=names,
        )

    def _advance_grows(self) -> None:
        for g in list(self.grows.values()):
            if g.state == shapes.GROW_PENDING and g.job_id is not None:
                got = slurm_ops.grow_job_state(g.job_id)
                if got is None:
                    continue
                if got.state == "RUNNING" and got.nodes:
                    self._start_hosts(g, list(got.nodes))
                elif got.state in ("PENDING", "CONFIGURING"):
                    if got.reason != g.reason:
                        g.reason = got.reason
                        self._event(
                            "grow_pending",
                            f"grow {g.id}: Slurm job {g.job_id} PENDING ({got.reason})",
                            grow_id=g.id,
                            reason=got.reason,
                        )
                else:
                    self._end_grow(g, shapes.GROW_FAILED, f"Slurm job {g.job_id} is {got.state or 'gone'}")
            elif g.state == shapes.GROW_STARTING:
                self._check_starting(g)
            elif g.state == shapes.GROW_JOINED and g.job_id is not None:
                live = [i for i in g.indices if self.nodes[i].released_at is None]
                if live and self._grow_job_gone(g):
                    self._grow_job_lost(g, live)

    def _check_starting(self, g: Grow) -> None:
        deadline = (g.started_at or 0) + self.spec.generation.startup_timeout_s + 60
        errors = []
        ready = 0
        for i in g.indices:
            listing = self.job.read_listing(i)
            code = self.engines.hosts.exited(i)
            if listing is not None and listing.error:
                errors.append(f"{self.nodes[i].name}: {str(listing.error).strip()[-300:]}")
            elif listing is not None:
                ready += 1
            elif code is not None:
                errors.append(
                    f"{self.nodes[i].name}: engine host exited with {code}: "
                    f"{self.engines.hosts.describe(i)[-300:]}"
                )
        if errors:
            self._end_grow(g, shapes.GROW_FAILED, "engines failed to start: " + "; ".join(errors))
            return
        if ready < len(g.indices):
            if time.time() > deadline:
                self._end_grow(
                    g, shapes.GROW_FAILED, f"engines not ready within {deadline - (g.started_at or 0):.0f} s"
                )
            return
        engines = []
        for i in g.indices:
            engines += self.controller.add_node(i, f"joined with grow {g.id}")
            self.nodes[i].detail = ""
        g.state = shapes.GROW_JOINED
        self._event(
            "grow_joined",
            f"grow {g.id}: {len(engines)} engine(s) joined the fleet on "
            f"{', '.join(self.nodes[i].name for i in g.indices)} "
            f"({time.time() - (g.started_at or g.requested_at):.1f} s after the nodes were allocated)",
            grow_id=g.id,
            engines=engines,
        )

    def _grow_job_gone(self, g: Grow) -> bool:
        got = slurm_ops.grow_job_state(g.job_id or "")
        return got is not None and got.state not in ("RUNNING", "COMPLETING", "CONFIGURING")

    def _grow_job_lost(self, g: Grow, live: list[int]) -> None:
        """The grow job ended under the fleet (its time limit, a scancel): its engines leave as drained
        ones would, the controller having seen their hosts die."""
        for i in live:
            self.controller.drain_node(i, f"grow {g.id}'s Slurm job ended")
            self._finish_node(i, f"grow {g.id}'s Slurm job {g.job_id} ended", release=False)
        self._set_grow(g, shapes.GROW_ENDED, f"Slurm job {g.job_id} ended")

    def _end_grow(self, g: Grow, state: str, why: str) -> None:
        """A grow that never joined: stop what it started, hand back its allocation."""
        for i in g.indices:
            self.engines.hosts.stop(i, grace_s=5)
            self._forget_listing(i)
            row = self.nodes[i]
            if row.released_at is None:
                row.released_at, row.state = time.time(), shapes.NODE_RELEASED
        if g.job_id is not None:
            error = slurm_ops.cancel_job(g.job_id)
            if error:
                why += f" (scancel {g.job_id}: {error})"
        self._set_grow(g, state, why)

    def _set_grow(self, g: Grow, state: str, why: str) -> None:
        g.state, g.detail = state, why
        self._event(f"grow_{state.lower()}", f"grow {g.id}: {state}: {why}", grow_id=g.id, level="info")
