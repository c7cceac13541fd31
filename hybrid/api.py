"""Convenience entry points over the pure stages (no torch needed for presets)."""
from __future__ import annotations

from .catalogue import get_strategy, load_catalogue
from .cluster import Cluster
from .memory.analytic import estimate as _analytic
from .memory.breakdown import MemoryBreakdown
from .profile import ModelProfile, build_profile, resolve_model
from .spec import TrainSpec


def estimate(model, strategy: str = "fsdp", cluster: Cluster | None = None, spec: TrainSpec | None = None,
             shard_size: int | None = None) -> MemoryBreakdown:
    """Per-GPU memory of `strategy` for `model` (a preset name, ModelProfile or nn.Module)."""
    if isinstance(model, str):
        profile = resolve_model(model).profile
    elif isinstance(model, ModelProfile):
        profile = model
    else:
        profile = build_profile(model)
    return _analytic(get_strategy(strategy, load_catalogue()), profile, spec or TrainSpec(),
                     cluster or Cluster(), shard_size)
