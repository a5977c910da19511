"""Names a package exports but imports only when first used (PEP 562): `import h2o_kv` and the CLI's flag
parsing stay free of torch, which takes seconds to import."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def exports(package: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` that imports each of `names` from its module (the dict's value, a full
    module name) on first use and keeps it as the package's attribute."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
