"""hybrid: pick the right data-parallel strategy from an honest per-GPU memory estimate, and apply it.

The public API; heavy parts (torch, deepspeed) are imported on first use so that `hybrid plan`
answers without loading torch.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Cluster": "cluster", "GPUSpec": "cluster", "GPUS": "cluster", "detect": "cluster",
    "TrainSpec": "spec", "HybridError": "errors",
    "ModelProfile": "profile", "profile_module": "profile", "resolve_model": "profile",
    "DecoderConfig": "presets", "PRESETS": "presets",
    "Strategy": "catalogue", "load_catalogue": "catalogue",
    "MemoryBreakdown": "memory.breakdown",
    "Plan": "planner", "Candidate": "planner", "plan": "planner",
    "estimate": "api",
    "auto_wrap": "auto", "Wrapped": "wrapped", "init_distributed": "mesh", "build_mesh": "mesh",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hybrid' has no attribute {name!r}")
