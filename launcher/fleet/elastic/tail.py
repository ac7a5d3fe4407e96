"""The tail policy (``generation.elastic``): give nodes back while a step's last sessions run, take them
again when the next step starts. Pure: it sees one reading at a time and says what to do and why; the
driver's elastic manager (``launcher.fleet.elastic.manager``) does it. The bench and the tests drive the same
object with readings of their own.

Why these rules:

* **Armed by load.** A fleet is idle before its first step and between steps; shrinking then would hand
  back nodes the next step needs at once (and a grow may queue). The policy only watches for the tail
  once the step's load reached the threshold, so a quiet fleet is never shrunk for being quiet.
* **Low for a while.** In-flight requests dip between a GRPO group's turns; only a fraction that stays
  below ``shrink_below`` for ``for_s`` is the tail.
* **To a floor, at once.** In the tail, what runs are the long sessions, a handful of requests: one node's
  engines hold them. Shrinking step by step would pay a drain per node.
* **Grow back at the next step's start**: the front's weight version changed (the trainer refit: a new
  step begins), or the load climbed past ``grow_above`` of what the smaller fleet holds. The grow goes
  through Slurm's queue like any other, so it is asked for as soon as the step is known to start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class TailSettings:
    floor_nodes: int = 1
    shrink_below: float = 0.25
    """Of the fleet's capacity (serving engines x requests per engine)."""
    for_s: float = 30.0
    grow_back: bool = True
    grow_above: float = 0.75
    """Of the shrunk fleet's capacity: load that needs the nodes back within the same step."""

    def __post_init__(self) -> None:
        if self.floor_nodes < 1:
            raise ValueError(f"floor_nodes must be >= 1, got {self.floor_nodes}")
        if not 0 < self.shrink_below < 1:
            raise ValueError(f"shrink_below must be in (0, 1), got {self.shrink_below}")
        if self.for_s <= 0:
            raise ValueError(f"for_s must be > 0, got {self.for_s}")
        if not 0 < self.grow_above <= 1:
            raise ValueError(f"grow_above must be in (0, 1], got {self.grow_above}")


@dataclass(frozen=True)
class Reading:
    """The fleet at one moment, as the manager measured it."""

    now: float
    in_flight: int
    """Requests running or waiting in the serving engines (their own gauges)."""
    capacity: int
    """Serving engines x requests per engine."""
    nodes: int
    """Generation nodes serving (not draining, not released)."""
    version: str | None = None
    """The front's weight version (a change is a refit: the next step)."""
    busy: bool = False
    """A resize is under way: no new decision until it is done."""


@dataclass(frozen=True)
class Decision:
    op: Literal["shrink", "grow"]
    nodes: int
    reason: str


class TailPolicy:
    def __init__(self, settings: TailSettings) -> None:
        self.settings = settings
        self._armed = False
        self._low_since: float | None = None
        self.given_back = 0
        """Nodes the policy shrank by and has not grown back yet."""
        self._version_at_shrink: str | None = None

    def observe(self, r: Reading) -> Decision | None:
        s = self.settings
        if r.busy:
            return None
        if self.given_back and s.grow_back:
            if r.version != self._version_at_shrink and r.version is not None:
                return self._grow(
                    f"the weight version changed ({self._version_at_shrink} -> {r.version}): a new step"
                )
            if r.capacity and r.in_flight > s.grow_above * r.capacity:
                return self._grow(
                    f"in-flight {r.in_flight} > {s.grow_above:.0%} of the shrunk fleet's capacity "
                    f"{r.capacity}"
                )
        if r.nodes <= s.floor_nodes or r.capacity <= 0:
            self._low_since = None
            return None
        threshold = s.shrink_below * r.capacity
        if r.in_flight >= threshold:
            self._armed = True
            self._low_since = None
            return None
        if not self._armed:
            return None
        if self._low_since is None:
            self._low_since = r.now
            return None
        if r.now - self._low_since < s.for_s:
            return None
        low_for = r.now - self._low_since
        self._armed = False
        self._low_since = None
        n = r.nodes - s.floor_nodes
        self.given_back += n
        self._version_at_shrink = r.version
        return Decision(
            "shrink",
            n,
            f"in-flight {r.in_flight} < {s.shrink_below:.0%} of capacity {r.capacity} for {low_for:.0f} s: "
            f"the step's tail; {n} node(s) back to Slurm, {s.floor_nodes} kept",
        )

    def _grow(self, why: str) -> Decision:
        n, self.given_back = self.given_back, 0
        self._armed = False
        self._low_since = None
        return Decision("grow", n, f"{why}; {n} node(s) asked back")
