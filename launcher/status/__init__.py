"""``rl-launch status``: a live view of one job's fleet, built from its job directory plus scrapes.

``collect`` gathers a JSON-able snapshot (the same dict ``--json`` prints; Prometheus text is read by
``router.prometheus``), ``render`` turns a snapshot into a rich renderable; the click command is
``launcher.cli.status``. Collection and rendering are separate so scripts, tests and the dashboard all
see exactly the same figures.
"""

from launcher.status.charts import sparkline
from launcher.status.collect import StatusCollector, collect_snapshot
from launcher.status.render import render_snapshot

__all__ = [
    "StatusCollector",
    "collect_snapshot",
    "render_snapshot",
    "sparkline",
]
