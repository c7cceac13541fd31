"""The runtime side of each family: `apply(strategy, model, optimizer_factory, mesh, spec, runtime,
options) -> Engine` lives in ddp.py, fsdp.py and deepspeed.py (Engine in base.py). Which module
serves a strategy is its family's business (hybrid/families/); each is imported only when used,
and ds_config.py is pure so configs can be emitted without torch.
"""
from __future__ import annotations


def apply(strategy, model, optimizer_factory, mesh, spec, runtime, options=None):
    return strategy.family_obj.runtime().apply(strategy, model, optimizer_factory, mesh, spec, runtime, options)
