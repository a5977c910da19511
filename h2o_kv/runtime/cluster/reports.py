"""What the gateway and the router in its process share: the replicas' last routing-stats reports, as the router saw
them (replica id -> stats), and the requests whose answers the gateway has relayed to the end.

A module of its own because Ray Serve pickles a custom router's module by value: globals kept there would be a
copy, invisible to the gateway in the same process. This one is imported by reference.

`FINISHED` exists because Ray Serve tells the router that a request completed (`on_request_completed`) from a
callback that crosses threads: on a loaded machine it can come after the client has received the whole answer and
sent its next request, and the router would still count the finished request against its replica. The gateway
knows sooner (before the client sees the end of the answer), so it says so here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

LATEST: dict[str, dict] = {}
FINISHED_KEPT = 10_000  # request ids remembered (the oldest forgotten first; a late completion forgets its own)

_finished: OrderedDict[str, None] = OrderedDict()
_lock = threading.Lock()  # the gateway's event loop and the router's write it from different threads


def finish(request_id: str) -> None:
    """The gateway has relayed this request's answer to the end (or its client went away)."""
    if request_id:
        with _lock:
            _finished[request_id] = None
            while len(_finished) > FINISHED_KEPT:
                _finished.popitem(last=False)


def finished(request_id: str) -> bool:
    with _lock:
        return request_id in _finished


def forget(request_id: str) -> None:
    """Ray Serve's own completion came: the router no longer needs the gateway's word."""
    with _lock:
        _finished.pop(request_id, None)
