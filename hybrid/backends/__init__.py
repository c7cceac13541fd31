"""One Strategy interface, three implementations over the real libraries.

`apply(strategy, model, optimizer_factory, mesh, spec, runtime) -> Engine` lives in ddp.py,
fsdp.py and deepspeed.py (Engine in base.py); each module is imported only when its family is
used, and ds_config.py is pure so configs can be emitted without torch.
"""
from __future__ import annotations

import importlib


def apply(strategy, model, optimizer_factory, mesh, spec, runtime, options=None):
    module = importlib.import_module(f".{strategy.family}", __name__)
    return module.apply(strategy, model, optimizer_factory, mesh, spec, runtime, options)
