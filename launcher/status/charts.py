"""Text charts the dashboard's panels share (the router's rate history, the rollouts timeline).

Its own module so the panels import it instead of each other (``render`` used to own it, and
``rollouts`` imported ``render`` back to reach it: an import circle)."""

from __future__ import annotations

import math
from collections.abc import Sequence

BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int = 60) -> str:
    """The last ``width`` values as unicode blocks, scaled to their maximum (zero = the lowest block,
    so an idle stretch still reads as a line rather than a gap)."""
    values = [v for v in values[-width:] if v is not None and math.isfinite(v)]
    if not values:
        return ""
    top = max(values)
    if top <= 0:
        return BLOCKS[0] * len(values)
    last = len(BLOCKS) - 1
    return "".join(BLOCKS[min(last, max(0, round(v / top * last)))] for v in values)
