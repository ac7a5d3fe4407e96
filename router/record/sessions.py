"""A record's conversations: which requests were turns of one session.

Shared by the replay of a recorded step (``launcher.bench.recorded``) and the dashboard's slowest
sessions (``launcher.status.rollouts``), so the two always agree on what a session was. A request with a
session key (``router.policies.consistent_hash.session_key``: a client header) belongs to that key's
conversation, split where it does not continue the previous prompt; a request without one (Gym 0.7 sends
none) is, with ``infer_sessions``, the next turn of the open conversation whose last prompt its own
prompt extends (the continuation test ``cache_aware`` makes), else a session of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.record.format import MAX_PREFIX_BLOCKS, RequestRecord


def extends(prev: Sequence[str], cur: Sequence[str]) -> bool:
    """Whether ``cur``'s prompt continues ``prev``'s (its chain starts with ``prev``'s whole chain; a
    chain cut at ``MAX_PREFIX_BLOCKS`` compares what both kept). No hashes on either side: trust the key."""
    if not prev or not cur:
        return True
    n = min(len(prev), MAX_PREFIX_BLOCKS)
    return len(cur) >= n and list(cur[:n]) == list(prev[:n])


def conversations(
    records: Sequence[RequestRecord], infer_sessions: bool
) -> tuple[list[tuple[str, list[RequestRecord]]], int]:
    """Records (sorted by arrival) grouped into conversations, each named; and how many session keys
    had to be split because a request did not continue the previous one."""
    keyed: dict[str, list[list[RequestRecord]]] = {}
    loose: list[list[RequestRecord]] = []
    # infer_sessions: (depth, last block hash) of each open loose conversation's last prompt -> it
    tails: dict[tuple[int, str], list[list[RequestRecord]]] = {}
    splits = 0
    for r in records:
        if r.session is not None:
            convs = keyed.setdefault(r.session, [])
            if convs and extends(convs[-1][-1].prefix, r.prefix):
                convs[-1].append(r)
            else:
                splits += bool(convs)
                convs.append([r])
            continue
        conv = _continued(r, tails) if infer_sessions else None
        if conv is None:
            conv = [r]
            loose.append(conv)
        else:
            conv.append(r)
        if infer_sessions and r.prefix:
            tails.setdefault((len(r.prefix), r.prefix[-1]), []).append(conv)
    named: list[tuple[str, list[RequestRecord]]] = []
    for key, convs in keyed.items():
        for k, conv in enumerate(convs):
            named.append((key if k == 0 else f"{key}~{k}", conv))
    named += [(f"request-{conv[0].id}", conv) for conv in loose]
    named.sort(key=lambda kc: (kc[1][0].t, kc[0]))
    return named, splits


def _continued(
    r: RequestRecord, tails: dict[tuple[int, str], list[list[RequestRecord]]]
) -> list[RequestRecord] | None:
    """The open conversation ``r`` continues: its last prompt's chain is a prefix of ``r``'s (chained
    hashes: equal at a depth means equal up to it), deepest first, and its last answer came before ``r``
    arrived (a conversation is serial). Taken off the open list: ``r`` is now its last request."""
    for depth in range(min(len(r.prefix), MAX_PREFIX_BLOCKS), 0, -1):
        convs = tails.get((depth, r.prefix[depth - 1]))
        if not convs:
            continue
        for i in range(len(convs) - 1, -1, -1):
            last = convs[i][-1]
            if last.t + (last.duration_s or 0.0) <= r.t:
                return convs.pop(i)
    return None
