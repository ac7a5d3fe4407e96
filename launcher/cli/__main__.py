"""``python -m launcher.cli``: the same ``rl-launch`` command, for when its script is not on ``PATH``
(a batch job starts with whatever ``PATH`` the node gives it; see ``launcher.submit.render``)."""

from launcher.cli.main import main

main()
