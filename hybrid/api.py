"""The public estimation API: `hybrid.plan` and `hybrid.estimate` take the same model forms and the
same training arguments as the CLI, and answer as the CLI does (pure: no torch for presets).

    hybrid.plan("llama2-7b", cluster=hybrid.Cluster.build(8, 8, "h100-80gb"), seq_len=4096)
    hybrid.estimate("llama2-7b", "fsdp", cluster=..., micro_batch=2)

A model is a preset name, a transformers config.json (or a folder holding one),
`package.module:factory`, a ModelProfile, an nn.Module, or a callable returning one.
"""
from __future__ import annotations

from dataclasses import fields

from .families.catalogue import DEFAULT_STRATEGY, get_strategy, load_catalogue
from .config.cluster import Cluster, as_cluster
from .config.options import OPTIONS
from .errors import HybridError, short
from .layout.layout import Layout
from .estimation.memory.analytic import estimate as _analytic
from .estimation.memory.breakdown import MemoryBreakdown
from .model.profile import ModelProfile, build_profile
from .model.sources import resolve_model
from .config.spec import TrainSpec, check_precision, default_precision, default_seq_len

TRAIN_KEYS = tuple(f.name for f in fields(TrainSpec))
"""The training arguments plan() and estimate() take as keywords (TrainSpec's fields; plan()
also global_batch_tokens)."""


def profile_of(model) -> ModelProfile:
    """Any accepted model form -> its ModelProfile."""
    if isinstance(model, ModelProfile):
        return model
    if isinstance(model, str):
        OPTIONS["model"].check(model, "model")
        return resolve_model(model).profile
    if hasattr(model, "parameters"):                    # an nn.Module (no torch import needed to tell)
        return build_profile(model)
    if callable(model):
        built = model()
        if not hasattr(built, "parameters"):
            raise HybridError(f"model is a callable that returned {type(built).__name__} {short(built)}, not an "
                              "nn.Module; pass a callable that builds the module, or the module itself")
        return build_profile(built)
    raise HybridError(f"model must be a preset name, a config.json path, 'package.module:factory', a ModelProfile, "
                      f"an nn.Module or a callable returning one; got {type(model).__name__}")


def lora_of_model(model, train: dict) -> None:
    """A PEFT module's LoRA (model/lora.lora_of) as the job's `lora` unless one is given."""
    if train.get("lora") is None and hasattr(model, "parameters"):
        from .model.lora import lora_of
        found = lora_of(model)
        if found is not None:
            train["lora"] = found


def check_arguments(**values) -> None:
    """The arguments through the CLI's checks of the options of the same name (hybrid/config/options.py:
    type, range, choices); a value of another type than the option's strings (a Checkpointing, a
    GPUSpec) is left to the constructor that takes it."""
    for name, value in values.items():
        option = OPTIONS[name]
        if value is None or (option.kind == "str" and not isinstance(value, str)
                              and not (option.number_text and isinstance(value, (int, float)))):
            continue
        option.check(value, name)


def _check_dirs(strategies_dir) -> tuple[str, ...]:
    if isinstance(strategies_dir, str):
        raise HybridError(f"strategies_dir must be a list of folders, e.g. strategies_dir=[{short(strategies_dir)}], "
                          f"got the string {short(strategies_dir)}")
    return tuple(OPTIONS["strategies_dir"].check(list(strategies_dir or ()), "strategies_dir"))


def train_spec(profile: ModelProfile, cluster: Cluster, **train) -> TrainSpec:
    """TrainSpec from keyword arguments, with the CLI's defaults: the model's sequence length (at
    most 4096) and the GPU's precision."""
    unknown = sorted(set(train) - set(TRAIN_KEYS))
    if unknown:
        raise HybridError(f"unknown training argument(s) {', '.join(unknown)}; valid: {', '.join(TRAIN_KEYS)}")
    check_arguments(**{k: v for k, v in train.items() if k in OPTIONS})
    train = {k: v for k, v in train.items() if v is not None}
    train.setdefault("seq_len", default_seq_len(profile.max_positions))
    train.setdefault("precision", default_precision(cluster))
    check_precision(train["precision"], cluster)
    from .estimation.float8 import check_float8
    spec = TrainSpec(**train)
    check_float8(spec, cluster)
    return spec


