"""hybrid: pick the right parallel layout from an honest per-GPU memory estimate, and apply it.

The user API. `import hybrid` stays torch-free so that `hybrid plan` answers without loading torch:
the pure parts are imported here; the runtime parts (auto_wrap, Wrapped, shutdown) are loaded on
first use, and the TYPE_CHECKING imports below keep all of them visible to IDEs and type checkers.
Internals are reached through their modules (hybrid.runtime.mesh, hybrid.model.profile, ...).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import _compat
from .api import estimate, plan
from .config.cluster import Cluster
from .errors import HybridError
from .layout.dims import ParallelDims
from .config.spec import LoRA, TrainSpec

if TYPE_CHECKING:
    from .auto import auto_wrap
    from .runtime.mesh import shutdown
    from .runtime.wrapped import Wrapped

__version__ = "0.2.0"

_compat.install()

__all__ = ["Cluster", "HybridError", "LoRA", "ParallelDims", "TrainSpec", "Wrapped", "auto_wrap", "estimate", "plan",
           "shutdown"]

_LAZY = {"auto_wrap": "auto", "Wrapped": "runtime.wrapped", "shutdown": "runtime.mesh"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hybrid' has no attribute {name!r}")
