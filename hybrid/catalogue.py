"""The strategy catalogue: one YAML file per preset (strategies/*.yaml shipped in the package, plus
any directories a user adds). Loaded and validated once; the CLI's choices come from here."""
from __future__ import annotations

import importlib.resources
import os
from dataclasses import dataclass, fields
from typing import Literal

import yaml

from .errors import HybridError, unknown_name

Family = Literal["ddp", "fsdp", "deepspeed"]

_COMMON = {"name", "family", "description", "shard", "complexity"}
_KNOBS = {
    "ddp": {"bucket_cap_mb", "gradient_as_bucket_view", "static_graph"},
    "fsdp": {"reshard_after_forward", "offload_params", "offload_optimizer"},
    "deepspeed": {"stage", "offload_optimizer", "offload_params", "hpz", "reduce_bucket_size",
                  "allgather_bucket_size", "prefetch_bucket_size", "max_live_parameters",
                  "max_reuse_distance", "param_persistence_threshold"},
}


@dataclass(frozen=True)
class Strategy:
    """A named preset: which backend, how wide the shard group is, and the knobs it fixes."""

    name: str
    family: Family
    description: str = ""
    shard: str = "world"
    """Shard-group size rule: 'none' (1, plain replication), 'node' (gpus per node), 'world', or a
    number of ranks. Resolved against a cluster by `shard_size`."""
    complexity: int | None = None
    """Tie-break rank, lower is simpler; derived from the knobs when not given."""
    # ddp
    bucket_cap_mb: float = 25.0
    """DDP all-reduce bucket size in MB (torch default 25)."""
    gradient_as_bucket_view: bool = True
    """DDP: gradients are views into the buckets (one gradient copy instead of two)."""
    static_graph: bool = False
    """DDP static_graph (same used parameters every step)."""
    # fsdp
    reshard_after_forward: bool = True
    """FSDP2: free gathered params after each block's forward (re-gather in backward)."""
    # fsdp + deepspeed
    offload_optimizer: bool = False
    """Optimizer state (and fp32 master, and for FSDP the step itself) on the host."""
    offload_params: bool = False
    """Parameter shards on the host, copied in per use."""
    # deepspeed
    stage: int = 0
    """ZeRO stage 1, 2 or 3 (0 for non-DeepSpeed families)."""
    hpz: str | None = None
    """ZeRO++ hpZ secondary partition size rule ('node' or a number); None = off."""
    reduce_bucket_size: int | None = None
    """Elements per gradient reduce bucket; None = hidden^2 (HF 'auto'), 5e8 if unknown."""
    allgather_bucket_size: int = 500_000_000
    """ZeRO-1/2 elements per parameter all-gather bucket (DeepSpeed default 5e8)."""
    prefetch_bucket_size: int | None = None
    """ZeRO-3 elements prefetched ahead; None = 0.9 hidden^2 (HF 'auto'), 5e7 if unknown."""
    max_live_parameters: int = 1_000_000_000
    """ZeRO-3 cap on gathered elements alive at once (DeepSpeed default 1e9)."""
    max_reuse_distance: int = 1_000_000_000
    """ZeRO-3 keeps a gathered parameter if it is used again within this many parameter fetches
    (DeepSpeed default 1e9): the last blocks of forward stay gathered into backward."""
    param_persistence_threshold: int | None = None
    """ZeRO-3: params smaller than this stay whole on every rank; None = 10 hidden (HF 'auto')."""
    source: str = "<builtin>"

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.strip() or not all(
                c.isalnum() or c in "-_." for c in self.name):
            raise HybridError(f"{self.source}: strategy name {self.name!r} must be a non-empty string of letters, "
                              "digits, '-', '_' or '.'")
        where = f"{self.source}: strategy {self.name!r}"
        if not isinstance(self.description, str):
            raise HybridError(f"{where}: description must be a string, got {self.description!r}")
        if isinstance(self.bucket_cap_mb, bool) or not isinstance(self.bucket_cap_mb, (int, float)) \
                or not 0 < self.bucket_cap_mb <= 1e6:
            raise HybridError(f"{where}: bucket_cap_mb must be a positive number of MB, got {self.bucket_cap_mb!r}")
        if self.complexity is not None and (isinstance(self.complexity, bool) or not isinstance(self.complexity, int)):
            raise HybridError(f"{where}: complexity must be an integer, got {self.complexity!r}")
        if self.family not in _KNOBS:
            raise HybridError(f"{where}: family {self.family!r} is not one of ddp, fsdp, deepspeed")
        shard = str(self.shard).lower()
        if shard not in ("none", "node", "world") and not (shard.isdigit() and int(shard) >= 1):
            raise HybridError(f"{where}: shard {self.shard!r} must be none, node, world or a positive integer")
        object.__setattr__(self, "shard", shard)
        if self.family == "ddp" and shard not in ("none", "1"):
            raise HybridError(f"{where}: ddp does not shard; use shard: none")
        if self.family == "deepspeed":
            if self.stage not in (1, 2, 3):
                raise HybridError(f"{where}: stage must be 1, 2 or 3, got {self.stage!r}")
            if shard != "world":
                raise HybridError(f"{where}: DeepSpeed ZeRO partitions over the whole world (shard: world); "
                                  "for node-local sharding use hpz: node with stage 3, or the fsdp family")
            if self.offload_params and self.stage != 3:
                raise HybridError(f"{where}: offload_params needs stage 3, got stage {self.stage}")
            if self.offload_optimizer and self.stage == 1:
                raise HybridError(f"{where}: DeepSpeed offloads the optimizer only with stage 2 or 3")
            if self.hpz is not None and self.stage != 3:
                raise HybridError(f"{where}: hpz needs stage 3, got stage {self.stage}")
        elif self.stage:
            raise HybridError(f"{where}: stage is a DeepSpeed knob; family is {self.family}")
        if self.family == "fsdp" and self.offload_params != self.offload_optimizer:
            raise HybridError(f"{where}: FSDP2's CPUOffloadPolicy moves params, grads and optimizer "
                              "together; set offload_params and offload_optimizer both true or both false")
        if self.hpz is not None:
            h = str(self.hpz).lower()
            if h != "node" and not (h.isdigit() and int(h) >= 1):
                raise HybridError(f"{where}: hpz {self.hpz!r} must be node or a positive integer")
            object.__setattr__(self, "hpz", h)

    # --- resolution against a cluster ----------------------------------------------------------
    @property
    def offload(self) -> bool:
        return self.offload_optimizer or self.offload_params

    @property
    def shard_is_free(self) -> bool:
        """Whether the planner / --shard-size may choose this strategy's shard size."""
        return self.family == "fsdp" and self.shard == "node"

    def shard_size(self, cluster, override: int | None = None) -> int:
        """Ranks per shard group on this cluster, validated against the node/world shape."""
        world, per_node = cluster.world_size, cluster.gpus_per_node
        if override is not None and self.shard_is_free:
            n = override
        else:
            n = {"none": 1, "node": per_node, "world": world}.get(self.shard) or int(self.shard)
        validate_shard_size(n, world, per_node)
        return n

    def hpz_size(self, cluster) -> int | None:
        if self.hpz is None:
            return None
        n = cluster.gpus_per_node if self.hpz == "node" else int(self.hpz)
        validate_shard_size(n, cluster.world_size, cluster.gpus_per_node)
        return n

    def rank(self) -> int:
        """Simplicity for tie-breaks: replication < partial sharding < full sharding < offload."""
        if self.complexity is not None:
            return self.complexity
        base = {"ddp": 0, "fsdp": 4, "deepspeed": 0}[self.family]
        if self.family == "deepspeed":
            base = {1: 1, 2: 2, 3: 6}[self.stage] + (1 if self.hpz else 0)
        elif not self.reshard_after_forward:
            base = 3
        elif self.shard == "world":
            base = 5
        return base + 10 * self.offload_optimizer + 2 * self.offload_params

    def knobs(self) -> dict:
        """The knobs this preset's family has, with their values (unset ones omitted)."""
        skip = {"name", "family", "description", "source", "complexity"}
        allowed = _COMMON | _KNOBS[self.family]
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in skip and f.name in allowed and getattr(self, f.name) is not None}


