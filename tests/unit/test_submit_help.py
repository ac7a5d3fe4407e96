"""``rl-launch submit --help`` lists what a user may pass: ``--in-allocation`` and ``--job-dir`` are the
batch script's (``launcher.submit.render``), and --help listed them ("not for users") beside the rest."""

from __future__ import annotations

from click.testing import CliRunner

from launcher.cli.main import main


def test_submit_help_hides_the_batch_scripts_options() -> None:
    out = CliRunner().invoke(main, ["submit", "--help"])
    assert out.exit_code == 0 and "--dry-run" in out.output
    assert "--in-allocation" not in out.output and "--job-dir" not in out.output, out.output
