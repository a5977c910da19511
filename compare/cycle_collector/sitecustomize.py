"""Python's cyclic collector every minute, for study runs pinned at a commit where a `KVCache` was a reference cycle.

Before that fix (kvcache.py: `layer_class_to_replicate`), a cache held a bound method of itself, so every cache a
study made (each recorded prefill among them) was freed only by the collector's full pass, which a process of few
Python objects runs rarely: a long run's memory grew with every sample.
A run started at such a commit keeps it (its cells' keys hold the source digest), so `compare/study_runs.sh` puts
this folder on its PYTHONPATH instead; Python imports `sitecustomize` at start-up.
"""

import gc
import threading
import time


def _collect_every(seconds: float) -> None:
    while True:
        time.sleep(seconds)
        gc.collect()


threading.Thread(target=_collect_every, args=(60.0,), name="cycle-collector", daemon=True).start()
