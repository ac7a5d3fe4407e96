"""One frame of ``rl-launch status`` as the text a terminal shows (200 columns), from a snapshot."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from launcher.status.render import render_snapshot


def frame_text(snap: dict[str, Any], max_rows: int | None = None) -> str:
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(render_snapshot(snap, max_rows=max_rows))
    return console.export_text()