def validate_shard_size(n: int, world: int, per_node: int) -> None:
    """Shard groups are consecutive ranks: inside one node, or whole nodes."""
    if not isinstance(n, int) or n < 1:
        raise HybridError(f"shard size must be a positive integer, got {n!r}")
    if n > world:
        raise HybridError(f"shard size {n} is larger than the world size {world}; use at most {world}")
    if world % n:
        raise HybridError(f"world size {world} is not divisible by shard size {n}: "
                          f"replicate x shard must equal the world; valid sizes: {_divisors(world, per_node)}")
    if n <= per_node and per_node % n:
        raise HybridError(f"shard size {n} does not divide the {per_node} GPUs per node, so a shard group "
                          f"would straddle nodes; valid sizes: {_divisors(world, per_node)}")
    if n > per_node and n % per_node:
        raise HybridError(f"shard size {n} spans nodes but is not a whole number of nodes "
                          f"({per_node} GPUs each); valid sizes: {_divisors(world, per_node)}")


def divisors(n: int) -> list[int]:
    """Every divisor of n, ascending, in O(sqrt(n))."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def valid_shard_sizes(world: int, per_node: int) -> list[int]:
    """Shard sizes that divide the world and keep groups inside a node (divisors of the GPUs per
    node) or on whole nodes (the GPUs per node times a divisor of the node count)."""
    nodes = world // per_node
    inside = [d for d in divisors(per_node) if d <= world]
    return inside + [per_node * k for k in divisors(nodes) if k > 1]


def _divisors(world: int, per_node: int) -> str:
    return ", ".join(map(str, valid_shard_sizes(world, per_node)))


# --- loading ---------------------------------------------------------------------------------
def _lines(text: str) -> dict[str, int]:
    """Key -> 1-based line number of a flat YAML mapping (for error messages)."""
    node = yaml.compose(text)
    if node is None or not isinstance(node, yaml.MappingNode):
        return {}
    return {k.value: k.start_mark.line + 1 for k, _ in node.value}


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
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        data = yaml.safe_load(text)
    except UnicodeDecodeError:
        raise HybridError(f"{path}: not a text file (a strategy is a YAML mapping of knob: value)") from None
    except OSError as e:
        raise HybridError(f"{path}: cannot read it: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise HybridError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise HybridError(f"{path}: a strategy file must be a mapping of knob: value")
    lines = _lines(text)
    family = data.get("family")
    if family not in _KNOBS:
        raise HybridError(f"{path}:{lines.get('family', 1)}: family {family!r} must be one of ddp, fsdp, deepspeed")
    allowed = _COMMON | _KNOBS[family]
    for key in data:
        if key not in allowed:
            raise HybridError(f"{path}:{lines.get(key, 1)}: unknown key {key!r} for family {family}. "
                              f"Allowed: {', '.join(sorted(allowed))}")
    if "name" not in data:
        raise HybridError(f"{path}: missing 'name'")
    types = {f.name: str(f.type) for f in fields(Strategy)}
    for key, value in data.items():
        if not _type_ok(types[key], key, value):
            t = types[key]
            raise HybridError(f"{path}:{lines.get(key, 1)}: {key} must be {t}, got {value!r}")
    for key in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size",
                "max_live_parameters", "max_reuse_distance", "param_persistence_threshold"):
        if data.get(key) is not None:
            if data[key] < 0:
                raise HybridError(f"{path}:{lines.get(key, 1)}: {key} must be >= 0, got {data[key]!r}")
            data[key] = int(data[key])
    try:
        return Strategy(**data, source=path)
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
    for d in dirs:
        if not os.path.isdir(d):
            raise HybridError(f"strategy directory {d!r} does not exist")
        for fn in sorted(os.listdir(d)):
            if fn.endswith((".yaml", ".yml")):
                s = load_file(os.path.join(d, fn))
                out[s.name] = s
    return dict(sorted(out.items(), key=lambda kv: (kv[1].rank(), kv[0])))


def get_strategy(name: str, catalogue: dict[str, Strategy] | None = None) -> Strategy:
    cat = catalogue if catalogue is not None else load_catalogue()
    if name not in cat:
        raise unknown_name("strategy", name, cat)
    return cat[name]
