"""The option lists ``rl-launch bench``'s commands share, defined once, and the parsing they need.

``trace``, ``replay`` and ``virtual`` take the same workload options, ``replay`` and ``virtual`` the same
ARMS, ``--trace`` and ``--json``; each command used to spell its own copy, and a default or help line
changed in one drifted from the others. As SkyPilot's ``flags.py`` does, each shared list is a list of
click decorators here, put on a command with ``apply``; the options only one command has stay on it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from launcher.bench.recorded import RecordedStep, load_recorded, resolve_trace_source
from launcher.bench.trace import Trace, load_trace
from launcher.bench.workload import MAX_TOKENS, WORKLOADS
from launcher.cli.options import root_option

F = TypeVar("F", bound=Callable[..., Any])

WORKLOAD_OPTIONS = ("workload", "seed", "scale", "group_size", "turn_scale", "max_tokens")
"""The options that define a generated trace: given with ``--trace`` they would be silently ignored."""

WORKLOAD_FLAGS: list[Callable[[F], F]] = [
    click.option("--workload", type=click.Choice(WORKLOADS), default="p30_all", show_default=True),
    click.option("--seed", type=int, default=1, show_default=True, help="Same seed, same trace."),
    click.option(
        "--scale",
        type=click.FloatRange(min=0.0, min_open=True),
        default=1.0,
        show_default=True,
        help="Multiply the session count and every size (prompt, tool output, max_tokens).",
    ),
    click.option(
        "--group-size",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="GRPO group size: G sessions per task, with an identical first turn.",
    ),
    click.option(
        "--turn-scale",
        type=click.FloatRange(min=0.0, min_open=True),
        default=1.0,
        show_default=True,
        help="Also shorten sessions (smoke runs; changes the workload's shape).",
    ),
    click.option(
        "--max-tokens",
        type=click.IntRange(min=1),
        default=MAX_TOKENS,
        show_default=True,
        help="Assistant max_tokens per turn at scale 1 (scaled with --scale).",
    ),
]
"""The options that define a generated trace (``trace``, ``replay``, ``virtual``)."""

TRACE_FLAGS: list[Callable[[F], F]] = [
    click.option(
        "--trace",
        "trace_arg",
        metavar="JOB_OR_FILE",
        default=None,
        help="Replay this instead of a generated workload: a saved trace (bench trace --out), a job "
        "(directory, or name/id under --root) whose router recorded its requests, a record "
        "directory or one record file. Not with --workload.",
    ),
    root_option,
    click.option(
        "--infer-sessions/--no-infer-sessions",
        default=True,
        show_default=True,
        help="Records without a session (Gym sends no session header): join each to the "
        "conversation whose previous prompt it extends (what cache_aware itself sees), instead of "
        "replaying it as a one-turn session, which loses the step's conversations and its hit rate.",
    ),
]
"""``--trace JOB_OR_FILE`` and what it needs (``--root``, ``--infer-sessions``): ``replay``, ``virtual``."""

ARMS_ARGUMENT = click.argument("arms", nargs=-1)
"""The arms to compare (``replay``, ``virtual``)."""

JSON_FLAG = click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path))
"""Where the run's figures go as JSON (``replay``, ``virtual``)."""


def apply(flags: Sequence[Callable[[F], F]]) -> Callable[[F], F]:
    """One decorator putting ``flags`` on a command, in the order listed (as ``--help`` shows them)."""

    def decorate(f: F) -> F:
        for flag in reversed(flags):
            f = flag(f)
        return f

    return decorate


def kv(pairs: tuple[str, ...], what: str) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; VALUE parsed as JSON when it is JSON (numbers, booleans), else kept a string."""
    out: dict[str, Any] = {}
    for p in pairs:
        if "=" not in p:
            raise click.BadParameter(f"{p!r} is not KEY=VALUE", param_hint=what)
        k, v = p.split("=", 1)
        try:
            out[k.strip().replace("-", "_")] = json.loads(v)
        except ValueError:
            out[k.strip().replace("-", "_")] = v
    return out


def load_trace_arg(
    trace_arg: str, root: Path, infer_sessions: bool
) -> tuple[Trace, RecordedStep | None, Path]:
    """The trace ``--trace`` names, the record it was built from (None for a saved trace), and its path.
    What cannot be found or read is the command's one-line error."""
    from launcher.jobdir.lookup import JobNotFound

    ctx = click.get_current_context()
    given = [
        "--" + name.replace("_", "-")
        for name in WORKLOAD_OPTIONS
        if ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)
    ]
    if given:
        raise click.UsageError(
            f"--trace replays the requests it names; {', '.join(given)} define a generated workload "
            "(give one or the other)"
        )
    try:
        kind, path = resolve_trace_source(trace_arg, root)
        if kind == "trace":
            return load_trace(path), None, path
        step = load_recorded(path, infer_sessions=infer_sessions)
    except JobNotFound as exc:
        raise click.ClickException(f"--trace: {exc}") from None
    except (OSError, ValueError, KeyError) as exc:
        raise click.ClickException(f"--trace {trace_arg}: {exc}") from None
    return step.trace, step, path
