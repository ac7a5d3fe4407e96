"""Spec errors: one ``Issue`` per problem, and ``SpecError`` that prints them one per line with the fix.

Kept apart from the schema so the loader, the rules and the CLI share one shape without importing each
other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Issue:
    """One problem: the dotted field path (``generation.tensor_parallel_size``), what is wrong and what
    to do, and the line in the file when known.

    ``warning``: a problem that can be right where the job runs (the login node cannot see what a compute
    node will: a model directory, a site's default container mounts); ``validate`` prints it and exits 0,
    ``validate --strict`` fails on it."""

    path: str
    message: str
    line: int | None = None
    warning: bool = False

    def text(self, source: str) -> str:
        """``FILE[:LINE]: [warning: ]PATH: MESSAGE``, the line editors and terminals jump to."""
        where = f"{source}:{self.line}" if self.line else source
        what = f"{self.path}: {self.message}" if self.path else self.message
        return f"{where}: warning: {what}" if self.warning else f"{where}: {what}"


class SpecError(ValueError):
    """A spec that cannot run. ``str()`` is one line per problem, each ``FILE[:LINE]: PATH: MESSAGE``,
    so editors and terminals can jump to it; ``issues`` holds them for programs."""

    def __init__(self, source: str, issues: Sequence[Issue]) -> None:
        self.source = source
        self.issues = tuple(sorted(issues, key=lambda i: (i.line is None, i.line or 0, i.path)))
        super().__init__(self._format())

    def _format(self) -> str:
        lines = [issue.text(self.source) for issue in self.issues]
        if len(lines) > 1:
            warned = sum(i.warning for i in self.issues)
            also = f" ({warned} of them warnings)" if warned else ""
            lines.insert(0, f"{self.source}: {len(lines)} problems in the job spec{also}:")
            return "\n  ".join(lines)
        return lines[0] if lines else f"{self.source}: invalid job spec"
