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
    to do, and the line in the file when known."""

    path: str
    message: str
    line: int | None = None


class SpecError(ValueError):
    """A spec that cannot run. ``str()`` is one line per problem, each ``FILE[:LINE]: PATH: MESSAGE``,
    so editors and terminals can jump to it; ``issues`` holds them for programs."""

    def __init__(self, source: str, issues: Sequence[Issue]) -> None:
        self.source = source
        self.issues = tuple(sorted(issues, key=lambda i: (i.line is None, i.line or 0, i.path)))
        super().__init__(self._format())

    def _format(self) -> str:
        lines = []
        for issue in self.issues:
            where = f"{self.source}:{issue.line}" if issue.line else self.source
            lines.append(
                f"{where}: {issue.path}: {issue.message}" if issue.path else f"{where}: {issue.message}"
            )
        if len(lines) > 1:
            lines.insert(0, f"{self.source}: {len(lines)} problems in the job spec:")
            return "\n  ".join(lines)
        return lines[0] if lines else f"{self.source}: invalid job spec"
