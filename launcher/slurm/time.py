"""Slurm time strings: what ``--time`` accepts, one spelling for directives, minutes for submitit.

Forms follow sbatch's ``--time``: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``, or an integer
number of minutes. Unlimited times are refused: submitit needs a number, and a job with no end is a job
that never releases its GPUs. Pure (no spec, no Slurm commands), so the spec schema can use it without
importing the request builder.
"""

from __future__ import annotations

import math
import re

_TIME_FORMS = "M, M:S, H:M:S, D-H, D-H:M or D-H:M:S (e.g. 04:00:00 or 1-12:00:00)"


def parse_time(value: str | int) -> int:
    """Seconds in a Slurm ``--time`` value; ``ValueError`` saying which forms are accepted otherwise.

    An ``int`` is minutes, as sbatch reads a bare number. Fields after the first must stay below their
    unit (``1:75:00`` is refused) because an out-of-range field is far more often a typo than intent.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"must be a Slurm time string ({_TIME_FORMS}), got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"must be > 0 minutes, got {value}")
        return value * 60
    text = value.strip()
    if text.lower() in {"unlimited", "infinite", "-1"}:
        raise ValueError(f"must be a finite time ({_TIME_FORMS}); an unlimited job never frees its GPUs")
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not m:
        raise ValueError(f"{value!r} is not a Slurm time; use {_TIME_FORMS}")
    days_s, a, b, c = m.groups()
    nums = [int(x) for x in (a, b, c) if x is not None]
    if days_s is not None:
        # D-H, D-H:M, D-H:M:S
        days = int(days_s)
        hours, minutes, seconds = [*nums, 0, 0][:3]
        if hours >= 24:
            raise ValueError(f"{value!r}: hours must be < 24 after 'D-' (got {hours})")
    elif len(nums) == 1:  # M
        days, hours, minutes, seconds = 0, 0, nums[0], 0
    elif len(nums) == 2:  # M:S
        days, hours, (minutes, seconds) = 0, 0, nums
    else:  # H:M:S
        days, (hours, minutes, seconds) = 0, nums
    if len(nums) >= 2 and (minutes >= 60 and (days_s is not None or len(nums) == 3)):
        raise ValueError(f"{value!r}: minutes must be < 60 (got {minutes})")
    if len(nums) >= 2 and seconds >= 60:
        raise ValueError(f"{value!r}: seconds must be < 60 (got {seconds})")
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total <= 0:
        raise ValueError(f"{value!r} is zero; give the job some time, e.g. 04:00:00")
    return total


def format_time(seconds: int) -> str:
    """``HH:MM:SS`` or ``D-HH:MM:SS``: one unambiguous spelling for directives and dry-run output."""
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    hms = f"{hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{days}-{hms}" if days else hms


def time_minutes(seconds: int) -> int:
    """Whole minutes for submitit's ``timeout_min``, rounded up so the job never gets less than asked."""
    return max(1, math.ceil(seconds / 60))
