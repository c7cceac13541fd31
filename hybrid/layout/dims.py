"""ParallelDims: the one value that says how the world's ranks are laid out (pure until build_mesh).

    ParallelDims(dp_replicate, dp_shard, cp, tp, pp)   dp_replicate * dp_shard * cp * tp * pp == world

The mesh is ("pp", "dp_replicate", "dp_shard", "cp", "tp") with tp innermost: torchrun numbers
ranks node by node, so the innermost dimensions are consecutive ranks. tp groups (the most traffic)
stay inside a scale-up domain (NVLink: the node on HGX machines, a rack of 18 trays on NVL72); a
cp x tp block (a K/V all-gather per layer) and a dp_shard x cp x tp block (FSDP shards parameters
over dp_shard x cp, as torchtitan does) are inside a domain or span whole ones; replicas and
pipeline stages (the least traffic) cross nodes. cp ranks read the same
sequences (each holds two of its 2cp chunks), so the data ranks are dp_replicate x dp_shard.
Every rule is checked once, here, and every error prints the equation and the valid choices.
Nothing outside this value computes rank groups.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import HybridError

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_DIM_NAMES = ("pp", "dp_replicate", "expert_shard", "ep", "tp")
"""The same ranks seen by the experts (ep > 1): dp_shard x cp split into expert_shard x ep, ep
innermost (consecutive ranks: the all-to-alls stay inside a node), as torchtitan's sparse mesh."""


