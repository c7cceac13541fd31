"""How ranks are laid out: ParallelDims, the Layout, pipeline schedules (pure, no torch)."""
from .._compat import lazy_names
from .dims import ParallelDims
from .layout import Layout

__all__ = ["Layout", "ParallelDims"]

__getattr__ = lazy_names("hybrid.layout", {
    **dict.fromkeys(("DIMENSIONS", "AC_ORDER", "as_layout"), "hybrid.layout.layout"),
    **dict.fromkeys(("METHOD_REACH", "method_degrees", "runtime_degrees"), "hybrid.planning.reach"),
    **dict.fromkeys(("TORCHTITAN_DEGREES", "TORCHTITAN_SCHEDULES"), "hybrid.handoff.torchtitan")})
