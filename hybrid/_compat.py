"""The import paths of hybrid 0.1 (a flat package): each old module name still imports, as the module
it became, with a DeprecationWarning naming the new path; they go in the next release."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

MOVED = {
    "hybrid.backends": "hybrid.runtime.backends",
    "hybrid.batch": "hybrid.planning.batch",
    "hybrid.calibration": "hybrid.estimation.calibration",
    "hybrid.candidate": "hybrid.planning.candidate",
    "hybrid.catalogue": "hybrid.families.catalogue",
    "hybrid.checkpoint": "hybrid.ckpt.store",
    "hybrid.ckptread": "hybrid.ckpt.folder",
    "hybrid.cluster": "hybrid.config.cluster",
    "hybrid.compile": "hybrid.runtime.compile",
    "hybrid.cost": "hybrid.estimation.cost.step",
    "hybrid.data": "hybrid.runtime.data",
    "hybrid.demo": "hybrid.cli.demo",
    "hybrid.elementwise": "hybrid.estimation.cost.elementwise",
    "hybrid.emit": "hybrid.handoff.emit",
    "hybrid.export": "hybrid.ckpt.export",
    "hybrid.fitting": "hybrid.estimation.fitting",
    "hybrid.float8": ("hybrid.runtime.float8", "hybrid.estimation.float8"),
    "hybrid.jobconfig": "hybrid.config.options",
    "hybrid.jobfile": "hybrid.config.jobfile",
    "hybrid.launch": "hybrid.runtime.launch",
    "hybrid.links": "hybrid.estimation.cost.links",
    "hybrid.memory": "hybrid.estimation.memory",
    "hybrid.memory.placement": "hybrid.families.placement",
    "hybrid.memory.compiled": "hybrid.measure.compiled",
    "hybrid.memory.driver": "hybrid.measure.driver",
    "hybrid.memory.measured": "hybrid.measure.measured",
    "hybrid.memory.method": "hybrid.measure.method",
    "hybrid.memory.traced": "hybrid.measure.traced",
    "hybrid.memory.tracker": "hybrid.measure.tracker",
    "hybrid.mesh": "hybrid.runtime.mesh",
    "hybrid.models": ("hybrid.model.decoder", "hybrid.model.convnet", "hybrid.runtime.stages"),
    "hybrid.overhead": "hybrid.families.host",
    "hybrid.parallel": "hybrid.layout.dims",
    "hybrid.parallelize": "hybrid.runtime.parallelize",
    "hybrid.pipeline": "hybrid.layout.pipeline",
    "hybrid.planner": "hybrid.planning.planner",
    "hybrid.presets": "hybrid.model.presets",
    "hybrid.profile": ("hybrid.model.profile", "hybrid.model.sources"),
    "hybrid.report": "hybrid.planning.report",
    "hybrid.safeio": "hybrid.ckpt.safeio",
    "hybrid.shares": "hybrid.estimation.shares",
    "hybrid.spec": "hybrid.config.spec",
    "hybrid.tune_run": "hybrid.cli.tune_ranks",
    "hybrid.wrapped": "hybrid.runtime.wrapped",
    **{f"hybrid.memory.{m}": f"hybrid.estimation.memory.{m}"
       for m in ("activations", "analytic", "breakdown", "cp", "moe")},
    "hybrid.memory.stages": ("hybrid.estimation.memory.stages", "hybrid.planning.stages", "hybrid.measure.stages"),
    **{f"hybrid.backends.{m}": f"hybrid.runtime.backends.{m}"
       for m in ("base", "cp", "ddp", "deepspeed", "ep", "fsdp", "pipeline", "tp")},
}
"""Old module -> the module it is now, or the modules it was split into (their names served as one)."""


def warn_moved(old: str, new: str) -> None:
    warnings.warn(f"{old} is {new} since hybrid 0.2; import it from there ({old} goes in the next release)",
                  DeprecationWarning, stacklevel=3)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name and loads it as the new module itself (one object: a monkeypatch
    through the old name reaches the code that runs)."""

    def find_spec(self, name, path=None, target=None):
        if name not in MOVED:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warn_moved(spec.name, new if isinstance(new, str) else " and ".join(new))
        if isinstance(new, str):
            return importlib.import_module(new)
        module = types.ModuleType(spec.name, f"{spec.name}: split into {', '.join(new)}")
        module.__getattr__ = _first_of(spec.name, new)
        return module

    def exec_module(self, module):
        pass


def _first_of(old: str, modules: tuple[str, ...]):
    def __getattr__(name: str):
        for m in modules:
            module = importlib.import_module(m)
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r} (it was split into {', '.join(modules)})")
    return __getattr__


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())


def lazy_names(package: str, names: dict[str, str | tuple[str, str]]):
    """A module `__getattr__` that serves old names from where they are now (hybrid.tune.tune ->
    hybrid.tune.trials.tune; a renamed one as (module, new name)), each with a DeprecationWarning."""
    def __getattr__(name: str):
        if name in names:
            module, new = names[name] if isinstance(names[name], tuple) else (names[name], name)
            warn_moved(f"{package}.{name}", f"{module}.{new}")
            return getattr(importlib.import_module(module), new)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__
