"""Draining a node of the elastic fleet and handing it back to Slurm.

Split out of ``manager.py`` (issue 29: one job a module) as a mixin of ``ElasticFleet``: the node's
engines leave the serving set, their requests in flight are read from the engines' own gauges until they
read zero (twice, over ``QUIET_S``) or ``drain_timeout_s`` passes; then the host stops, the engines leave
the fleet and the node goes back (its grow job ended or shrunk, or the job holding it shrunk). Like the
grow lifecycle, these are methods of the manager because they change its one set of records on its one
thread.

A drain does not wait for what the front can move (issue 41): the moment it begins, the front is asked
to move the engines' requests in flight to the engines that stay (``Gateway.move_off``, "drained"; the
builtin router continues each from its prompt's token ids plus the tokens produced,
``router.continuation``), so the gauges read zero within a poll or two instead of when the step's longest
generations end, and the node goes back that much sooner. What the front cannot move (a front of another
kind, ``continuation_max_moves`` 0, a request it does not continue: tools, n > 1) finishes where it is,
as before: the wait below is the same.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from launcher.fleet.controller import fan_out_now
from launcher.fleet.elastic import shapes, slurm_ops
from launcher.fleet.elastic.holder import release_file
from router.fleet.engine import LOAD_GAUGES, EngineClient
from router.prometheus import metric_sum, parse_metrics

if TYPE_CHECKING:
    from launcher.fleet.controller import FleetController
    from launcher.fleet.elastic.grow import Grow, NodeRow
    from launcher.fleet.elastic.hosts import EngineHostFleet
    from launcher.jobdir import JobDir
    from launcher.steps.ray_cluster import RayCluster

ZERO_READS_TO_DRAIN = 2
QUIET_S = 0.5
"""A drain ends once in-flight reads zero this many reads in a row, spanning at least this long, after the
push that left the node out: one read may fall between a request the router sent just before that push
and the engine's counting it."""

DRAIN_POLL_S = 0.25
"""While a node drains, its engines are read this often (every tick would add up to a second to each
drain, a second of a node held for nothing)."""


@dataclass
class Drain:
    """One node draining: the push after which its engines are out, and its in-flight reads so far."""

    index: int
    started: float
    timeout_s: float
    push_mark: int
    urls: list[str]
    reason: str
    zero_reads: int = 0
    zero_since: float | None = None
    last_in_flight: int | None = None


def in_flight_of(urls: list[str], api_key: str | None, timeout_s: float = 2.0) -> dict[str, int | None]:
    """Each engine's requests running + waiting (its own gauges), None where the read failed."""

    async def read(engines: EngineClient, url: str) -> int | None:
        got = await engines.metrics_text(url)
        if got.value is None:
            return None
        metrics = parse_metrics(got.value, LOAD_GAUGES)
        return int(sum(metric_sum(metrics, g) or 0 for g in LOAD_GAUGES))

    return dict(zip(urls, fan_out_now(urls, read, timeout_s, api_key), strict=True))


