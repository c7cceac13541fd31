"""The runtime side of each family: `apply(strategy, model, optimizer_factory, mesh, spec, runtime,
options) -> Engine` lives in ddp.py, fsdp.py and deepspeed.py (Engine in base.py). Which module
serves a strategy is its family's business (hybrid/families/); each is imported only when used,
and ds_config.py is pure so configs can be emitted without torch.
"""
from __future__ import annotations


def apply(strategy, model, optimizer_factory, mesh, spec, runtime, options=None):
    """The family's wrap, with context parallelism (cp > 1) applied to the wrapped model's
    attention: it changes no parameter, so it composes with any wrap order (backends/cp.py)."""
    cp = mesh["cp"].size() if mesh is not None and "cp" in (mesh.mesh_dim_names or ()) else 1
    if cp > 1:
        from .cp import check_context_parallel
        strategy.family_obj.check_cp(strategy, cp, mesh["tp"].size())
        check_context_parallel(model, cp, spec.seq_len)
    engine = strategy.family_obj.runtime().apply(strategy, model, optimizer_factory, mesh, spec, runtime, options)
    if cp > 1:
        from .cp import apply_context_parallel
        engine.cp = apply_context_parallel(engine.model, mesh["cp"], spec)
    return engine
