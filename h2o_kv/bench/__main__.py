"""`python -m h2o_kv.bench`: the same flags as `h2o-kv bench`."""

import sys

from .cli import run_cli

sys.exit(run_cli())
