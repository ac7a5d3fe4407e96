"""A replay trace: its sessions and turns, its JSONL file and its figures.

One module owns the trace's shape because three parties exchange it: ``bench trace`` writes it, every
replay arm reads it back (the same requests against every front), and results record its fingerprint
and stats so two runs can be checked to share a trace. The generator that draws a trace
(``launcher.bench.workload``) is a separate concern: a recorded trace could be loaded here without it.

Token counts are estimated as chars / 4 (``CHARS_PER_TOKEN``), the same estimate the generator sizes by.
"""

from __future__ import annotations

import gzip
import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

TRACE_FORMAT_VERSION = 1
CHARS_PER_TOKEN = 4
TEMPLATE_TOKENS_PER_TURN = 24  # chat-template role headers and end tags of two messages, with slack


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a session.

    ``tool_output`` is the user/tool message appended *before* this turn's request (the result of the
    tool call made in the previous reply); it is empty on turn 0, whose request is system + task only.
    ``gap_s`` is how long the client waits after the previous answer before sending this turn (a
    recorded step's tool and think time; 0 for generated workloads, whose tools answer at once).
    """

    tool_output: str
    max_tokens: int
    gap_s: float = 0.0


@dataclass(slots=True)
class Session:
    """One rollout: its id (what Gym pins on), its GRPO group, system-prompt key, task and turns.

    ``start_s`` is when its first request is sent, in seconds after the step starts: 0 in a generated
    workload (a rollout step launches every rollout together), the recorded arrival in a recorded one.
    """

    id: str
    group: int
    system: str
    task: str
    turns: list[Turn]
    start_s: float = 0.0


@dataclass(slots=True)
class Trace:
    """A replayable workload: system prompts stored once, sessions referencing them by key."""

    workload: str
    seed: int
    scale: float
    group_size: int
    system_prompts: dict[str, str]
    sessions: list[Session]
    meta: dict[str, Any] = field(default_factory=dict)

    def system_prompt(self, session: Session) -> str:
        return self.system_prompts[session.system]

    @property
    def n_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def fingerprint(self) -> str:
        """A short content hash, recorded with results so two runs can be checked to share a trace."""
        h = hashlib.sha256()
        for key in sorted(self.system_prompts):
            h.update(key.encode())
            h.update(self.system_prompts[key].encode())
        for s in self.sessions:
            h.update(f"{s.id}|{s.group}|{s.system}|".encode())
            if s.start_s:  # only when set: generated traces keep the fingerprints results quote
                h.update(f"@{s.start_s!r}|".encode())
            h.update(s.task.encode())
            for t in s.turns:
                h.update(f"|{t.max_tokens}|".encode())
                if t.gap_s:
                    h.update(f"+{t.gap_s!r}|".encode())
                h.update(t.tool_output.encode())
        return h.hexdigest()[:16]

    def stats(self) -> dict[str, Any]:
        return trace_stats(self)


# ----------------------------------------------------------------------------------------------------
# Stats
# ----------------------------------------------------------------------------------------------------
def _tok(text: str) -> int:
    return len(text) // CHARS_PER_TOKEN


def session_work(trace: Trace, s: Session) -> int:
    """Tokens an engine processes for ``s`` with no prefix cache (replies assumed ``max_tokens`` long)."""
    ctx = _tok(trace.system_prompt(s)) + _tok(s.task)
    total = 0
    for t in s.turns:
        ctx += _tok(t.tool_output)
        total += ctx + t.max_tokens
        ctx += t.max_tokens
    return total


def trace_stats(trace: Trace) -> dict[str, Any]:
    """Turn-count quantiles, sizes and the work split; printed by ``bench trace`` and stored with results."""
    turns = np.array([len(s.turns) for s in trace.sessions])
    q = {f"p{p}": int(np.percentile(turns, p, method="nearest")) for p in (50, 90, 99)}
    works = np.array([session_work(trace, s) for s in trace.sessions], dtype=float)
    tool = [_tok(t.tool_output) for s in trace.sessions for t in s.turns[1:]]
    last_prompt = [
        _tok(trace.system_prompt(s))
        + _tok(s.task)
        + sum(_tok(t.tool_output) + t.max_tokens + TEMPLATE_TOKENS_PER_TURN for t in s.turns)
        for s in trace.sessions
    ]
    out: dict[str, Any] = {
        "workload": trace.workload,
        "seed": trace.seed,
        "scale": trace.scale,
        "group_size": trace.group_size,
        "sessions": len(trace.sessions),
        "groups": len({s.group for s in trace.sessions}),
        "requests": int(turns.sum()),
        "turns_min": int(turns.min()),
        "turns_p50": q["p50"],
        "turns_p90": q["p90"],
        "turns_p99": q["p99"],
        "turns_max": int(turns.max()),
        "system_prompt_tokens": sum(_tok(p) for p in trace.system_prompts.values()),
        "tool_tokens_p50": int(np.median(tool)) if tool else 0,
        "tool_tokens_max": max(tool) if tool else 0,
        "work_tokens": int(works.sum()),
        "max_context_tokens_est": max(last_prompt),
        "squeezed_sessions": trace.meta.get("squeezed_sessions"),
        "fingerprint": trace.fingerprint(),
    }
    starts = [s.start_s for s in trace.sessions if s.start_s]
    gaps = [t.gap_s for s in trace.sessions for t in s.turns if t.gap_s]
    if starts:  # a recorded step: sessions arrive over time, turns wait for their tools
        out["start_span_s"] = round(max(starts), 3)
    if gaps:
        out["gaps"] = len(gaps)
        out["gap_s_total"] = round(sum(gaps), 3)
    short = np.array(["-short" in s.id for s in trace.sessions])
    if short.any() and (~short).any():
        out["short_sessions"] = int(short.sum())
        out["short_work_share"] = round(float(works[short].sum() / works.sum()), 4)
    return out


# ----------------------------------------------------------------------------------------------------
# JSONL persistence
# ----------------------------------------------------------------------------------------------------
def _open(path: Path, mode: str) -> io.BufferedIOBase:
    if path.suffix == ".gz":
        return gzip.open(path, mode + "b")  # type: ignore[return-value]
    return open(path, mode + "b")


def save_trace(trace: Trace, path: str | Path) -> Path:
    """Write JSONL: one header line (workload parameters, system prompts once), then one line a session.

    Turns are stored as ``[tool_output, max_tokens]`` pairs to keep the file small (``[tool_output,
    max_tokens, gap_s]`` when the turn waits, and a session's ``start_s`` only when it is not 0, so
    generated traces are written as before); a ``.gz`` suffix compresses it (filler text compresses ~4x).
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    header = {
        "type": "header",
        "version": TRACE_FORMAT_VERSION,
        "workload": trace.workload,
        "seed": trace.seed,
        "scale": trace.scale,
        "group_size": trace.group_size,
        "meta": trace.meta,
        "system_prompts": trace.system_prompts,
    }
    with _open(p, "w") as f:
        f.write(orjson.dumps(header) + b"\n")
        for s in trace.sessions:
            rec: dict[str, Any] = {
                "id": s.id,
                "group": s.group,
                "system": s.system,
                "task": s.task,
                "turns": [
                    [t.tool_output, t.max_tokens, t.gap_s] if t.gap_s else [t.tool_output, t.max_tokens]
                    for t in s.turns
                ],
            }
            if s.start_s:
                rec["start_s"] = s.start_s
            f.write(orjson.dumps(rec) + b"\n")
    return p


def load_trace(path: str | Path) -> Trace:
    p = Path(path)
    with _open(p, "r") as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{p}: empty trace file")
    header = orjson.loads(lines[0])
    if header.get("type") != "header" or header.get("version") != TRACE_FORMAT_VERSION:
        raise ValueError(f"{p}: not a rl-launch trace (version {TRACE_FORMAT_VERSION}) header")
    sessions = []
    for ln in lines[1:]:
        rec = orjson.loads(ln)
        if rec["system"] not in header["system_prompts"]:
            raise ValueError(f"{p}: session {rec['id']} references unknown system prompt {rec['system']!r}")
        sessions.append(
            Session(
                id=rec["id"],
                group=int(rec["group"]),
                system=rec["system"],
                task=rec["task"],
                turns=[Turn(str(t[0]), int(t[1]), float(t[2]) if len(t) > 2 else 0.0) for t in rec["turns"]],
                start_s=float(rec.get("start_s") or 0.0),
            )
        )
    return Trace(
        workload=header["workload"],
        seed=int(header["seed"]),
        scale=float(header["scale"]),
        group_size=int(header["group_size"]),
        system_prompts=dict(header["system_prompts"]),
        sessions=sessions,
        meta=dict(header.get("meta") or {}),
    )