def divisors(n: int) -> list[int]:
    """Every divisor of n, ascending, in O(sqrt(n)) (plans for a world of 1e12 answer at once)."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def valid_shard_sizes(world: int, per_node: int, tp: int = 1) -> list[int]:
    """dp_shard sizes whose dp_shard x tp block lies inside a node (a divisor of the GPUs per node)
    or on whole nodes (the GPUs per node times a divisor of the node count)."""
    if world % per_node or per_node % tp:
        return []
    nodes = world // per_node
    inside = [d // tp for d in divisors(per_node) if d % tp == 0 and d <= world]
    return sorted(set(inside + [per_node * k // tp for k in divisors(nodes) if k > 1]))


def _unit(per_node: int, domain: int | None) -> tuple[int, str]:
    """(GPUs of the unit groups keep inside, its name): the node, or a scale-up domain of several."""
    return (per_node, "node") if domain in (None, per_node) else (domain, "NVLink domain")


def validate_shard_size(n: int, world: int, per_node: int, domain: int | None = None) -> None:
    """Shard groups are consecutive ranks: inside one node (or one scale-up `domain` of several
    nodes), or whole ones."""
    per_node, unit = _unit(per_node, domain)
    if not isinstance(n, int) or n < 1:
        raise HybridError(f"shard size must be a positive integer, got {n!r}")
    if n > world:
        raise HybridError(f"shard size {n} is larger than the world size {world}; use at most {world}")
    if world % n:
        raise HybridError(f"world size {world} is not divisible by shard size {n}: "
                          f"replicate x shard must equal the world; valid sizes: {_divisors(world, per_node)}")
    if n <= per_node and per_node % n:
        raise HybridError(f"shard size {n} does not divide the {per_node} GPUs per {unit}, so a shard group "
                          f"would straddle {unit}s; valid sizes: {_divisors(world, per_node)}")
    if n > per_node and n % per_node:
        raise HybridError(f"shard size {n} spans {unit}s but is not a whole number of {unit}s "
                          f"({per_node} GPUs each); valid sizes: {_divisors(world, per_node)}")


def check_group_shard_size(n: int, world: int, per_node: int, tp: int = 1, cp: int = 1,
                           domain: int | None = None) -> None:
    """A shard size over cp x tp groups of ranks: with neither, the plain rule above; else it
    divides the groups and the whole layout fits the node (or domain) and world shape (ParallelDims)."""
    g = tp * cp
    if g == 1:
        return validate_shard_size(n, world, per_node, domain)
    what = "tensor-parallel" if cp == 1 else "context x tensor-parallel"
    if n < 1 or (world // g) % n:
        raise HybridError(f"shard size {n} does not divide the {world // g} {what} groups")
    ParallelDims(dp_replicate=world // g // n, dp_shard=n, cp=cp, tp=tp).validate(world, per_node, domain)


def _divisors(world: int, per_node: int) -> str:
    return ", ".join(map(str, valid_shard_sizes(world, per_node)))



@dataclass(frozen=True)
class ParallelDims:
    """How many ways each dimension splits the world. 1 = that dimension is not used."""

    dp_replicate: int = 1
    """Data-parallel replicas: full copies (DDP), or copies of each shard group (HSDP)."""
    dp_shard: int = 1
    """Data-parallel ranks one copy of the model state is sharded over (FSDP/ZeRO); 1 = not sharded
    (FSDP also shards over cp: its shard group is dp_shard x cp)."""
    cp: int = 1
    """Context-parallel degree: each sequence split into 2cp chunks, two per rank; 1 = not split."""
    tp: int = 1
    """Tensor-parallel degree: each matrix split over this many ranks of one node."""
    pp: int = 1
    """Pipeline stages."""
    ep: int = 1
    """Expert-parallel degree (mixture-of-experts): each MoE layer's experts split over this many
    ranks taken from the dp_shard x cp ranks (as torchtitan does), tokens sent to their experts by
    all-to-all; not a factor of the world. 1 = every rank holds (its FSDP share of) every expert."""

    def __post_init__(self):
        for name in DIM_NAMES + ("ep",):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise HybridError(f"ParallelDims.{name} must be a positive integer, got {v!r}")
        if (self.dp_shard * self.cp) % self.ep:
            valid = ", ".join(map(str, divisors(self.dp_shard * self.cp)))
            raise HybridError(f"ep {self.ep} must divide dp_shard({self.dp_shard}) x cp({self.cp}) = "
                              f"{self.dp_shard * self.cp}: expert-parallel ranks are taken from the sharded "
                              f"data-parallel ranks; valid ep: {valid}")

    @property
    def expert_shard(self) -> int:
        """Ranks one expert's state is FSDP-sharded over: dp_shard x cp / ep (the dense layers use
        all dp_shard x cp)."""
        return self.dp_shard * self.cp // self.ep

    @classmethod
    def data_parallel(cls, world: int, shard_size: int) -> "ParallelDims":
        """Pure data parallelism: world / shard_size replicas of shard groups of shard_size."""
        if shard_size < 1 or world % shard_size:
            raise HybridError(f"world size {world} is not divisible by shard size {shard_size}: "
                              "dp_replicate x dp_shard must equal the world")
        return cls(dp_replicate=world // shard_size, dp_shard=shard_size)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp_size(self) -> int:
        """Ranks that read different data: every rank of one cp x tp group and one stage reads the same."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    def validate(self, world: int, gpus_per_node: int, domain: int | None = None) -> "ParallelDims":
        """The layout fits this world and node size; returns self. `domain`: GPUs of one scale-up
        domain (a whole number of nodes; None: the node): tp, cp x tp and shard groups stay inside
        one or take whole ones, pipeline stages take whole nodes."""
        eq = (f"pp({self.pp}) x dp_replicate({self.dp_replicate}) x dp_shard({self.dp_shard}) x cp({self.cp}) "
              f"x tp({self.tp}) = {self.world_size}")
        if gpus_per_node < 1 or world % gpus_per_node:
            raise HybridError(f"world size {world} is not a multiple of {gpus_per_node} ranks per node")
        if self.world_size != world:
            raise HybridError(f"{eq}, but the world has {world} ranks; the product must equal the world")
        domain = domain or gpus_per_node
        if self.pp > 1:                   # a stage: whole nodes, or a share of a single node
            nodes = world // gpus_per_node
            if nodes % self.pp == 0:
                world //= self.pp
                domain = math.gcd(domain, world)      # the stage's share of a domain (whole nodes)
            elif nodes == 1 and gpus_per_node % self.pp == 0:
                world //= self.pp
                gpus_per_node //= self.pp
                domain = gpus_per_node
            else:
                raise HybridError(f"pp {self.pp} must divide the {nodes} nodes (each stage on whole nodes), or the "
                                  f"GPUs of a single node")
        per, unit = _unit(gpus_per_node, domain)
        if per % self.tp:
            valid = divisors(per)
            raise HybridError(f"tp {self.tp} does not divide the {per} GPUs per {unit}, so a tensor-parallel "
                              f"group would cross {unit}s; valid tp: {', '.join(map(str, valid))}")
        if gpus_per_node % self.tp and self.tp % gpus_per_node:      # a domain of several nodes: whole nodes
            valid = [t for t in divisors(per) if gpus_per_node % t == 0 or t % gpus_per_node == 0]
            raise HybridError(f"tp {self.tp} neither divides the {gpus_per_node} GPUs per node nor is a whole number "
                              f"of nodes, so a tensor-parallel group would take part of a node; valid tp: "
                              f"{', '.join(map(str, valid))}")
        if self.cp > 1:                   # a cp x tp group: inside a node (domain) or whole ones
            group = self.cp * self.tp
            if not (per % group == 0 or group % per == 0):
                valid = [c for c in divisors(world // self.tp) if (c * self.tp) % per == 0
                         or per % (c * self.tp) == 0]
                raise HybridError(f"cp {self.cp} x tp {self.tp} = {group} ranks neither divides the {per} "
                                  f"GPUs per {unit} nor is a whole number of {unit}s, so a context-parallel group "
                                  f"would straddle {unit}s; valid cp: {', '.join(map(str, valid))}")
        if self.tp == 1 and self.cp == 1:  # the data-parallel messages users know from --shard-size
            validate_shard_size(self.dp_shard, world, gpus_per_node, domain)
        block = self.dp_shard * self.cp * self.tp
        inside = block <= per and per % block == 0
        whole = block > per and block % per == 0
        if not (inside or whole):
            valid = ", ".join(map(str, valid_shard_sizes(world, per, self.cp * self.tp)))
            where = ("does not divide the" if block <= per else f"spans {unit}s but is not a whole number of")
            inner = f"x cp {self.cp} " if self.cp > 1 else ""
            raise HybridError(f"dp_shard {self.dp_shard} {inner}x tp {self.tp} = {block} ranks {where} {per} "
                              f"GPUs per {unit}, so a shard group would straddle {unit}s; valid dp_shard sizes: "
                              f"{valid}")
        return self

    @property
    def expert_shape(self) -> tuple[int, int, int, int, int]:
        """The shape of the experts' mesh, EXPERT_DIM_NAMES."""
        return (self.pp, self.dp_replicate, self.expert_shard, self.ep, self.tp)

    def build_mesh(self, device_type: str):
        """The named DeviceMesh ("pp", "dp_replicate", "dp_shard", "cp", "tp"); size-1 dims are kept
        so every sub-mesh can be asked for by name. With ep > 1 it also carries, as `.experts`, the
        mesh EXPERT_DIM_NAMES over the same ranks and root (so FSDP can stack the experts' ep
        sharding with its own): expert weights live on "ep" and are FSDP-sharded over
        ("dp_replicate",) "expert_shard" (hybrid.runtime.mesh.ep_mesh, expert_dp_mesh)."""
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=DIM_NAMES)
        if self.ep > 1:
            # torchtitan unflattens its world mesh the same way (parallel_dims.py, sparse mesh)
            mesh.experts = mesh._flatten("world")._unflatten(0, self.expert_shape, EXPERT_DIM_NAMES)
        return mesh

    def to_dict(self) -> dict:
        out = {name: getattr(self, name) for name in DIM_NAMES[1:] + DIM_NAMES[:1]}
        if self.ep > 1:                   # dense plans keep their JSON as it was
            out["ep"] = self.ep
        return out

    def describe(self) -> str:
        used = [f"{n} {getattr(self, n)}" for n in DIM_NAMES + ("ep",) if getattr(self, n) > 1]
        return " x ".join(used) if used else "one rank"
