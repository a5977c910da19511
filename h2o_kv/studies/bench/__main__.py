"""`python -m h2o_kv.studies.bench`: the same flags as `h2o-kv bench`."""

import sys

from h2o_kv.studies.bench.cli import run_cli

sys.exit(run_cli())
