"""The 0.1 import paths (a flat package) keep working for one release, each with a warning naming
where the module is now."""
import importlib
import sys
from pathlib import Path

import pytest

from hybrid._compat import MOVED

pytestmark = pytest.mark.unit

PKG = Path(__file__).resolve().parents[1] / "hybrid"


def _exists(module: str) -> bool:
    path = PKG.parent / module.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_every_old_path_names_modules_that_exist():
    for old, new in MOVED.items():
        assert not _exists(old), f"{old} is still a module: it needs no alias"
        for n in (new,) if isinstance(new, str) else new:
            assert _exists(n), f"{old} -> {n}: no such module"


def test_an_old_module_is_the_new_one_with_a_warning():
    sys.modules.pop("hybrid.planner", None)
    with pytest.warns(DeprecationWarning, match=r"hybrid.planner is hybrid.planning.planner since hybrid 0.2"):
        old = importlib.import_module("hybrid.planner")
    assert old is importlib.import_module("hybrid.planning.planner")
    sys.modules.pop("hybrid.memory.analytic", None)
    with pytest.warns(DeprecationWarning, match="hybrid.estimation.memory.analytic"):
        from hybrid.memory.analytic import estimate
    from hybrid.estimation.memory.analytic import estimate as now
    assert estimate is now


def test_a_split_module_serves_the_names_of_its_parts():
    sys.modules.pop("hybrid.memory.stages", None)
    with pytest.warns(DeprecationWarning):
        from hybrid.memory.stages import rank_estimates, stage_split
    from hybrid.estimation.memory.stages import rank_estimates as r
    from hybrid.planning.stages import stage_split as s
    assert (rank_estimates, stage_split) == (r, s)
    with pytest.raises(ImportError):
        from hybrid.memory.stages import no_such_name  # noqa: F401


def test_old_names_of_modules_that_became_packages():
    with pytest.warns(DeprecationWarning, match="hybrid.planning.reach.METHOD_REACH"):
        from hybrid.layout import METHOD_REACH
    from hybrid.planning.reach import METHOD_REACH as now
    assert METHOD_REACH is now
    with pytest.warns(DeprecationWarning, match="StageSplit"):
        from hybrid.layout.pipeline import PipelineLayout
    from hybrid.layout.pipeline import StageSplit
    assert PipelineLayout is StageSplit
    from hybrid.cli import main                                   # the console script's entry point, no warning
    assert callable(main)


def test_the_public_api_is_where_it_was():
    import hybrid
    for name in ("auto_wrap", "plan", "estimate", "Cluster", "ParallelDims", "TrainSpec", "HybridError", "Wrapped",
                 "shutdown"):
        assert name in hybrid.__all__
    from hybrid.layout import Layout, ParallelDims
    assert ParallelDims is hybrid.ParallelDims and Layout.__module__ == "hybrid.layout.layout"
