"""``python -m tools.nightly``: the nightly regression run
(``tools.nightly.run``; ``--help`` for its flags)."""

import sys

from tools.nightly.run import main

if __name__ == "__main__":
    sys.exit(main())
