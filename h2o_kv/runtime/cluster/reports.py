"""The replicas' last routing-stats reports, as the router in this process saw them (replica id -> stats).

A module of its own because Ray Serve pickles a custom router's module by value: globals kept there would be a
copy, invisible to the gateway's /metrics in the same process. This one is imported by reference.
"""

from __future__ import annotations

LATEST: dict[str, dict] = {}
