"""Record -> workload: a job's recorded requests (``router.record.format``) as a replayable ``Trace``.

Why: a generated workload reproduces the *shape* of a step the bench's authors had in mind; a record is
the shape of the step a user actually ran (how many sessions, how they arrived, how long each prompt and
answer was, what they shared). Replaying it against every arm answers "what would another policy or
front have done to *my* step", which no synthetic trace can.

A record holds no text (only block hashes of each prompt, see ``router.record.format``), so the text is
synthesized, deterministically, to keep what routing and prefix caching depend on:

* **sessions**: records grouped by ``session``, each group split where a request does not extend the
  previous one's prompt (a new conversation under the same key); a record with no session is a one-turn
  session (or, with ``infer_sessions``, joins the conversation whose previous prompt it extends, the
  continuation test ``cache_aware`` itself makes);
* **pacing**: each session starts at its first request's recorded arrival, and a turn that waited
  longer than ``gap_min_s`` after the previous answer waits as long again (``Turn.gap_s``); shorter
  gaps are the client's own overhead, which the replay client has too;
* **lengths**: prompt and output tokens from the engine's usage (``prompt_tokens``,
  ``completion_tokens``), else ``prompt_bytes / 4`` and ``max_tokens``. A turn's tool output is sized so
  that its prompt (previous prompt + the answer as returned + the tool output, as a real conversation
  grows) has the recorded token count *on the simulator's chat template*: against the simulator the
  replayed token totals are the recorded ones; a real engine's template differs by a few tokens a turn;
* **shared prefixes**: requests whose hash chains share their first k blocks get prompts whose first k
  blocks are identical text (a block's text is derived from its hash). Sessions whose first requests
  share their first block share a system prompt: the blocks common to all of them (the longest common
  chain), as long as those blocks hold (at most what the shortest first prompt leaves); the task is
  the rest.

Only answered requests (2xx) are replayed; the others, and what the read skipped (a line cut short by a
killed job, lines of another format version), are reported, never silently dropped.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import itertools
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from launcher.bench.report import time_to_fraction
from launcher.bench.trace import CHARS_PER_TOKEN, Session, Trace, Turn
from router.record.format import MAX_PREFIX_BLOCKS, ReadReport, RequestRecord, read_records, record_files
from router.record.sessions import conversations

RECORD_DIR = "record"
"""A job's record directory, ``<job_dir>/record`` (``router.record.format`` names the files in it)."""

GAP_MIN_S = 0.05
DEFAULT_COMPLETION_TOKENS = 64
"""Output length of a record that reports neither ``completion_tokens`` nor ``max_tokens`` (the
simulator's ``default_max_tokens``: what it would have generated for such a request)."""
SIM_MAX_MODEL_LEN = 32768
_POOL_SEED = 20261202
_POOL_CHARS = 1 << 20


# ----------------------------------------------------------------------------------------------------
# Where a --trace argument points
# ----------------------------------------------------------------------------------------------------
def is_trace_file(path: Path) -> bool:
    """Whether ``path`` is a saved bench trace (its first line is the trace header), not a record."""
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as f:
            first = f.readline()
        head = orjson.loads(first)
    except (OSError, ValueError, EOFError):
        return False
    return isinstance(head, dict) and head.get("type") == "header"


def resolve_trace_source(arg: str, root: Path) -> tuple[str, Path]:
    """``("trace", file)`` for a saved trace, ``("record", path)`` for a record file or directory.

    ``arg`` is a saved trace, one record file, a record directory, a job directory (its ``record/``), or
    a job's name or id under ``root``. Raises ``LookupError`` (no such job) or ``ValueError`` (found, but
    nothing to replay there) with a one-line message."""
    from launcher.jobdir.lookup import find_job

    p = Path(arg).expanduser()
    if p.is_file():
        return ("trace" if is_trace_file(p) else "record"), p
    if p.is_dir():
        if (p / RECORD_DIR).is_dir():
            p = p / RECORD_DIR
        if not record_files(p):
            raise ValueError(f"{p}: no request record here (requests*.jsonl); is the router recording?")
        return "record", p
    job = find_job(arg, root)
    rec = job / RECORD_DIR
    if not record_files(rec):
        raise ValueError(f"job {job.name}: no request record under {rec} (requests*.jsonl)")
    return "record", rec


