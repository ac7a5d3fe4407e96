"""A directory other users can reach, for the tests of what another user can do to a checkpoint there.

pytest's base temp directory is private (``/tmp/pytest-of-USER``, 0700, and pytest makes it 0700 again
at each session's start): no other user reaches anything under it, and the router's check rightly
trusts what no other user can reach (``router.fleet.trusted_path``). On a cluster, checkpoints
lie under homes and project directories other users can enter; ``shared_dir`` is one: a 0755 directory
of the test's own directly under ``/tmp``, removed after the test (everything in it, whoever owns it).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="rl-launch-test-shared-", dir="/tmp"))
    try:
        d.chmod(0o755)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
