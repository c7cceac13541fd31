"""Which degrees of each dimension a plan tries: what each memory method (and `hybrid tune`) runs,
and what auto_wrap plans with (pure)."""
from __future__ import annotations

from ..errors import HybridError
from ..layout.layout import DIMENSIONS


METHOD_REACH = {"analytic": dict.fromkeys(DIMENSIONS, "search"),
                "traced": {"pp": "pinned", "tp": "pp", "cp": "pinned", "ep": "pinned"},
                "measured": {"tp": "pinned", "cp": "pinned", "ep": "pinned"},
                "tune": {"tp": "search", "cp": "search"}}
"""Which degrees of each dimension a memory method (and `hybrid tune`, which runs the layouts it
measures) runs: "search" every valid one, "pinned" a given one, the name of another dimension: a
given one when that one is given above 1 (traced tp runs with a traced pipeline stage); a
dimension left out runs at 1 only."""


def method_degrees(method: str, degrees: dict[str, int | None]) -> dict[str, int | None]:
    """The degrees a plan tries with this memory method: None (search every valid one) where the
    method searches the dimension, a given degree where it runs it, else 1. HybridError, naming
    the methods that run it, for a given degree this method cannot."""
    if method not in METHOD_REACH:
        raise HybridError(f"unknown memory method {method!r}; use analytic, traced or measured")
    reach, out = METHOD_REACH[method], {}
    for dim in DIMENSIONS:
        n, how = degrees.get(dim), reach.get(dim)
        runs = how in ("search", "pinned") or (how in DIMENSIONS and (degrees.get(how) or 1) > 1)
        if n is None:
            out[dim] = None if how == "search" else 1
        elif n == 1 or runs:
            out[dim] = n
        else:
            if method == "tune":
                raise HybridError(f"tune runs {dim} 1 layouts for now, got --{dim} {n}; plan {DIMENSIONS[dim]} with "
                                  "`hybrid plan`")
            others = " or ".join(m for m in ("traced", "analytic") if METHOD_REACH[m].get(dim) in ("search", "pinned"))
            needs = "".join(f" ({m}: with --{r[dim]})" for m, r in METHOD_REACH.items() if r.get(dim) in DIMENSIONS)
            raise HybridError(f"--method {method} runs {dim} 1 only{needs}; use --method {others} for --{dim} {n}")
    return out


def runtime_degrees(degrees: dict[str, int | None]) -> dict[str, int | None]:
    """The degrees auto_wrap plans with: as given, except that an unpinned tp is 1 with expert
    parallelism (runtime/backends/ep.py splits whole experts over dp_shard x cp ranks and does not build ep
    x tp; a plan hands ep x tp to torchtitan)."""
    out = dict(degrees)
    if (degrees.get("ep") or 1) > 1 and degrees.get("tp") is None:
        out["tp"] = 1
    return out
