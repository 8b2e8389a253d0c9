"""``python -m kvreuse.bench serve|compare ...`` (the same as ``kvreuse bench ...``)."""

import sys

from kvreuse.bench.cli import main

sys.exit(main())