class NodeDrains:
    """``ElasticFleet``'s drains, polled every ``DRAIN_POLL_S`` by ``_advance_drains``."""

    job: JobDir
    controller: FleetController
    engines: EngineHostFleet
    ray: RayCluster | None
    local: bool
    job_id: str | None
    training_nodes: list[str]
    api_key: str | None
    nodes: dict[int, NodeRow]
    grows: dict[str, Grow]
    drains: dict[int, Drain]
    _event: Callable[..., None]
    _set_grow: Callable[[Grow, str, str], None]

    def _begin_drain(self, r: NodeRow, timeout_s: float, by: str) -> None:
        reason = f"draining ({by})"
        mark = self.controller.pushes
        urls = self.controller.drain_node(r.index, reason)
        r.state, r.detail = shapes.NODE_DRAINING, reason
        self.drains[r.index] = Drain(r.index, time.time(), timeout_s, mark, urls, reason)
        moved = self._move_off(urls)
        self._event(
            "drain",
            f"node {r.name}: draining {len(urls)} engine(s), at most {timeout_s:g} s ({by}); {moved}",
            node=r.name,
            node_index=r.index,
        )

    def _move_off(self, urls: list[str]) -> str:
        """Ask the front to move the engines' requests in flight elsewhere now; what happened, in words.
        A front that cannot be asked (restarting) leaves them to finish where they are."""
        try:
            n = self.controller.gateway.move_off(urls, "drained")
        except Exception as exc:
            return f"the front could not be asked to move their requests ({exc!r}): they finish there"
        if n is None:
            return "this front does not move requests: those in flight finish there"
        counted = f" ({n} in its main process; worker processes count their own)" if n else ""
        return f"the front was asked to move their requests in flight to the engines that stay{counted}"

    def _advance_drains(self) -> None:
        if not self.drains:
            return
        waiting = {i: d for i, d in self.drains.items() if self.controller.pushes > d.push_mark}
        urls = [u for d in waiting.values() for u in d.urls]
        loads = in_flight_of(urls, self.api_key) if urls else {}
        now = time.time()
        for i, d in waiting.items():
            host_gone = self.engines.hosts.exited(i) is not None
            values = [loads.get(u) for u in d.urls]
            known = [v for v in values if v is not None]
            d.last_in_flight = sum(known) if known else None
            if host_gone or (len(known) == len(values) and sum(known) == 0):
                d.zero_reads += 1
                d.zero_since = now if d.zero_since is None else d.zero_since
            else:
                d.zero_reads, d.zero_since = 0, None
            took = now - d.started
            quiet = d.zero_reads >= ZERO_READS_TO_DRAIN and now - (d.zero_since or now) >= QUIET_S
            if host_gone or quiet:
                self._finish_node(i, f"drained in {took:.1f} s: no request left in flight")
            elif took > d.timeout_s:
                self._finish_node(
                    i,
                    f"drain timeout ({d.timeout_s:g} s): "
                    f"{'?' if d.last_in_flight is None else d.last_in_flight}"
                    " request(s) still in flight were aborted with the engines (the front retries them "
                    "elsewhere)",
                )

    def _finish_node(self, index: int, why: str, release: bool = True) -> None:
        """Stop the node's host, take its engines out of the fleet, hand the node back to Slurm."""
        self.drains.pop(index, None)
        r = self.nodes[index]
        self.engines.hosts.stop(index)
        self.controller.remove_node(index, why)
        self._forget_listing(index)
        r.state, r.released_at = shapes.NODE_RELEASED, time.time()
        r.detail = why
        released = self._release(r) if release else "its Slurm job had ended"
        self._event(
            "node_released",
            f"node {r.name}: {why}; {released}",
            node=r.name,
            node_index=index,
            held_s=round(r.released_at - r.since, 1),
        )

    def _release(self, r: NodeRow) -> str:
        """Give node ``r`` back to Slurm; what happened, in words."""
        if self.local or r.job_id is None:
            return "local mode: nothing to hand back"
        ops = slurm_ops
        if r.grow_id:
            g = self.grows[r.grow_id]
            rest = [self.nodes[i].name for i in g.indices if self.nodes[i].released_at is None]
            if not rest:
                release_file(self.job.path, g.id).touch()
                error = ops.cancel_job(r.job_id)
                self._set_grow(g, shapes.GROW_ENDED, "every node given back")
                return f"grow job {r.job_id} ended" + (f" (scancel: {error})" if error else "")
            error = ops.shrink_job(r.job_id, rest, shapes.elastic_dir(self.job.path))
            return f"grow job {r.job_id} shrunk to {', '.join(rest)}" + (
                f" (refused: {error})" if error else ""
            )
        if self.ray is not None:
            for step in self.ray.workers:
                if step.node == r.name:
                    step.stop(grace_s=10)
        keep = [*self.training_nodes] + [
            n.name
            for n in self.nodes.values()
            if n.job_id == self.job_id and n.released_at is None and n.name not in self.training_nodes
        ]
        keep = list(dict.fromkeys(keep))
        error = ops.shrink_job(r.job_id, keep, shapes.elastic_dir(self.job.path))
        if error:
            r.detail += f"; Slurm refused the resize: {error} (the node stays allocated, idle)"
            return f"Slurm refused to shrink job {r.job_id}: {error}"
        return f"job {r.job_id} shrunk to {len(keep)} node(s)"

    def _forget_listing(self, index: int) -> None:
        """The node's engines are gone: its listing leaves the engine listings (kept aside for the record)."""
        path = self.job.listing_file(index)
        try:
            os.replace(path, path.with_name(path.name + ".removed"))
        except OSError:
            pass
