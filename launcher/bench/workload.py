"""Replay workloads: deterministic multi-turn agent traces, saved and loaded as JSONL.

Why synthetic traces rather than a recorded one: the routing question depends on the *shape* of the load
(how many sessions, how many turns each, how long the shared prefix is, how heavy the tool outputs are,
how GRPO groups share a first turn), not on the words. A generator driven by a seed reproduces that shape
on any machine, and ``--scale`` shrinks it for a laptop without changing the shape. The generated trace
is written to JSONL (``launcher.bench.trace``, which owns the trace's shape) so the very same requests
can be replayed against every arm (and against a real fleet later).

Two workloads:

``p30_all``
    610 sessions whose turn counts follow min/p50/p90/p99/max = 5/29/56/85/99 (the coding-agent replay
    the public results were measured on). Turn counts are drawn by stratified sampling through a
    piecewise-linear inverse CDF pinned on those quantiles, so even one seed matches them closely.
``longtail``
    540 short sessions (8-20 turns) and 60 long ones (27-95 turns). The long sessions' turn counts are
    calibrated so that the short ones carry ~44% of the *work*: the step's last few percent of sessions
    are the long ones, which is exactly where the router's placement decides the wall clock.

"Work" of a session is the number of tokens an engine would process without any prefix cache: for every
turn, the whole resent context (system prompt, task, every earlier reply and tool output) plus that
turn's ``max_tokens``. Context is resent each turn, so work grows with the square of the turn count; that
is why 540 short sessions can weigh as much as 60 long ones. Token counts are estimated as chars / 4.
"""

from __future__ import annotations

import json
import math

import numpy as np

from launcher.bench.trace import CHARS_PER_TOKEN, TEMPLATE_TOKENS_PER_TURN, Session, Trace, Turn

WORKLOADS: tuple[str, ...] = ("p30_all", "longtail")

# p30_all: turn-count quantiles (probability, turns) the generator is pinned on.
P30_QUANTILES: tuple[tuple[float, float], ...] = ((0.0, 5), (0.5, 29), (0.9, 56), (0.99, 85), (1.0, 99))
P30_SESSIONS = 610

# longtail: two populations and the share of work the short one carries.
LONGTAIL_SHORT = (540, 8, 20)
LONGTAIL_LONG = (60, 27, 95)
LONGTAIL_SHORT_SHARE = 0.44

# Sizes at scale 1, in tokens (chars / 4). Coding-agent-like: a big shared system prompt with tool
# schemas, an issue-sized task, tool outputs (file reads, test logs) with a heavy tail.
SYSTEM_PROMPT_TOKENS = 2500
TASK_TOKENS = (150, 600)  # uniform range
TOOL_MEDIAN_TOKENS = 160
TOOL_SIGMA = 1.1  # lognormal sigma: p99 is ~13x the median before the cap
TOOL_CAP_TOKENS = 4000
MAX_TOKENS = 192
# The engines' context limit (vLLM's max_model_len; the simulator's default). Absolute, never scaled: a
# session whose tool outputs would overflow it has them shrunk proportionally (an agent harness truncates
# tool output for the same reason), so no request is refused for length and turn counts stay as drawn.
MAX_CONTEXT_TOKENS = 32768
CONTEXT_SLACK_TOKENS = 256
MIN_MAX_TOKENS = 16


# ----------------------------------------------------------------------------------------------------
# Text: deterministic filler that looks vaguely like code and logs. Tokens are estimated as chars / 4, and
# every word plus its separator is ~8 chars, so ~2 "tokens" a word.
# ----------------------------------------------------------------------------------------------------
_SYLLABLES = (
    "ka re to mi su na lo ve pi da ne ru xo fa gi be ho ju ly wo ze qua sti pro con ter ment ing ate "
    "def cls ret val obj arr idx len buf src dst cfg env log err tmp"
).split()


def _vocabulary() -> list[str]:
    """A fixed vocabulary (independent of the trace seed, so text statistics never vary between seeds)."""
    rng = np.random.default_rng(20240611)
    words: list[str] = []
    for _ in range(2048):
        k = int(rng.integers(1, 4))
        words.append("".join(_SYLLABLES[int(i)] for i in rng.integers(0, len(_SYLLABLES), k)))
    return words


_VOCAB = _vocabulary()
_PUNCT = [" ", " ", " ", " ", " ", "_", ".", "(", ") ", ", ", ": ", " = ", "\n", "\n    "]


