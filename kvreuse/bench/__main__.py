"""``python -m kvreuse.bench serve|compare ...`` (the same as ``kvreuse bench ...``)."""

import sys

from kvreuse.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
