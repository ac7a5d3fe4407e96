"""One verdict of ``rl-launch check``: a name, ok / FAIL / skip, what was seen, and for a failure the fix.

One shape for the login-node checks and the probes' answers, so the command prints and counts them the
same way, and ``--json`` is the same list.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

Status = Literal["ok", "FAIL", "skip"]


@dataclass(frozen=True)
class Check:
    name: str
    """What was checked, with the group where it matters (``generation engine python``)."""
    status: Status
    detail: str
    """What was seen, one line."""
    fix: str = ""
    """For a failure: what to do, naming the spec field or the command."""

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"

    def line(self) -> str:
        """One line: ``ok    name: detail`` or ``FAIL  name: detail; fix: ...``."""
        text = f"{self.status:<5} {self.name}: {self.detail}"
        return f"{text}; fix: {self.fix}" if self.failed and self.fix else text

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def ok(name: str, detail: str) -> Check:
    return Check(name, "ok", detail)


def fail(name: str, detail: str, fix: str) -> Check:
    return Check(name, "FAIL", detail, fix)


def skip(name: str, detail: str) -> Check:
    return Check(name, "skip", detail)