# ----------------------------------------------------------------------------------------------------
# Synthetic text
# ----------------------------------------------------------------------------------------------------
@functools.cache
def _pool() -> str:
    """One fixed ASCII filler text (the workloads' vocabulary); every synthesized text is a slice of it."""
    from launcher.bench.workload import _text

    return _text(np.random.default_rng(_POOL_SEED), _POOL_CHARS // CHARS_PER_TOKEN)


def _seed(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def _filler(key: str, chars: int) -> str:
    """``chars`` characters of filler chosen by ``key``: the same key and size, the same text."""
    if chars <= 0:
        return ""
    pool = _pool()
    if chars >= len(pool):
        return (pool * (chars // len(pool) + 1))[:chars]
    off = _seed(key) % (len(pool) - chars)
    return pool[off : off + chars]


def _block_text(block: str, chars: int) -> str:
    """The text standing for one recorded block: tagged with its hash, so two blocks get the same text
    only when they had the same hash (two slices of the pool could otherwise coincide)."""
    tag = f"{_seed(block):016x}"[:8] + " "
    return (tag + _filler(block, chars - len(tag)))[:chars] if chars > 0 else ""


def _chain_text(blocks: Sequence[str], chars: int, tail_key: str, per: int) -> str:
    """Text of ``chars`` characters whose successive ``per``-sized pieces stand for ``blocks``: cut
    short, or continued with filler keyed by ``tail_key``, to the exact size. ``per`` must not depend on
    the request, or two requests sharing a block would get different texts for it."""
    if not blocks:
        return _filler(tail_key, chars)
    per = max(CHARS_PER_TOKEN, _round4(per))
    text = "".join(_block_text(b, per) for b in blocks)
    if len(text) >= chars:
        return text[:chars]
    return text + _filler(tail_key, chars - len(text))


def _round4(chars: float) -> int:
    return int(chars) // CHARS_PER_TOKEN * CHARS_PER_TOKEN


@functools.cache
def _template_tokens() -> tuple[int, int]:
    """(tokens of a system + user prompt with empty contents, tokens one more answer + tool message add)
    on the simulator's chat template, the one the replayed prompt lengths are sized for."""
    from launcher.engines.sim.tokens import render_chat

    def msg(role: str) -> dict[str, str]:
        return {"role": role, "content": ""}

    first = len(render_chat([msg("system"), msg("user")]))
    more = len(render_chat([msg("system"), msg("user"), msg("assistant"), msg("user")])) - first
    return first, more


# ----------------------------------------------------------------------------------------------------
# Record -> trace
# ----------------------------------------------------------------------------------------------------
@dataclass
class RecordedStep:
    """A record turned into a trace, with what the read and the conversion left out, and the recorded
    step's own figures (sessions, requests, tokens, hit rate, times) to set each replayed arm beside."""

    trace: Trace
    source: str
    read_summary: str
    skipped: dict[str, int]
    left_out: dict[str, int]
    notes: list[str]
    figures: dict[str, Any]
    requests: list[tuple[float, float, str | None]] = field(repr=False, default_factory=list)
    """(start, end, engine) of every replayed record, seconds after the first arrival: the plots'
    recorded line."""
    session_ends: list[float] = field(repr=False, default_factory=list)

    def summary_lines(self) -> list[str]:
        """What a replay report prints about its record: what was read and what was not, and why."""
        f = self.figures
        lines = [f"record {self.source}: {self.read_summary}"]
        for why, n in sorted(self.left_out.items()):
            lines.append(f"  not replayed: {n} {why}")
        lines += [f"  note: {n}" for n in self.notes]
        hit = "-" if f.get("hit_rate") is None else f"{100 * f['hit_rate']:.1f}%"
        t90 = "-" if f.get("t90_s") is None else f"{f['t90_s']:.2f}s"
        lines.append(
            f"  recorded step: {f['sessions']} sessions, {f['requests']} requests, "
            f"{f['prompt_tokens']} prompt + {f['completion_tokens']} completion tokens, "
            f"cached {hit}, t90 {t90}, wall {f['wall_s']:.2f}s, peak in-flight {f['peak_in_flight']}"
        )
        return lines

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "read": self.read_summary,
            "skipped": dict(self.skipped),
            "left_out": dict(self.left_out),
            "notes": list(self.notes),
            "figures": dict(self.figures),
        }


def _prompt_tokens(r: RequestRecord) -> int:
    if r.prompt_tokens is not None:
        return int(r.prompt_tokens)
    return max(1, r.prompt_bytes // CHARS_PER_TOKEN)


def _completion_tokens(r: RequestRecord) -> int:
    if r.completion_tokens is not None:
        return int(r.completion_tokens)
    return int(r.max_tokens) if r.max_tokens else DEFAULT_COMPLETION_TOKENS


def step_from_records(
    report: ReadReport,
    source: str = "",
    *,
    gap_min_s: float = GAP_MIN_S,
    infer_sessions: bool = True,
    name: str = "recorded",
) -> RecordedStep:
    """The trace a record replays as (see the module's docstring); raises ``ValueError`` when nothing in
    it can be replayed, saying what the read found."""
    left_out: Counter[str] = Counter()
    kept: list[RequestRecord] = []
    for r in report.records:
        if 200 <= r.status < 300:
            kept.append(r)
        else:
            left_out["request(s) not answered 2xx (a replay sends only what was served)"] += 1
    if not kept:
        raise ValueError(f"{source or 'record'}: nothing to replay ({report.summary()})")
    kept.sort(key=lambda r: r.t)
    t_base = kept[0].t
    convs, splits = conversations(kept, infer_sessions)
    first_tokens, more_tokens = _template_tokens()
    notes: list[str] = []
    if splits:
        notes.append(
            f"{splits} session key(s) carried more than one conversation (a request that does not "
            "continue the previous prompt): each is its own session"
        )
    loose = sum(r.session is None for r in kept)
    if loose and not infer_sessions:
        notes.append(
            f"{loose} request(s) without a session key (Gym sends none): each replays as a one-turn "
            "session at its recorded time (--no-infer-sessions), so a router sees prompts, not "
            "conversations; the default joins each to the conversation whose prompt it continues"
        )
    if not any(r.prefix for r in kept):
        notes.append("no prefix hashes in the record: which prompts shared what is unknown; none share")
    if any(r.prompt_tokens is None for r in kept):
        n = sum(r.prompt_tokens is None for r in kept)
        notes.append(f"{n} request(s) without usage: prompt sized as prompt_bytes / {CHARS_PER_TOKEN}")

    # System prompts: conversations whose first prompts share their first block share one system prompt,
    # the blocks common to all of them, sized by the share of the first prompt those blocks are.
    def chain(r: RequestRecord) -> list[str]:
        return list(r.prefix) if r.prefix else [f"request:{r.id}"]

    # Characters a recorded block stands for: about the router's block size. A block holds at most
    # that (less at the end of a message), so no whole chain's prompt has more per block than it does:
    # the most any has is a floor, and it makes every prompt whose chain another extends a byte prefix of
    # that one's text (cut short, never padded with filler the other lacks). A first prompt (a system
    # prompt and a task, each ending inside a block) loses about one block to its two partial ones, so
    # its characters over its blocks less one are the closer estimate where it is larger.
    per_block = [
        max(0, _prompt_tokens(r) - first_tokens) * CHARS_PER_TOKEN / len(r.prefix)
        for r in kept
        if 0 < len(r.prefix) < MAX_PREFIX_BLOCKS
    ]
    per_block += [
        max(0, _prompt_tokens(c[0]) - first_tokens) * CHARS_PER_TOKEN / (len(c[0].prefix) - 1)
        for _, c in convs
        if 2 < len(c[0].prefix) < MAX_PREFIX_BLOCKS
    ]
    block_chars = _round4(max(per_block)) + CHARS_PER_TOKEN if per_block else 1024

    groups: dict[str, list[list[RequestRecord]]] = {}
    for _, conv in convs:
        groups.setdefault(chain(conv[0])[0], []).append(conv)
    system_of: dict[str, str] = {}  # first block -> system key
    system_prompts: dict[str, str] = {}
    for i, (head, members) in enumerate(groups.items()):
        chains = [chain(c[0]) for c in members]
        if len(members) > 1:
            depth = 0
            while all(len(ch) > depth and ch[depth] == chains[0][depth] for ch in chains):
                depth += 1
        else:
            depth = max(1, len(chains[0]) - 1)
        # The system prompt is what its blocks hold (``block_chars`` each), but never more than the
        # shortest member's first prompt leaves for a one-token task: a system prompt ends inside its
        # last block, and the shortest task shows how far at most. (Sizing it by the blocks' share of
        # the first prompt instead undercounts it by the tasks' partial blocks: 10% at 6 blocks.) It is
        # the first characters of every member's whole chain text (below), so a member's task
        # continues it as its blocks did.
        room = min(_prompt_tokens(c[0]) - first_tokens - 1 for c in members) * CHARS_PER_TOKEN
        chars = max(0, min(depth * block_chars, _round4(room)))
        key = f"sys{i}"
        system_prompts[key] = _chain_text(chains[0][:depth], chars, f"system:{head}", block_chars)
        system_of[head] = key

    sessions: list[Session] = []
    groups_seen: dict[tuple[Any, ...], int] = {}
    over_context = 0
    short_of_prompt = 0
    for sid, conv in convs:
        r0 = conv[0]
        ch0 = chain(r0)
        key = system_of[ch0[0]]
        system_tokens = len(system_prompts[key]) // CHARS_PER_TOKEN
        task_tokens = _prompt_tokens(r0) - first_tokens - system_tokens
        if task_tokens < 1:
            short_of_prompt += 1
            task_tokens = 1
        system_chars = system_tokens * CHARS_PER_TOKEN
        whole = _chain_text(ch0, system_chars + task_tokens * CHARS_PER_TOKEN, f"task:{ch0[-1]}", block_chars)
        task = whole[system_chars:]
        predicted = first_tokens + system_tokens + task_tokens  # the replay's prompt, on the sim template
        turns: list[Turn] = []
        for k, r in enumerate(conv):
            tool = ""
            gap = 0.0
            if k > 0:
                prev = conv[k - 1]
                answer = turns[-1].max_tokens
                tool_tokens = _prompt_tokens(r) - predicted - answer - more_tokens
                if tool_tokens < 0:
                    short_of_prompt += 1
                    tool_tokens = 0
                predicted += answer + more_tokens + tool_tokens
                tool = _filler(f"tool:{chain(r)[-1]}:{tool_tokens}", tool_tokens * CHARS_PER_TOKEN)
                if prev.duration_s is not None:
                    waited = r.t - (prev.t + prev.duration_s)
                    gap = round(waited, 4) if waited >= gap_min_s else 0.0
            out = max(1, _completion_tokens(r))
            if predicted + out > SIM_MAX_MODEL_LEN:
                over_context += 1
            turns.append(Turn(tool, out, gap))
        group = groups_seen.setdefault((tuple(ch0), _prompt_tokens(r0)), len(groups_seen))
        sessions.append(Session(sid, group, key, task, turns, start_s=round(r0.t - t_base, 4)))
    if short_of_prompt:
        notes.append(
            f"{short_of_prompt} turn(s) recorded shorter than the previous prompt plus its answer (a "
            "truncated context?): replayed with an empty tool output, so a little longer"
        )
    if over_context:
        notes.append(
            f"{over_context} request(s) longer than the simulator's context (max_model_len "
            f"{SIM_MAX_MODEL_LEN}; --sim-opt max_model_len=N): a simulated engine refuses them"
        )

    trace = Trace(
        workload=name,
        seed=0,
        scale=1.0,
        group_size=1,
        system_prompts=system_prompts,
        sessions=sessions,
        meta={"source": source, "record": report.summary()},
    )
    requests = [(r.t - t_base, r.t - t_base + (r.duration_s or 0.0), r.engine) for r in kept]
    ends = sorted(max(r.t + (r.duration_s or 0.0) for r in conv) - t_base for _, conv in convs)
    figures = _figures(kept, convs, requests, ends)
    return RecordedStep(
        trace=trace,
        source=source,
        read_summary=report.summary(),
        skipped=dict(report.skipped),
        left_out=dict(left_out),
        notes=notes,
        figures=figures,
        requests=requests,
        session_ends=ends,
    )


def _figures(
    kept: Sequence[RequestRecord],
    convs: Sequence[tuple[str, list[RequestRecord]]],
    requests: Sequence[tuple[float, float, str | None]],
    ends: Sequence[float],
) -> dict[str, Any]:
    """The recorded step's own figures, keyed as a replay row is where they mean the same."""
    n = len(convs)
    with_cache = [r for r in kept if r.prompt_tokens and r.cached_tokens is not None]
    queried = sum(int(r.prompt_tokens or 0) for r in with_cache)
    cached = sum(int(r.cached_tokens or 0) for r in with_cache)
    events = sorted([(s, 1) for s, _, _ in requests] + [(e, -1) for _, e, _ in requests])
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    engines = Counter(e for _, _, e in requests if e)

    def t(q: float) -> float | None:
        x = time_to_fraction(ends, n, q)
        return None if x is None else round(x, 3)

    return {
        "sessions": n,
        "requests": len(kept),
        "prompt_tokens": sum(_prompt_tokens(r) for r in kept),
        "completion_tokens": sum(_completion_tokens(r) for r in kept),
        "cached_tokens": cached,
        "hit_rate": round(cached / queried, 4) if queried else None,
        "wall_s": round(max(e for _, e, _ in requests), 3),
        "t50_s": t(0.5),
        "t90_s": t(0.9),
        "t100_s": t(1.0),
        "peak_in_flight": peak,
        "engine_requests": dict(sorted(engines.items())),
        "start_span_s": round(max(c[0].t for _, c in convs) - kept[0].t, 3),
        "turns_max": max(len(c) for _, c in convs),
        "turns_p50": int(np.percentile([len(c) for _, c in convs], 50, method="nearest")),
        "mean_gap_s": round(statistics.fmean(gaps), 4) if (gaps := _gaps(convs)) else 0.0,
    }


def _gaps(convs: Sequence[tuple[str, list[RequestRecord]]]) -> list[float]:
    out = []
    for _, conv in convs:
        for prev, r in itertools.pairwise(conv):
            if prev.duration_s is not None:
                out.append(max(0.0, r.t - (prev.t + prev.duration_s)))
    return out


def load_recorded(
    path: str | Path, *, gap_min_s: float = GAP_MIN_S, infer_sessions: bool = True
) -> RecordedStep:
    """Read the record at ``path`` (a job directory, a record directory or one record file) and turn it
    into a replayable step, named after its job when it sits in one."""
    if (Path(path) / RECORD_DIR).is_dir():
        path = Path(path) / RECORD_DIR
    report = read_records(path)
    if not report.files:
        raise ValueError(f"{path}: no request record (requests*.jsonl)")
    name = "recorded"
    p = Path(path)
    job = p.parent if p.name == RECORD_DIR else (p.parent.parent if p.parent.name == RECORD_DIR else None)
    if job is not None:
        name = f"recorded-{job.name}"
    return step_from_records(report, str(path), gap_min_s=gap_min_s, infer_sessions=infer_sessions, name=name)


def predicted_tokens(trace: Trace) -> tuple[int, int]:
    """(prompt, completion) tokens the simulator will count for ``trace``, replies as long as their
    ``max_tokens`` (the simulator's default, no early stop): what a record-built trace was sized to."""
    first, more = _template_tokens()
    prompt = completion = 0
    for s in trace.sessions:
        p = first + math.ceil(len(trace.system_prompt(s)) / CHARS_PER_TOKEN)
        p += math.ceil(len(s.task) / CHARS_PER_TOKEN)
        for k, t in enumerate(s.turns):
            if k > 0:
                p += s.turns[k - 1].max_tokens + more + math.ceil(len(t.tool_output) / CHARS_PER_TOKEN)
            prompt += p
            completion += t.max_tokens
    return prompt, completion
