"""Per-token weight-version spans: which weights made which tokens of one answer.

A keep-mode refit lets a request go on with new weights, and a move may land on an engine with another
version; a trainer that masks or weights tokens by the policy that sampled them needs the token where
that happened, not only "this request straddled". The router knows the version of each engine it
dispatches to (``router.state.versions``) and is told when an engine's version changes
(``moves.Watch.on_version``); a span starts at each of those, at the count of tokens the router had
received by then (a token the engine made just before the stamp but the router read just after is put
on the new version: the router cannot see inside the engine's batch).

Spans are ``[version, first, last]``, token indexes of the completion, inclusive; on the answer as the
header ``x-rl-weight-versions: v3:0-117,v4:118-240`` and the body field ``weight_versions``
(``[["v3", 0, 117], ["v4", 118, 240]]``). An unknown version (an engine never stamped) is ``null`` in the
body and ``unknown`` in the header.
"""

from __future__ import annotations

from typing import Any

UNKNOWN = "unknown"


class Spans:
    def __init__(self, version: str | None) -> None:
        self._starts: list[tuple[str | None, int]] = [(version, 0)]

    def change(self, version: str | None, at: int) -> None:
        """From token ``at`` on, tokens are made by ``version``."""
        last, start = self._starts[-1]
        if version == last:
            return
        if start == at:  # nothing made on the previous version since it began: replaced
            self._starts[-1] = (version, at)
            if len(self._starts) > 1 and self._starts[-2][0] == version:
                self._starts.pop()
            return
        self._starts.append((version, at))

    def spans(self, produced: int) -> list[list[Any]]:
        """The spans of an answer of ``produced`` tokens (none for an empty one)."""
        out: list[list[Any]] = []
        for i, (version, start) in enumerate(self._starts):
            end = self._starts[i + 1][1] - 1 if i + 1 < len(self._starts) else produced - 1
            if end >= start:
                out.append([version, start, end])
        return out

    def header(self, produced: int) -> str:
        return ",".join(f"{v if v is not None else UNKNOWN}:{a}-{b}" for v, a, b in self.spans(produced))


def parse_header(value: str) -> list[list[Any]]:
    """``x-rl-weight-versions`` back into spans (for clients and tests); a version may hold ``:``."""
    out: list[list[Any]] = []
    for part in filter(None, (p.strip() for p in value.split(","))):
        version, _, rng = part.rpartition(":")
        first, _, last = rng.partition("-")
        out.append([None if version == UNKNOWN else version, int(first), int(last)])
    return out
