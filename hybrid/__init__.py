"""hybrid: pick the right parallel layout from an honest per-GPU memory estimate, and apply it.

The user API. `import hybrid` stays torch-free so that `hybrid plan` answers without loading torch:
the pure parts are imported here; the runtime parts (auto_wrap, Wrapped, shutdown) are loaded on
first use, and the TYPE_CHECKING imports below keep all of them visible to IDEs and type checkers.
Internals are reached through their modules (hybrid.mesh, hybrid.profile, ...).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .api import estimate, plan
from .cluster import Cluster
from .errors import HybridError
from .parallel import ParallelDims
from .spec import TrainSpec

if TYPE_CHECKING:
    from .auto import auto_wrap
    from .mesh import shutdown
    from .wrapped import Wrapped

__version__ = "0.1.0"

__all__ = ["Cluster", "HybridError", "ParallelDims", "TrainSpec", "Wrapped", "auto_wrap", "estimate", "plan",
           "shutdown"]

_LAZY = {"auto_wrap": "auto", "Wrapped": "wrapped", "shutdown": "mesh"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hybrid' has no attribute {name!r}")
