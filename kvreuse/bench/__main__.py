"""``python -m kvreuse.bench serve|compare ...`` (the same as ``kvreuse bench ...``).

Its own small parser over the same options (``add_bench_arguments``): the ``kvreuse`` command mounts this
package, so this package does not import the command back.
"""

import argparse
import sys

from kvreuse.bench.cli import add_bench_arguments, run_bench
from kvreuse.engine_args import configure_logging

common = argparse.ArgumentParser(add_help=False)
common.add_argument("--debug", action="store_true", help="log every cache decision (the same as KVREUSE_LOG=debug)")
parser = argparse.ArgumentParser(prog="python -m kvreuse.bench",
                                 description="the kvreuse benchmark suite (the same as kvreuse bench)")
add_bench_arguments(parser, parents=[common])
args = parser.parse_args()
configure_logging(args.debug)
sys.exit(run_bench(args))