def plan(model, cluster: Cluster | None = None, *, strategies: list[str] | None = None, tp: int | None = None,
         pp: int | None = None, ep: int | None = None, schedule: str | None = None, shard_size: int | None = None,
         efficiency: float | None = None, strategies_dir: tuple[str, ...] = (), **train):
    """Every candidate layout for `model` on `cluster` (default one node of 8 H100-80GB), ranked,
    with the choice and why: what `hybrid plan` prints. Checkpointing is searched unless
    `activation_checkpointing=` pins it; tp, pp and (for an MoE decoder) ep are searched unless pinned. With
    `global_batch=` (sequences per step) or `global_batch_tokens=` every layout trains that batch
    at its own micro-batch and accumulation (searched; `micro_batch=` pins the micro-batch); without
    them every layout trains micro-batch x accumulation x the world (planner.implied_batch), as
    `hybrid plan` does."""
    from .planning.batch import global_batch_of
    from .planning.planner import plan as _plan

    cluster = as_cluster(cluster) or Cluster.build()
    if isinstance(strategies, str) or (strategies is not None and not isinstance(strategies, (list, tuple))):
        raise HybridError(f"strategies must be a list of catalogue names, e.g. strategies=[{short(strategies)}], "
                          f"got {type(strategies).__name__} {short(strategies)}")
    for name in strategies or ():
        OPTIONS["strategy"].check(name, "strategies")
    check_arguments(tp=tp, pp=pp, ep=ep, schedule=schedule, shard_size=shard_size, efficiency=efficiency,
                    global_batch_tokens=train.get("global_batch_tokens"))
    strategies_dir = _check_dirs(strategies_dir)
    profile = profile_of(model)
    lora_of_model(model, train)
    tokens = train.pop("global_batch_tokens", None)
    if train.get("global_batch") is not None or tokens is not None:
        seq = train.get("seq_len") or default_seq_len(profile.max_positions)
        train["global_batch"] = global_batch_of(train.get("global_batch"), tokens, seq,
                                                train.get("gradient_accumulation"), cli=False)
    pin = train.get("micro_batch")
    spec = train_spec(profile, cluster, **train)
    return _plan(profile, spec, cluster, load_catalogue(strategies_dir), shard_size, strategies=strategies,
                 tp=tp, pp=pp, ep=ep, schedule=schedule, efficiency=efficiency, micro_batch=pin,
                 search_checkpointing=train.get("activation_checkpointing") is None, hold_batch=True)


def estimate(model, strategy: "str | Layout" = DEFAULT_STRATEGY, cluster: Cluster | None = None,
             spec: TrainSpec | None = None, shard_size: int | None = None, strategies_dir: tuple[str, ...] = (),
             **train) -> MemoryBreakdown:
    """Per-GPU memory of `strategy` for `model` (any form plan() takes): a preset's name (at tp = pp
    = 1, its shard size or `shard_size`) or a whole Layout (hybrid.layout.Layout.of). Training
    arguments come as keywords (micro_batch=2, seq_len=4096, ...) or as a whole `spec`."""
    cluster = as_cluster(cluster) or Cluster.build()
    if not isinstance(strategy, (str, Layout)):
        raise HybridError(f"strategy must be a catalogue name or a hybrid.layout.Layout, got "
                          f"{type(strategy).__name__} {short(strategy)}")
    if isinstance(strategy, str):
        OPTIONS["strategy"].check(strategy, "strategy")
    if spec is not None and not isinstance(spec, TrainSpec):
        raise HybridError(f"spec must be a hybrid TrainSpec, got {type(spec).__name__} {short(spec)}; or pass "
                          "training keywords (micro_batch=2, seq_len=4096)")
    check_arguments(shard_size=shard_size)
    strategies_dir = _check_dirs(strategies_dir)
    profile = profile_of(model)
    if spec is not None and train:
        raise HybridError(f"pass either spec= or training keywords ({', '.join(sorted(train))}), not both")
    if spec is None:
        lora_of_model(model, train)
    spec = spec or train_spec(profile, cluster, **train)
    if spec.global_batch is not None:
        raise HybridError("estimate() takes one batch shape (micro_batch=, gradient_accumulation=); a global_batch "
                          "is searched per layout by hybrid.plan()")
    if not isinstance(strategy, Layout):
        strategy = Layout.of(get_strategy(strategy, load_catalogue(strategies_dir)), cluster, spec,
                             shard_size=shard_size)
    return _analytic(strategy, profile, spec, cluster)
