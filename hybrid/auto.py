"""auto_wrap: profile -> estimate every candidate -> choose -> mesh -> backend -> Wrapped."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from .backends import apply
from .backends.base import check_optimizer_factory
from .catalogue import get_strategy, load_catalogue
from .cluster import Cluster, detect
from .errors import HybridError
from .mesh import build_mesh, init_distributed
from .planner import plan as make_plan
from .profile import profile_module
from .spec import TrainSpec
from .wrapped import Wrapped


def optimizer_kind(factory) -> str:
    """Which optimizer the factory builds (for the memory model), probed on a dummy parameter."""
    probe = factory([nn.Parameter(torch.zeros(1))])
    name = type(probe).__name__.lower()
    if "adafactor" in name:
        return "adafactor"
    if name == "sgd":
        return "sgd"
    return "adamw"


def prepare_for_training(model: nn.Module) -> None:
    """HF models build a KV cache in forward unless told not to: in training it only costs memory,
    and recomputation (checkpointing) would see the cache the first forward filled."""
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "use_cache", False):
        cfg.use_cache = False


def default_precision(runtime) -> str:
    if runtime.device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16-mixed"
    return "fp32"


def auto_wrap(model: nn.Module, optimizer=None, *, micro_batch: int = 1, seq_len: int | None = None,
              strategy: str = "auto", precision: str | None = None, cluster: Cluster | None = None,
              activation_checkpointing: str | None = None, attention: str = "sdpa",
              shard_size: int | None = None, gpu_memory: str | int | None = None,
              strategies_dir: tuple[str, ...] = (), verbose: bool = True) -> Wrapped:
    """Wrap `model` for data-parallel training on the current process group (started here from
    torchrun's variables if needed, nccl+cuda or gloo+cpu).

    optimizer   callable(params) -> torch optimizer (default AdamW lr 3e-4)
    strategy    "auto" (the fastest candidate that fits), or a catalogue name to force
    precision   fp32 | bf16-mixed | bf16 (default bf16-mixed where the GPU supports it, else fp32)
    activation_checkpointing  none | selective | full; default: the planner chooses
    cluster     the cluster spec to plan against (default: detected; must match the world size)
    gpu_memory  override the per-GPU capacity (e.g. "8GiB") for planning
    """
    if not isinstance(model, nn.Module):
        raise HybridError(f"auto_wrap needs an nn.Module, got {type(model).__name__}")
    optimizer = optimizer or (lambda ps: torch.optim.AdamW(ps, lr=3e-4))
    check_optimizer_factory(optimizer)
    runtime = init_distributed()
    if cluster is None:
        cluster = detect(gpu_memory)
    elif gpu_memory is not None:
        cluster = Cluster.build(cluster.nodes, cluster.gpus_per_node, cluster.gpu, gpu_memory)
    if cluster.world_size != runtime.world_size:
        raise HybridError(f"the cluster spec has {cluster.world_size} GPUs ({cluster.nodes} x "
                          f"{cluster.gpus_per_node}) but this job runs {runtime.world_size} ranks")
    prepare_for_training(model)
    profile = profile_module(model)
    mp = profile.max_positions
    spec = TrainSpec(micro_batch=micro_batch, seq_len=seq_len or min(mp or 2048, 4096),
                     precision=precision or default_precision(runtime), optimizer=optimizer_kind(optimizer),
                     activation_checkpointing=activation_checkpointing or "none", attention=attention)
    catalogue = load_catalogue(strategies_dir)
    search = activation_checkpointing is None
    if strategy == "auto":
        the_plan = make_plan(profile, spec, cluster, catalogue, shard_size, search_checkpointing=search)
        if the_plan.chosen is None:
            fixes = "; ".join(the_plan.suggestions) or "none found"
            raise HybridError(f"no strategy fits {profile.name} in {cluster.describe()}. Smallest changes that "
                              f"would: {fixes}. Run `hybrid plan` for every candidate and why it was rejected")
    else:
        get_strategy(strategy, catalogue)
        the_plan = make_plan(profile, spec, cluster, catalogue, shard_size, strategies=[strategy],
                             search_checkpointing=search, search_shards=False)
        if the_plan.chosen is None:      # forced: run the least memory-hungry variant anyway
            usable = [c for c in the_plan.candidates if c.memory is not None]
            if not usable:
                raise HybridError(f"strategy {strategy!r} cannot run this job: {the_plan.candidates[0].reason}")
            chosen = min(usable, key=lambda c: c.memory.total)
            the_plan = dataclasses.replace(the_plan, chosen=chosen)
            if runtime.rank == 0:
                print(f"hybrid: warning: {strategy} is forced but {chosen.reason}", flush=True)
    chosen = _agree(the_plan.chosen, runtime)
    mesh = build_mesh(chosen.shard_size, runtime, cluster.gpus_per_node)
    engine = apply(chosen.strategy, model, optimizer, mesh, chosen.spec, runtime)
    wrapped = Wrapped(engine, the_plan, chosen, mesh, runtime)
    if verbose and runtime.rank == 0:
        print(wrapped.describe(), flush=True)
    return wrapped


def _agree(chosen, runtime):
    """Every rank must apply the same strategy; if their capacities differ, all of them say so."""
    if runtime.world_size == 1:
        return chosen
    choices = [None] * runtime.world_size
    dist.all_gather_object(choices, (chosen.name, chosen.shard_size))
    if len(set(choices)) > 1:
        raise HybridError(f"ranks chose different strategies {sorted(set(choices))}: they see different "
                          "GPU capacities; pass the same cluster= (or gpu_memory=) on every rank")
    return chosen
