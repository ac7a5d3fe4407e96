"""The example GRPO trainer's per-step record and the files it leaves: ``metrics.json``, ``metrics.csv``,
``reward.png``.

Why a module of its own: what a step measured (``StepRecord``) is the one shape both the loop
(``train.py``, which fills it) and the outputs (written here) depend on, and the outputs are read by tests
and people after the job, so their format lives in one place apart from the loop that produces them.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class StepRecord:
    """What one step measured: one row of ``metrics.csv``, one entry of ``metrics.json``'s ``steps``."""

    step: int
    version: str
    reward_mean: float
    samples: int
    dropped: int
    seconds: dict[str, float] = field(default_factory=dict)
    update: dict[str, float] = field(default_factory=dict)
    versions_seen: dict[str, int] = field(default_factory=dict)
    refit_phases: dict[str, float] = field(default_factory=dict)
    served_seen: dict[str, int] = field(default_factory=dict)
    """LoRA mode: the response bodies' ``model`` (``NAME@step-k``) of the step's samples, counted."""
    quarantined: dict[str, str] = field(default_factory=dict)
    target_mass: float | None = None
    """After the step's update: the trainer's weights' probability of a target token as the next token of
    fixed held-out prompts (``train.MASS_PROMPTS``), the expected reward without the sampling noise."""


def write_outputs(out: Path, records: list[StepRecord], extra: dict[str, Any]) -> None:
    """``metrics.json`` (everything) and ``metrics.csv`` (one row a step), rewritten every step so a job
    stopped midway still has its curve."""
    rows = [asdict(r) for r in records]
    (out / "metrics.json").write_text(json.dumps({**extra, "steps": rows}, indent=1))
    with (out / "metrics.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "version", "reward_mean", "samples", "dropped", *sorted(records[0].seconds)])
        for r in records:
            w.writerow(
                [
                    r.step,
                    r.version,
                    f"{r.reward_mean:.4f}",
                    r.samples,
                    r.dropped,
                    *(f"{r.seconds[k]:.3f}" for k in sorted(r.seconds)),
                ]
            )


def write_plot(out: Path, records: list[StepRecord], title: str) -> Path | None:
    """``reward.png`` with matplotlib, as the project's other plots are drawn (``launcher.record.plots``);
    None without matplotlib (the JSON and CSV have the curve)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("grpo: no matplotlib here, no plot (metrics.json and metrics.csv have the curve)")
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        ax.plot([r.step for r in records], [r.reward_mean for r in records], marker="o")
        ax.set_xlabel("step")
        ax.set_ylabel("mean reward (share of target tokens)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "reward.png")
    finally:
        plt.close(fig)
    return out / "reward.png"
