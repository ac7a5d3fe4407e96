"""``rl-launch status``: a live view of one job's fleet, built from its job directory plus scrapes.

``collect`` gathers a JSON-able snapshot (the same dict ``--json`` prints), ``render`` turns a snapshot
into a rich renderable; the click command is ``launcher.cli.status``. Collection and rendering are
separate so scripts, tests and the dashboard all see exactly the same figures.
"""

from launcher.status.collect import StatusCollector, collect_snapshot, histogram_quantile, parse_metrics
from launcher.status.render import render_snapshot, sparkline

__all__ = [
    "StatusCollector",
    "collect_snapshot",
    "histogram_quantile",
    "parse_metrics",
    "render_snapshot",
    "sparkline",
]
