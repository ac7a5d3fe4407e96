"""Router secrets from a file, the environment or (discouraged) a flag.

A secret on the command line is visible to every user of the node in ``ps`` and ``/proc/*/cmdline``, so
``rl-launch router`` reads each one from ``--<name>-file`` or ``RL_ROUTER_<NAME>``; the flag itself still
works for a quick local try, with a warning. Values never reach a log: only the flag and file names do.
"""

from __future__ import annotations

import stat
from collections.abc import Callable
from pathlib import Path


class SecretSourceError(ValueError):
    """A secret that cannot be read or was given twice; the message is one line naming the flag/file."""


def read_secret_file(path: str | Path, flag: str, warn: Callable[[str], None]) -> str:
    """The file's content, stripped; ``SecretSourceError`` naming ``flag`` and the file if it is
    unreadable or empty. ``warn`` is told (by name, never content) when group or others can read it."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SecretSourceError(f"{flag} {p}: not UTF-8 text; write the secret as one line of text") from None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise SecretSourceError(f"{flag} {p}: cannot read it ({reason}); check the path") from None
    if not stat.S_ISREG(mode):
        raise SecretSourceError(f"{flag} {p}: not a regular file; give the file holding the secret")
    secret = text.strip()
    if not secret:
        raise SecretSourceError(f"{flag} {p}: the file is empty; write the secret into it")
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        warn(f"{flag} {p} is readable by group or others (mode {stat.S_IMODE(mode):o}); run chmod 600 on it")
    return secret


def resolve_secret(
    *,
    name: str,
    flag_value: str | None,
    from_env: bool,
    env_var: str,
    file_path: str | None,
    warn: Callable[[str], None],
) -> str | None:
    """One secret from its three sources. ``flag_value`` came from ``env_var`` when ``from_env``,
    otherwise from ``--<name>`` on the command line (accepted, with a warning about ``ps``)."""
    flag = f"--{name}"
    if file_path is not None:
        if flag_value is not None:
            other = env_var if from_env else flag
            raise SecretSourceError(f"{flag}-file and {other} both give the {name}; keep only {flag}-file")
        return read_secret_file(file_path, f"{flag}-file", warn)
    if flag_value is not None and not from_env:
        warn(
            f"{flag} on the command line is visible to every user of this machine in ps; "
            f"use {flag}-file or {env_var} instead"
        )
    if flag_value is not None and not flag_value.strip():
        where = env_var if from_env else flag
        raise SecretSourceError(f"{where} is empty; give the secret or leave it unset")
    return flag_value.strip() if flag_value is not None else None
