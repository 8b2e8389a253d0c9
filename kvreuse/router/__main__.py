"""``python -m kvreuse.router ...``: the same as ``kvreuse route ...``."""

import sys

from kvreuse.router.cli import main

sys.exit(main())
