"""The manual stays true: every page of ``docs/`` and the README, its links and its commands.

As ``tests/local/test_readme.py`` runs the README's first two commands (and submitit's test_documentation
keeps its docs honest), this runs the commands of every page the way a user would, and checks its links.

**Links.** Every Markdown link ``[text](target)`` outside code, whose target is not a URL (``http:``,
``https:``, ``mailto:``), must name a file or directory that exists, relative to the page; a ``#anchor``
(alone, or after a ``.md`` target) must be the GitHub slug of a heading of that page.

**Commands.** A command is a line of a fenced ``bash`` block whose first word is ``rl-launch``, with its
trailing ``# comment`` removed. It is run (the venv's ``rl-launch``, from the repository root, in the
test session's environment: ``$HOME`` is a temporary directory, see ``tests/conftest.py``, so a job root
the spec leaves at its default lands there) and must exit 0 when all of these hold:

* it is side-effect free by its subcommand: ``validate``; ``render`` writing to stdout (``-o -``) or to
  its default under the job root (an explicit ``-o FILE`` would write into the checkout, and is
  skipped); ``submit`` with ``--dry-run``; or any command with ``--help`` / ``-h``;
* it has no placeholder (below), and it is one command: no ``&&``, ``||``, ``;``, ``|``, redirection,
  ``$(...)`` or line continuation (a pipeline into ``sbatch`` or a shell of the user's is theirs to run);
* it has no placeholder: no word in capitals (``JOB``, ``NAME``, ``SPEC``, ``DIR``, ``V``), no
  ``<...>``, no ``[optional]`` part and no ``...``.

Every other ``rl-launch`` line (a job that starts engines, ``fleet up``, ``cancel``...) is left to the
tests of its feature. ``test_enough_commands_run`` asserts a floor on how many commands ran, so the
test cannot pass by matching nothing.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import RL_LAUNCH

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
MIN_COMMANDS = 25
"""At least this many commands of the pages are run (there are more; a page losing its commands, or a
rule that stopped matching, must fail here)."""

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
LINK = re.compile(r"\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]*\b|<[^>]*>|\[|\.\.\.")
SHELL = re.compile(r"&&|\|\||;|\||>|<|\$\(|`|\\$")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    seen: dict[str, int] = {}
    out = set()
    for match in HEADING.finditer(text):
        base = slug(match.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    return [m.group(1) for m in LINK.finditer(text)]


def bash_lines(page: Path) -> list[str]:
    lines = []
    for match in FENCE.finditer(page.read_text()):
        if match.group(1).strip() == "bash":
            lines += [line.strip() for line in match.group(2).splitlines() if line.strip()]
    return lines


def strip_comment(line: str) -> str:
    return re.split(r"\s+#", line, maxsplit=1)[0].strip()


def why_skipped(command: str) -> str | None:
    """None when ``command`` is run, else the rule that skips it (see the module docstring)."""
    if PLACEHOLDER.search(command):
        return "a placeholder"
    if SHELL.search(command):
        return "more than one command"
    words = shlex.split(command)[1:]
    if "--help" in words or "-h" in words:
        return None
    sub = words[0] if words else ""
    if sub == "validate":
        return None
    if sub == "render":
        out = [w for i, w in enumerate(words) if i and words[i - 1] in ("-o", "--output")]
        return None if out in ([], ["-"]) else "writes a file of its own"
    if sub == "submit" and "--dry-run" in words:
        return None
    return "not side-effect free"


def documented_commands() -> list[tuple[str, str]]:
    """(page, command) of every command the rules run, in page order."""
    found = []
    for page in PAGES:
        for line in bash_lines(page):
            command = strip_comment(line)
            if command.startswith("rl-launch ") and why_skipped(command) is None:
                found.append((rel(page), command))
    return found


COMMANDS = documented_commands()


def test_the_pages_exist() -> None:
    names = {p.name for p in PAGES}
    for page in ("spec", "fronts", "router", "refit", "standing-fleets", "elastic", "security"):
        assert f"{page}.md" in names, f"docs/{page}.md is missing"
    assert {"operations.md", "architecture.md", "README.md"} <= names
    readme = (ROOT / "README.md").read_text()
    for page in PAGES:
        if page.parent.name == "docs":
            assert f"(docs/{page.name})" in readme, f"the README's docs index lacks {page.name}"
    assert len(readme.splitlines()) <= 160, "the README is a map: keep the manual in docs/"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_resolve(page: Path) -> None:
    bad = []
    for target in links(page):
        if re.match(r"(https?|mailto):", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading '#{anchor}' in {rel(dest)}")
    assert not bad, f"{rel(page)}: " + "; ".join(bad)


def test_the_rules() -> None:
    """The rules of the module docstring, on lines the pages have (or had)."""
    run = [
        "rl-launch validate examples/slurm-vllm.yaml --set generation.nodes=4",
        "rl-launch submit examples/slurm-vllm.yaml --dry-run",
        "rl-launch render examples/slurm-vllm.yaml -o -",
        "rl-launch fleet grow --help",
    ]
    skipped = {
        "rl-launch submit examples/slurm-vllm.yaml --follow": "not side-effect free",
        "rl-launch render examples/slurm-vllm.yaml -o job.sbatch && sbatch job.sbatch": (
            "more than one command"
        ),
        "rl-launch render examples/slurm-vllm.yaml -o job.sbatch": "writes a file of its own",
        "rl-launch status [JOB] [--once | --json]": "a placeholder",
        "rl-launch fleet reset-cache JOB": "a placeholder",
        "rl-launch router --backend http://<host>:8001/v1": "a placeholder",
        "rl-launch fleet up examples/fleet-local.yaml": "not side-effect free",
    }
    assert [why_skipped(c) for c in run] == [None] * len(run)
    assert {c: why_skipped(c) for c in skipped} == skipped
    assert strip_comment("rl-launch validate x.yaml   # a comment (--json)") == "rl-launch validate x.yaml"


def test_enough_commands_run() -> None:
    assert len(COMMANDS) >= MIN_COMMANDS, COMMANDS
    pages = {page for page, _ in COMMANDS}
    assert {"docs/spec.md", "docs/operations.md"} <= pages, pages


@pytest.mark.parametrize(("page", "command"), COMMANDS, ids=[f"{p}: {c}" for p, c in COMMANDS])
def test_documented_command_runs(page: str, command: str) -> None:
    proc = subprocess.run(
        [RL_LAUNCH, *shlex.split(command)[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"{page}: {command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
