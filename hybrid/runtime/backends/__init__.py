"""The runtime side of each family: ddp.py, fsdp.py and deepspeed.py each supply check, place,
wrap and engine, which hybrid/runtime/parallelize.py calls in its one order (Engine in base.py). Which module
serves a strategy is its family's business (hybrid/families/); each is imported only when used,
and ds_config.py is pure so configs can be emitted without torch.
"""
from __future__ import annotations


def apply(strategy, model, optimizer_factory, mesh, spec, runtime, options=None):
    """The layout `mesh` stands for (pp 1) applied in the one order (hybrid/runtime/parallelize.py), and
    its family's engine."""
    from ..parallelize import apply_layout, layout_of_mesh
    return apply_layout(model, layout_of_mesh(strategy, mesh, spec), optimizer_factory, mesh, spec, runtime, options)