def _text(rng: np.random.Generator, n_tokens: int) -> str:
    """About ``n_tokens`` tokens (``4 * n_tokens`` chars) of filler drawn from ``rng`` (small texts)."""
    target = max(1, n_tokens) * CHARS_PER_TOKEN
    n_words = target // 6 + 1
    idx = rng.integers(0, len(_VOCAB), n_words).tolist()
    sep = rng.integers(0, len(_PUNCT), n_words).tolist()
    out = "".join([_VOCAB[i] + _PUNCT[j] for i, j in zip(idx, sep, strict=True)])
    return (out * (target // max(1, len(out)) + 1))[:target]


class _TextPool:
    """Filler text for the bulk (tasks, tool outputs): slices at random offsets of one big random text.

    Why a pool: drawing every tool output word by word costs seconds at scale 1 (20k turns); slicing is
    O(1). Shared substrings at different offsets do not matter for routing or caching, which only match
    prompts from their first token, and every prompt starts with a different task or history.
    """

    def __init__(self, rng: np.random.Generator, chars: int = 1 << 20) -> None:
        self._rng = rng
        self._text = _text(rng, chars // CHARS_PER_TOKEN)

    def take(self, n_tokens: int) -> str:
        target = max(1, n_tokens) * CHARS_PER_TOKEN
        if target >= len(self._text):
            return (self._text * (target // len(self._text) + 1))[:target]
        off = int(self._rng.integers(0, len(self._text) - target))
        return self._text[off : off + target]


_TOOL_NAMES = (
    "bash",
    "read_file",
    "write_file",
    "edit_file",
    "list_dir",
    "search_code",
    "run_tests",
    "git_diff",
    "git_log",
    "python",
    "find_symbol",
    "open_url",
    "apply_patch",
    "grep",
    "view_range",
    "submit",
)


def _system_prompt(rng: np.random.Generator, n_tokens: int) -> str:
    """An agent system prompt: instructions plus JSON tool schemas, ``n_tokens`` long.

    Shared verbatim by every session, as in real agent RL: it is the prefix every cache-aware router sees
    matching everything, which is the failure mode the bench has to expose.
    """
    target = n_tokens * CHARS_PER_TOKEN
    head = (
        "You are an autonomous software engineering agent. You work in a sandboxed repository and solve "
        "the task given by the user. Think step by step, call exactly one tool per turn, read tool output "
        "carefully, and submit when the tests pass.\n\n# Tools\n"
    )
    parts = [head]
    size = len(head)
    i = 0
    while size < target:
        name = _TOOL_NAMES[i % len(_TOOL_NAMES)] + ("" if i < len(_TOOL_NAMES) else f"_{i}")
        n_params = 2 + i % 4
        schema = {
            "type": "function",
            "function": {
                "name": name,
                "description": _text(rng, 30),
                "parameters": {
                    "type": "object",
                    "properties": {
                        f"arg{j}": {"type": "string", "description": _text(rng, 12)} for j in range(n_params)
                    },
                    "required": [f"arg{j}" for j in range(min(2, n_params))],
                },
            },
        }
        block = json.dumps(schema, indent=1) + "\n"
        parts.append(block)
        size += len(block)
        i += 1
    return "".join(parts)[: max(target, len(head))]


# ----------------------------------------------------------------------------------------------------
# Turn counts
# ----------------------------------------------------------------------------------------------------
def _stratified_u(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` uniforms, one per stratum ``[i/n, (i+1)/n)``, with both ends pinned to 0 and 1.

    Stratification makes one draw of 610 match the target quantiles closely (plain i.i.d. draws miss the
    p99 and the max by a lot); pinning the ends guarantees the stated min and max appear.
    """
    if n == 1:
        return np.array([0.5])
    u = (np.arange(n) + rng.random(n)) / n
    u[0], u[-1] = 0.0, 1.0
    return u


def _p30_turns(rng: np.random.Generator, n: int) -> np.ndarray:
    ps = np.array([p for p, _ in P30_QUANTILES])
    ts = np.array([t for _, t in P30_QUANTILES], dtype=float)
    turns = np.rint(np.interp(_stratified_u(rng, n), ps, ts)).astype(int)
    rng.shuffle(turns)
    return turns


def _tool_budget(system_tokens: int, task_tokens: int, turns: int, max_tokens: int, max_context: int) -> int:
    """Tool-output tokens a session of ``turns`` turns may carry so its last request fits the context."""
    used = (
        system_tokens + task_tokens + turns * (max_tokens + TEMPLATE_TOKENS_PER_TURN) + CONTEXT_SLACK_TOKENS
    )
    return max(0, max_context - used)


def _work_table(
    system_tokens: int, task_tokens: int, tool_tokens: np.ndarray, max_tokens: int, max_context: int
) -> np.ndarray:
    """Work (tokens, no cache) of the session cut after T = 1, 2, ... turns, as ``table[T - 1]``.

    Turn k's prompt is system + task + k * max_tokens (replies, assumed full) + the tool outputs of turns
    1..k, all shrunk by the session's squeeze factor for T turns; it then generates max_tokens.
    ``tool_tokens[k]`` is turn k's appended tool output (0 on turn 0). Vectorised over T because the
    longtail calibration evaluates it for every candidate turn count.
    """
    tool = np.asarray(tool_tokens, dtype=float)
    t = np.arange(1, len(tool) + 1, dtype=float)
    cum = np.cumsum(tool)  # cum[T-1]: tool tokens of a T-turn session
    budget = np.array([_tool_budget(system_tokens, task_tokens, int(n), max_tokens, max_context) for n in t])
    squeeze = np.where(cum > budget, budget / np.maximum(cum, 1.0), 1.0)
    base = t * (system_tokens + task_tokens + max_tokens) + max_tokens * t * (t - 1) / 2
    return base + squeeze * np.cumsum(cum)


def _squeezed(tool_tokens: np.ndarray, budget: int) -> np.ndarray:
    """``tool_tokens`` shrunk proportionally to sum to at most ``budget`` (each kept >= 1 token)."""
    total = int(tool_tokens[1:].sum())
    if total <= budget:
        return tool_tokens
    out = np.floor(tool_tokens * (budget / total)).astype(int)
    out[1:] = np.maximum(out[1:], 1)
    out[0] = 0
    return out


def _calibrate_long_turns(
    u: np.ndarray, lo: int, hi: int, work_long: list[np.ndarray], work_short: float, share: float
) -> np.ndarray:
    """Turn counts ``lo + (hi-lo) * u**alpha`` with ``alpha`` chosen so short sessions carry ``share``.

    Larger alpha pushes long sessions toward ``lo`` (less long work, larger short share); the share is
    monotone in alpha, so bisection on log(alpha) finds it. If the target is out of reach the nearest end
    is used: the min and max stay pinned either way.
    """

    def turns_for(alpha: float) -> np.ndarray:
        return np.rint(lo + (hi - lo) * u**alpha).astype(int)

    def short_share(alpha: float) -> float:
        t = turns_for(alpha)
        wl = sum(float(w[n - 1]) for w, n in zip(work_long, t, strict=True))
        return work_short / (work_short + wl) if work_short + wl > 0 else 0.0

    a, b = math.log(0.02), math.log(50.0)
    for _ in range(50):
        m = (a + b) / 2
        if short_share(math.exp(m)) < share:
            a = m
        else:
            b = m
    return turns_for(math.exp((a + b) / 2))


# ----------------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------------
def _scaled(tokens: float, scale: float, floor: int) -> int:
    return max(floor, round(tokens * scale))


def generate(
    workload: str,
    seed: int = 1,
    scale: float = 1.0,
    group_size: int = 1,
    *,
    turn_scale: float = 1.0,
    max_tokens: int = MAX_TOKENS,
    max_context: int = MAX_CONTEXT_TOKENS,
) -> Trace:
    """Build a trace. Same arguments, same trace, byte for byte (on any machine: numpy's PCG64 is fixed).

    ``scale`` multiplies the session count and every size (system prompt, task, tool outputs, max_tokens)
    so the shape is kept while the machine's work shrinks ~scale^2. ``turn_scale`` (tests, smoke runs)
    also shortens the sessions, which does change the shape. ``group_size`` G gives GRPO groups: G
    consecutive sessions share one task and hence an identical first request. ``max_context`` is the
    engines' context limit in tokens (absolute, not scaled); tool outputs are shrunk to respect it.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    if scale <= 0 or turn_scale <= 0:
        raise ValueError("scale and turn_scale must be > 0")
    if group_size < 1:
        raise ValueError("group_size must be >= 1")

    ss = np.random.SeedSequence([seed, WORKLOADS.index(workload)])
    r_sys, r_turns, r_tools, r_text, r_groups = (np.random.default_rng(s) for s in ss.spawn(5))

    sys_tokens = _scaled(SYSTEM_PROMPT_TOKENS, scale, 64)
    mt = _scaled(max_tokens, scale, MIN_MAX_TOKENS)
    tool_median = TOOL_MEDIAN_TOKENS * scale
    tool_cap = _scaled(TOOL_CAP_TOKENS, scale, 8)
    system = _system_prompt(r_sys, sys_tokens)

    # Session populations: (kind, count) and max turns of each, so tool lengths can be drawn up front.
    if workload == "p30_all":
        n = max(1, round(P30_SESSIONS * scale))
        kinds = ["all"] * n
        max_turns = int(P30_QUANTILES[-1][1])
    else:
        n_short = max(1, round(LONGTAIL_SHORT[0] * scale))
        n_long = max(1, round(LONGTAIL_LONG[0] * scale))
        kinds = ["short"] * n_short + ["long"] * n_long
        max_turns = LONGTAIL_LONG[2]
    n = len(kinds)

    # Per-session task length and per-turn tool-output lengths (lognormal, capped), drawn for the maximum
    # possible turn count so the calibration below can vary turn counts without redrawing anything.
    task_tokens = np.rint(r_tools.uniform(TASK_TOKENS[0], TASK_TOKENS[1], n) * scale).astype(int).clip(8)
    tool_tokens = np.rint(r_tools.lognormal(math.log(max(tool_median, 1e-9)), TOOL_SIGMA, (n, max_turns)))
    tool_tokens = tool_tokens.clip(1, tool_cap).astype(int)
    tool_tokens[:, 0] = 0

    # Mix the two longtail populations before grouping and numbering: in a real step long and short
    # rollouts are interleaved, and a group (one task) can produce both. ``order[pos]`` is the session
    # (index into the arrays above) published at position ``pos``; groups are runs of positions.
    order = r_groups.permutation(n)
    pos_of = np.empty(n, dtype=int)
    pos_of[order] = np.arange(n)
    group_of = pos_of // group_size
    # Groups share a task, so every member gets its group leader's (first position's) task length.
    task_tokens = task_tokens[order[group_of * group_size]]

    if workload == "p30_all":
        turns = _p30_turns(r_turns, n)
    else:
        short_idx = [i for i, k in enumerate(kinds) if k == "short"]
        long_idx = [i for i, k in enumerate(kinds) if k == "long"]
        _, s_lo, s_hi = LONGTAIL_SHORT
        _, l_lo, l_hi = LONGTAIL_LONG
        turns = np.zeros(n, dtype=int)
        su = _stratified_u(r_turns, len(short_idx))
        st = np.rint(s_lo + (s_hi - s_lo) * su).astype(int)
        r_turns.shuffle(st)
        turns[short_idx] = st
        work = [
            _work_table(sys_tokens, int(task_tokens[i]), tool_tokens[i], mt, max_context) for i in range(n)
        ]
        w_short = sum(float(work[i][turns[i] - 1]) for i in short_idx)
        lu = _stratified_u(r_turns, len(long_idx))
        r_turns.shuffle(lu)
        turns[long_idx] = _calibrate_long_turns(
            lu, l_lo, l_hi, [work[i] for i in long_idx], w_short, LONGTAIL_SHORT_SHARE
        )
    if turn_scale != 1.0:
        turns = np.maximum(1, np.rint(turns * turn_scale)).astype(int)

    squeezed = 0
    for i in range(n):
        t_i = int(turns[i])
        budget = _tool_budget(sys_tokens, int(task_tokens[i]), t_i, mt, max_context)
        if int(tool_tokens[i, :t_i].sum()) > budget:
            tool_tokens[i, :t_i] = _squeezed(tool_tokens[i, :t_i], budget)
            squeezed += 1

    sessions: list[Session] = []
    group_tasks: dict[int, str] = {}
    pool = _TextPool(r_text)
    for pos, i in enumerate(order):
        g = int(group_of[i])
        if g not in group_tasks:
            group_tasks[g] = f"Task {g}: " + pool.take(int(task_tokens[i]))
        sess_turns = [Turn("", mt)]
        for k in range(1, int(turns[i])):
            sess_turns.append(Turn(pool.take(int(tool_tokens[i, k])), mt))
        sid = f"{workload}-{seed}-{pos:05d}-{kinds[i]}"
        sessions.append(Session(sid, g, "sys0", group_tasks[g], sess_turns))

    return Trace(
        workload=workload,
        seed=seed,
        scale=scale,
        group_size=group_size,
        system_prompts={"sys0": system},
        sessions=sessions,
        meta={
            "turn_scale": turn_scale,
            "max_tokens": mt,
            "max_context": max_context,
            "squeezed_sessions": squeezed,
        },
    )
