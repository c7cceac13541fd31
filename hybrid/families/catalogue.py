"""The strategy catalogue: one YAML file per preset (strategies/*.yaml shipped in the package, plus
any directories a user adds). Loaded and validated once; the CLI's choices come from here."""
from __future__ import annotations

import importlib.resources
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields


from ..config.files import key_lines, read_yaml
from ..errors import HybridError, short, unknown_name
from . import FAMILIES, get_family
from .base import FamilyConfig
from ..layout.dims import check_group_shard_size

DEFAULT_STRATEGY = "fsdp"
"""The preset hybrid.estimate() takes when none is named: FSDP2 sharding every parameter over all ranks."""

MAX_DIRS = 64
"""Most strategy directories read (--strategies-dir and HYBRID_STRATEGIES together)."""
MAX_FILES = 1000
"""Most YAML files read from one strategy directory (the package ships a dozen)."""

_COMMON = {"name", "family", "description", "shard", "complexity"}


@dataclass(frozen=True)
class Strategy:
    """A named preset: which backend, how wide the shard group is, and the knobs it fixes."""

    name: str
    family: str
    """A registered family: ddp, fsdp or deepspeed (hybrid/families/)."""
    description: str = ""
    shard: str = "world"
    """Shard-group size rule: 'none' (1, plain replication), 'node' (gpus per node), 'world', or a
    number of ranks. Resolved against a cluster by `shard_size`."""
    complexity: int | None = None
    """Tie-break rank of the preset, lower is simpler (Layout.simplicity); when not given, the
    family's rank of its knobs (Family.default_complexity), set once here."""
    config: FamilyConfig | Mapping | None = None
    """The family's typed knobs (families/*: DDPConfig, FSDPConfig, DeepSpeedConfig), validated
    there; a mapping of knob: value is turned into one, None is the family's defaults."""
    source: str = "<builtin>"

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.strip() or not all(
                c.isalnum() or c in "-_." for c in self.name):
            raise HybridError(f"{self.source}: strategy name {self.name!r} must be a non-empty string of letters, "
                              "digits, '-', '_' or '.'")
        where = f"{self.source}: strategy {self.name!r}"
        if not isinstance(self.description, str):
            raise HybridError(f"{where}: description must be a string, got {self.description!r}")
        if self.complexity is not None and (isinstance(self.complexity, bool) or not isinstance(self.complexity, int)):
            raise HybridError(f"{where}: complexity must be an integer, got {self.complexity!r}")
        if self.family not in FAMILIES:
            raise HybridError(f"{where}: family {self.family!r} is not one of {', '.join(FAMILIES)}")
        shard = str(self.shard).lower()
        if shard not in ("none", "node", "world") and not (shard.isdigit() and int(shard) >= 1):
            raise HybridError(f"{where}: shard {self.shard!r} must be none, node, world or a positive integer")
        object.__setattr__(self, "shard", shard)
        family = get_family(self.family)
        config = self.config if self.config is not None else {}
        if isinstance(config, Mapping):
            unknown = sorted(set(config) - family.knobs)
            if unknown:
                raise HybridError(f"{where}: {unknown[0]} is not a {self.family} knob; its knobs: "
                                  f"{', '.join(sorted(family.knobs))}")
            try:
                config = family.config(**config)
            except HybridError as e:
                raise HybridError(f"{where}: {e}") from None
        if not isinstance(config, family.config):
            raise HybridError(f"{where}: config must be a {family.config.__name__}, got {type(config).__name__}")
        object.__setattr__(self, "config", config)
        family.validate(self, where)
        if self.complexity is None:
            object.__setattr__(self, "complexity", get_family(self.family).default_complexity(self))

    # --- resolution against a cluster ----------------------------------------------------------
    @property
    def family_obj(self):
        """The registered family object (layout, communication, runtime, emission)."""
        return get_family(self.family)

    @property
    def offload(self) -> bool:
        """Anything kept in host memory (the family's config says)."""
        return self.config.offload

    @property
    def shard_is_free(self) -> bool:
        """Whether the planner / --shard-size may choose this strategy's shard size."""
        return self.family_obj.shard_is_free(self)

    def shard_size(self, cluster, override: int | None = None, tp: int = 1, cp: int = 1) -> int:
        """Ranks per shard group (dp_shard) on this cluster, validated against the node/world
        shape; with tensor or context parallelism the 'node' and 'world' rules count cp x tp
        groups, not GPUs."""
        world, per_node, domain = cluster.world_size, cluster.gpus_per_node, cluster.domain
        g = tp * cp
        if override is not None and self.shard_is_free:
            n = override
        else:
            n = {"none": 1, "node": max(per_node // g, 1), "world": world // g}.get(self.shard) or int(self.shard)
        check_group_shard_size(n, world, per_node, tp, cp, domain)
        return n

    def knobs(self) -> dict:
        """The knobs this preset's family has, with their values (unset ones omitted)."""
        knobs = {f.name: getattr(self.config, f.name) for f in fields(self.config)}
        return {k: v for k, v in {"shard": self.shard, **knobs}.items() if v is not None}


# --- loading ---------------------------------------------------------------------------------
def _type_ok(t: str, key: str, value) -> bool:
    """YAML values against the Strategy field's annotation (shard/hpz also take a number)."""
    if value is None:
        return "None" in t
    if isinstance(value, bool) or t == "bool":
        return isinstance(value, bool) and "bool" in t
    if key in ("shard", "hpz"):
        return isinstance(value, (str, int))
    if t.startswith("str"):
        return isinstance(value, str)
    if t.startswith("int") or t.startswith("float"):
        return isinstance(value, (int, float))
    return True


def load_file(path: str) -> Strategy:
    data, text = read_yaml(path, "strategy file", "a strategy is a few lines of knob: value")
    if not isinstance(data, dict):
        raise HybridError(f"{path}: a strategy file must be a mapping of knob: value")
    lines = key_lines(text)
    family = data.get("family")
    if not isinstance(family, str) or family not in FAMILIES:
        raise HybridError(f"{path}:{lines.get('family', 1)}: family {short(family)} "
                          f"must be one of {', '.join(FAMILIES)}")
    allowed = _COMMON | FAMILIES[family].knobs
    for key in data:
        if key not in allowed:
            raise HybridError(f"{path}:{lines.get(key, 1)}: unknown key {short(key)} for family {family}. "
                              f"Allowed: {', '.join(sorted(allowed))}")
    if "name" not in data:
        raise HybridError(f"{path}: missing 'name'")
    types = ({f.name: str(f.type) for f in fields(Strategy)}
             | {f.name: str(f.type) for f in fields(FAMILIES[family].config)})
    for key, value in data.items():
        if not _type_ok(types[key], key, value):
            t = types[key]
            raise HybridError(f"{path}:{lines.get(key, 1)}: {key} must be {t}, got {short(value)}")
    for key in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size",
                "max_live_parameters", "max_reuse_distance", "param_persistence_threshold"):
        if data.get(key) is not None:
            if data[key] < 0:
                raise HybridError(f"{path}:{lines.get(key, 1)}: {key} must be >= 0, got {data[key]!r}")
            data[key] = int(data[key])
    knobs = {k: data.pop(k) for k in list(data) if k in FAMILIES[family].knobs}
    try:
        return Strategy(**data, config=knobs, source=path)
    except HybridError as e:
        raise HybridError(str(e)) from None


def builtin_dir() -> str:
    return str(importlib.resources.files("hybrid.strategies"))


def load_catalogue(extra_dirs: tuple[str, ...] | list[str] = ()) -> dict[str, Strategy]:
    """Built-in presets, then each extra directory (a later file with the same name replaces an
    earlier one, so users can retune a preset)."""
    out: dict[str, Strategy] = {}
    dirs = [builtin_dir(), *extra_dirs]
    env = os.environ.get("HYBRID_STRATEGIES")
    if env:
        dirs += [d for d in env.split(os.pathsep) if d]
    if len(dirs) > 1 + MAX_DIRS:
        raise HybridError(f"{len(dirs) - 1} strategy directories (--strategies-dir, HYBRID_STRATEGIES); at most "
                          f"{MAX_DIRS} are read: merge them into fewer")
    for d in dirs:
        if not os.path.isdir(d):
            raise HybridError(f"strategy directory {str(d)[:200]!r} " + (
                "is not a folder; give the folder that holds the strategy YAML files" if os.path.lexists(d)
                else "does not exist"))
        try:
            names = sorted(fn for fn in os.listdir(d) if fn.endswith((".yaml", ".yml")))
        except OSError as e:
            raise HybridError(f"cannot list strategy directory {str(d)[:200]!r}: {e.strerror or e}") from None
        if len(names) > MAX_FILES:
            raise HybridError(f"strategy directory {str(d)[:200]!r} holds {len(names)} YAML files; at most "
                              f"{MAX_FILES} are read: keep only the strategies you use there")
        for fn in names:
            s = load_file(os.path.join(d, fn))
            out[s.name] = s
    return dict(sorted(out.items(), key=lambda kv: (kv[1].complexity, kv[0])))


def get_strategy(name: str, catalogue: dict[str, Strategy] | None = None) -> Strategy:
    cat = catalogue if catalogue is not None else load_catalogue()
    if name not in cat:
        raise unknown_name("strategy", name, cat)
    return cat[name]
