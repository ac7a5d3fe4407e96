"""PNGs of a finished job's rollouts, from its request record: the step timeline (requests in flight and
sessions finished over time) and the per-engine load (requests in flight on each engine over time).

Written by the driver once the router has flushed its record (``Driver._write_rollout_plots``), so a user
looking at a slow job's directory sees where the tail was without re-running anything.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from router.record.format import RequestRecord, read_records
from router.record.sessions import conversations

BINS = 200
MAX_RECORD_BYTES = 128 << 20
"""A record larger than this is not plotted at the job's end (parsing it would hold up the teardown); the
record itself is kept, and ``rl-launch bench replay --trace`` still reads it."""


def _series(records: list[RequestRecord], t0: float, width: float) -> tuple[list[int], dict[str, list[int]]]:
    total = [0] * BINS
    per_engine: dict[str, list[int]] = defaultdict(lambda: [0] * BINS)
    for r in records:
        a = int((r.t - t0) / width)
        b = int((r.t + (r.duration_s or 0.0) - t0) / width)
        for i in range(max(0, a), min(BINS - 1, b) + 1):
            total[i] += 1
            if r.engine:
                per_engine[r.engine][i] += 1
    return total, dict(per_engine)


def write_job_plots(record_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """``timeline.png`` and ``engines.png`` in ``out_dir``; [] when there is no record (or it is too big)."""
    d = Path(record_dir)
    files = list(d.glob("requests*.jsonl")) if d.is_dir() else []
    if not files or sum(f.stat().st_size for f in files) > MAX_RECORD_BYTES:
        return []
    records = read_records(d).records
    if not records:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = records[0].t
    t1 = max(r.t + (r.duration_s or 0.0) for r in records)
    width = max(t1 - t0, 1e-3) / BINS
    xs = [i * width for i in range(BINS)]
    total, per_engine = _series(records, t0, width)
    done = sorted(
        max(r.t + (r.duration_s or 0.0) for r in rs) - t0 for _, rs in conversations(records, True)[0]
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(xs, total, label="requests in flight")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("in flight")
    ax2 = ax.twinx()
    ax2.plot(done, range(1, len(done) + 1), color="tab:orange", label="sessions finished")
    ax2.set_ylabel("sessions finished")
    if done:
        t90 = done[max(0, int(0.9 * len(done)) - 1)]
        ax.axvline(t90, color="grey", linestyle="--", label="90% of sessions finished")
    ax.set_title(f"{len(records)} requests, {len(done)} sessions")
    fig.legend(loc="upper right")
    fig.tight_layout()
    timeline = out / "timeline.png"
    fig.savefig(timeline, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4))
    for engine, series in sorted(per_engine.items()):
        ax.plot(xs, series, label=engine.split("//")[-1], linewidth=1)
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("requests in flight")
    ax.set_title("per-engine load")
    if len(per_engine) <= 16:
        ax.legend(fontsize="small")
    fig.tight_layout()
    engines = out / "engines.png"
    fig.savefig(engines, dpi=100)
    plt.close(fig)
    return [timeline, engines]
