"""``python -m launcher.engines.sim``: see ``cli`` for the flags."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
