"""auto_wrap: profile -> estimate every candidate -> choose -> mesh -> backend -> Wrapped."""
from __future__ import annotations

import dataclasses
import inspect
import os
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn

from .runtime.backends.base import LoopOptions, check_optimizer_factory
from .families.catalogue import get_strategy, load_catalogue
from .config.cluster import ALLOC_CONF_VARS, Cluster, as_cluster, detect
from .errors import HybridError, NotApplicable, short
from .runtime.mesh import build_mesh, init_distributed
from .model.decoder import prepare_for_training
from .planning.reach import runtime_degrees
from .runtime.parallelize import build_engine, check_model, check_quantized_base, parallelize
from .model.lora import lora_of, quantization_of
from .planning.planner import plan as make_plan
from .model.profile import build_profile
from .config.spec import TrainSpec, default_precision, default_seq_len
from .units import parse_bytes
from .log import get_logger
from .runtime.wrapped import Wrapped, check_max_bad_steps

log = get_logger(__name__)


OPTIMIZER_CLASSES = {"AdamW": "adamw", "Adam": "adamw", "SGD": "sgd", "Adafactor": "adafactor", "Muon": "muon",
                     "AdamW8bit": "adamw-8bit", "Adam8bit": "adamw-8bit", "PagedAdamW8bit": "adamw-8bit",
                     "Lion": "lion", "MuonWithAuxAdam": "muon", "SingleDeviceMuonWithAuxAdam": "muon"}
"""Optimizer classes by name -> the state they keep (torch.optim's; bitsandbytes' 8-bit AdamW;
lion-pytorch's and bitsandbytes' 32-bit Lion; Keller Jordan's muon package's Muon with an
auxiliary AdamW, as DeepSpeed names it too: Muon on the hidden matrices, AdamW on the rest)."""


def optimizer_kind(factory) -> str:
    """Which optimizer the factory builds (for the memory model), read from the class it returns
    for a 2-D dummy parameter (torch.optim.Muon takes only matrices). A class hybrid does not know
    is priced as AdamW, said in one warning."""
    probe = factory([nn.Parameter(torch.zeros(2, 2))])
    if not isinstance(probe, torch.optim.Optimizer):
        raise HybridError(f"optimizer must be a callable that returns a torch.optim.Optimizer; it returned "
                          f"{type(probe).__name__} {short(probe)}: e.g. lambda ps: torch.optim.AdamW(ps, lr=3e-4)")
    name = type(probe).__name__
    if name not in OPTIMIZER_CLASSES:
        log.warning("hybrid: optimizer %s.%s is not one hybrid knows (%s): its state is priced as AdamW's, two "
                    "states per parameter in the parameter's dtype", type(probe).__module__, name,
                    ", ".join(sorted(OPTIMIZER_CLASSES)))
    return OPTIMIZER_CLASSES.get(name, "adamw")


def enable_expandable_segments(environ=os.environ) -> bool:
    """On CUDA, run the caching allocator with expandable segments unless the user configured it:
    freed blocks of any size are then reused, so reserved memory stays near allocated (about 10%
    above it instead of 28%: hybrid/estimation/memory/breakdown.py, calibrated on public runs; torchtitan's
    launcher sets the same). The variable is read when CUDA first allocates; if that already
    happened, the setting is applied to the live allocator. Returns whether it set it."""
    if any(v in environ for v in ALLOC_CONF_VARS) or not torch.cuda.is_available():
        return False
    environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    log.info("CUDA allocator: expandable_segments:True (set PYTORCH_CUDA_ALLOC_CONF to choose otherwise)")
    return True


def unwrap(model):
    """auto_wrap takes the plain model: nn.DataParallel is unwrapped (one process per GPU replaces
    it), and a model wrapped before is refused (its hooks and shards would be applied twice)."""
    if isinstance(model, nn.DataParallel):
        log.info("hybrid: unwrapping nn.DataParallel: auto_wrap runs one process per GPU (launch with "
                    "torchrun --nproc-per-node N), which replaces DataParallel's single-process threads")
        model = model.module
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel
    if isinstance(model, (DistributedDataParallel, FSDPModule)) or getattr(model, "_hybrid_wrapped", False) \
            or any(hasattr(p, "ds_id") for p in model.parameters()):
        raise HybridError(f"this {type(model).__name__} was already wrapped (by auto_wrap, DDP, FSDP or DeepSpeed): "
                          "build a fresh model for each auto_wrap call, or keep using the first Wrapped")
    return model


def _check_loop_args(max_grad_norm, scheduler):
    """The loop's arguments the job options do not cover (gradient_accumulation is one of them)."""
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                      or not max_grad_norm > 0):
        raise HybridError(f"max_grad_norm must be a positive number (or None for no clipping), got {max_grad_norm!r}")
    if scheduler is not None and not callable(scheduler):
        raise HybridError("scheduler must be a callable that takes the optimizer and returns an LR scheduler, e.g. "
                          f"lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup); got {scheduler!r}")


def _what_runs(model, spec: TrainSpec, catalogue: dict, tp, pp, cp):
    """The catalogue and degrees this model can run: chunked and fused losses replace a whole
    model's head (hybrid/runtime/loss.py), and a bitsandbytes base trains on CUDA only, whole on
    every rank (families that run it, tp, cp and pp 1)."""
    if spec.loss != "eager":
        tp, pp, cp = tp or 1, pp or 1, cp or 1
    check_quantized_base(model, None)
    if quantization_of(model):
        catalogue = {n: s for n, s in catalogue.items() if s.family_obj.runs_bitsandbytes_base}
        tp, pp, cp = tp or 1, pp or 1, cp or 1
    return catalogue, tp, pp, cp


def _replica_env(fault_tolerant: bool):
    """torchft's replica-group environment under fault_tolerant=True (checked before any process group)."""
    if not fault_tolerant:
        return None
    from .runtime.ft import ReplicaEnv, require_torchft
    require_torchft()
    return ReplicaEnv.read()


def auto_wrap(model: nn.Module, optimizer=None, *, micro_batch: int | None = None, seq_len: int | None = None,
              strategy: str = "auto", precision: str | None = None, cluster: Cluster | None = None,
              activation_checkpointing: str | None = None, attention: str = "sdpa",
              shard_size: int | None = None, gpu_memory: str | int | None = None,
              strategies_dir: tuple[str, ...] = (), verbose: bool = True, scheduler=None,
              gradient_accumulation: int | None = None, max_grad_norm: float | None = None,
              find_unused_parameters: bool | None = None, tp: int | None = None,
              config: str | None = None, pp: int | None = None, schedule: str | None = None,
              tune: bool | int = False, calibration: str | None = None, cp: int | None = None,
              global_batch: int | None = None, global_batch_tokens: int | None = None,
              compile: bool = False, float8: bool = False, float8_recipe: str | None = None, ep: int | None = None,
              moe_imbalance: float | None = None, max_bad_steps: int = 3, loss: str = "eager",
              resume: str | None = None, fault_tolerant: bool = False) -> Wrapped:
    """Wrap `model` for data-parallel training on the current process group (started here from
    torchrun's variables if needed, nccl+cuda or gloo+cpu). The arguments that are job options are
    the JobConfig's rows (hybrid/config/options.py): the CLI's flags of the same name, checked and
    defaulted as they are.

    optimizer   callable(params) -> torch optimizer (default AdamW lr 3e-4)
    strategy    "auto" (the fastest candidate that fits), or a catalogue name to force
    precision   fp32 | bf16-mixed | fp16-mixed | bf16 (default bf16-mixed where the GPU supports
                it, fp16-mixed on GPUs without bf16, fp32 on CPU ranks)
    activation_checkpointing  none | selective | op | full | layer:N; default: the planner
                chooses among none, selective and full
    cluster     the cluster spec to plan against (default: detected; must match the world size). A
                stated cluster is planned before any process group starts: a layout it cannot run is
                refused (NotApplicable, the line the plan's row and the estimate give) on every launch
    gpu_memory  override the per-GPU capacity (e.g. "8GiB") for planning
    scheduler   callable(optimizer) -> LR scheduler, stepped after every optimizer step
    micro_batch sequences per rank per forward (default 1; with global_batch or strategy "auto":
                chosen by the planner unless given); w.micro_batch says what to feed
    gradient_accumulation  micro-batches per optimizer step (gradients reduced once per window;
                default 1; with global_batch or strategy "auto": chosen by the planner);
                w.gradient_accumulation
    global_batch  sequences per optimizer step over all data-parallel ranks: the planner picks the
                layout's micro-batch and accumulation so that their product with w.dp_size is
                this (global_batch_tokens: the same in tokens, a multiple of seq_len). Without it,
                strategy "auto" holds micro_batch x gradient_accumulation x the cluster's GPUs for
                every candidate as `hybrid plan` does (planner.implied_batch), so a layout with tp,
                cp or pp trains the same batch at more accumulation; a forced strategy trains
                micro_batch x gradient_accumulation x its data-parallel ranks
    max_grad_norm  clip the global gradient norm before each optimizer step (None: no clipping)
    max_bad_steps  optimizer steps in a row with a non-finite loss or gradient norm (each skipped on
                every rank, with a warning) that stop training with a HybridError (default 3)
    find_unused_parameters  DDP: tolerate parameters that get no gradient in a step
    tp          tensor-parallel degree inside a node (default: the planner chooses with strategy
                "auto", 1 with a forced strategy); ranks of one tp group read the same batch:
                shard data with w.dp_size / w.dp_rank
    pp          pipeline stages (default: the planner chooses with strategy "auto", 1 with a
                forced strategy); the gradient_accumulation micro-batches flow through them and
                the loop is `loss = w.train_step(batch)`
    schedule    pipeline schedule: 1f1b | gpipe | interleaved (default: the planner chooses)
    tune        measure before training (strategy "auto"): run the plan's best layouts (True: 3,
                an int: that many, plus the plan's choice) for a few steps each on copies of this
                model with this optimizer (synthetic token ids of the job's shape), then wrap with
                the measured fastest (hybrid/tune/trials.py)
    calibration a calibration file (`hybrid tune --save-calibration`; default $HYBRID_CALIBRATION):
                the cluster's measured speed figures replace the catalogue's in the plan
    moe_imbalance  MoE models with expert parallelism: the busiest rank's routed tokens over the mean
                (default spec.MOE_IMBALANCE, 1.25; raise it for a cold start)
    cp          context-parallel degree: each sequence split over cp ranks (default: the planner
                chooses with strategy "auto" when seq_len >= 16384, else 1); the cp ranks of a
                group read the same whole sequences (shard data with w.dp_size / w.dp_rank) and
                each runs its 2 of 2cp chunks (hybrid/runtime/backends/cp.py)
    compile     torch.compile every block (and our decoders' loss) as torchtitan does, after
                checkpointing and before the data-parallel wrap (fsdp and ddp strategies)
    ep          expert-parallel degree for mixture-of-experts models (fsdp and hsdp strategies, tp 1):
                each MoE layer's experts split over ep ranks taken from the dp_shard x cp ranks, tokens
                sent to them by all-to-all (hybrid/runtime/backends/ep.py); default 1
    loss        eager (the whole fp32 logits) | chunked (head and cross-entropy per token chunk, each
                recomputed in backward: the logits are never whole) | fused (Liger's fused linear
                cross-entropy, CUDA, pip install 'hybrid[liger]'); chunked and fused replace the
                head of hybrid's decoders, without tp, cp or pp (hybrid/runtime/loss.py)
    float8      torchao float8 training of the block linears (tensorwise; float8 all-gather under
                FSDP2), behind compile=True, on GPUs with float8 tensor cores (Ada, Hopper, Blackwell, MI300)
    float8_recipe  with float8: "tensorwise" (default) or "mxfp8" (torchao's MX recipe, Blackwell, CUDA only)
    fault_tolerant  this job is one replica group of a torchft job (pip install 'hybrid[ft]'): the
                groups average their gradients through torchft's fault-tolerant all-reduce, a group
                that dies is dropped and rejoins from a healthy peer (hybrid/runtime/ft.py); the
                layout is planned for this group's ranks (fsdp or ddp), torchft's TORCHFT_LIGHTHOUSE,
                REPLICA_GROUP_ID and NUM_REPLICA_GROUPS say where the others are
                (docs/fault_tolerance.md)
    config      a job file (`hybrid plan --save-config`): its values fill every argument left at
                its default (arguments you pass win, as flags do over --config); nodes,
                gpus_per_node and gpu become the cluster
    """
    if config is not None:
        if not isinstance(config, (str, os.PathLike)):
            raise HybridError(f"config must be the path of a job file (`hybrid plan --save-config job.yaml`), got "
                              f"{type(config).__name__} {short(config)}")
        return _with_job_file(config, locals())
    from .config.options import WRAP_KEYS, or_default
    from .config.jobfile import check_arguments
    given = locals()
    check_arguments({k: given[k] for k in WRAP_KEYS}, "auto_wrap")       # the job options, checked as flags are
    if (global_batch is not None or global_batch_tokens is not None) and gradient_accumulation is not None:
        from .planning.batch import global_batch_of        # the conflict is known before any process group starts
        global_batch_of(global_batch, global_batch_tokens, seq_len or 1, gradient_accumulation, cli=False)
    if not isinstance(model, nn.Module):
        raise HybridError(f"auto_wrap needs an nn.Module, got {type(model).__name__}")
    model = unwrap(model)
    optimizer = optimizer or (lambda ps: torch.optim.AdamW(ps, lr=3e-4))
    check_optimizer_factory(optimizer)
    kind = optimizer_kind(optimizer)
    cluster = as_cluster(cluster)
    _check_loop_args(max_grad_norm, scheduler)
    check_max_bad_steps(max_bad_steps)
    replica_env = _replica_env(fault_tolerant)
    if cluster is None or cluster.expandable_segments:
        enable_expandable_segments()
    runtime = None
    if cluster is None:             # the live machine, read once this rank's device is set
        runtime = init_distributed()
        cluster = detect(gpu_memory)
        _check_world(cluster, runtime)
    elif gpu_memory is not None:
        cluster = replace(cluster, gpu=replace(cluster.gpu, memory_bytes=parse_bytes(gpu_memory)))
    # a stated cluster is planned before any process group starts: what its plan refuses is refused
    # on every launch, so no rank waits for its peers to learn it (init_distributed's device rule)
    cuda = runtime.device.type == "cuda" if runtime is not None else torch.cuda.is_available()
    prepare_for_training(model)
    profile = build_profile(model)
    mp = profile.max_positions
    from .planning.batch import global_batch_of
    seq_len = seq_len or default_seq_len(mp)
    gb = global_batch_of(global_batch, global_batch_tokens, seq_len, gradient_accumulation, cli=False)
    here = cluster if cuda else detect()     # CPU ranks train in fp32 whatever is planned
    spec = TrainSpec(micro_batch=or_default("micro_batch", micro_batch), seq_len=seq_len,
                     precision=precision or default_precision(here), optimizer=kind,
                     activation_checkpointing=or_default("activation_checkpointing", activation_checkpointing),
                     attention=attention, global_batch=gb, compile=compile, float8=float8, loss=loss,
                     float8_recipe=or_default("float8_recipe", float8_recipe),
                     gradient_accumulation=or_default("gradient_accumulation", gradient_accumulation),
                     moe_imbalance=or_default("moe_imbalance", moe_imbalance), lora=lora_of(model))
    from .estimation.float8 import check_float8
    check_float8(spec, cluster)
    catalogue, tp, pp, cp = _what_runs(model, spec, load_catalogue(strategies_dir), tp, pp, cp)
    search = activation_checkpointing is None
    from .estimation.calibration import resolve
    cal = resolve(calibration)
    if tune is not False and strategy != "auto":
        raise HybridError(f"tune= measures the planner's candidates; strategy={strategy!r} forces one: "
                          "drop one of them")
    said = []                       # warnings for rank 0, said once the ranks are known
    if strategy == "auto":
        # every candidate trains one global batch (the given one, else micro-batch x accumulation x the
        # world's GPUs: planner.implied_batch), each at its own micro-batch and accumulation, as
        # `hybrid plan` holds it; a given micro_batch pins the micro-batch
        the_plan = make_plan(profile, spec, cluster, catalogue, shard_size, search_checkpointing=search,
                             **runtime_degrees({"tp": tp, "pp": pp, "cp": cp, "ep": ep or 1}), schedule=schedule,
                             calibration=cal, micro_batch=micro_batch, hold_batch=True)
        if the_plan.chosen is None and the_plan.missing:
            the_plan = _choose_on_states(the_plan, profile, said)
        if the_plan.chosen is None:
            fixes = "; ".join(the_plan.suggestions) or "none found"
            raise HybridError(f"no strategy fits {profile.name} in {cluster.describe()}. Smallest changes that "
                              f"would: {fixes}. Run `hybrid plan` for every candidate and why it was rejected")
    else:
        # one layout, the strategy at the degrees given: its batch is the one given (micro-batch x
        # accumulation x its data-parallel ranks), or global_batch searched into it
        get_strategy(strategy, catalogue)
        the_plan = make_plan(profile, spec, cluster, catalogue, shard_size, strategies=[strategy],
                             search_checkpointing=search, search_shards=False, tp=tp or 1, pp=pp or 1,
                             schedule=schedule, calibration=cal, cp=cp or 1, ep=ep or 1,
                             micro_batch=micro_batch if gb is not None else None)
        if the_plan.chosen is None:      # forced: run the least memory-hungry variant anyway
            the_plan = _forced(the_plan, strategy, said)
    if tune is False:
        _check_choice(model, the_plan.chosen, replica_env, cluster)
    if runtime is None:
        runtime = init_distributed()
        _check_world(cluster, runtime)
    if runtime.rank == 0:
        for line in said:
            log.warning("%s", line)
    if tune is not False:
        from .tune.trials import tune_for_wrap
        the_plan = tune_for_wrap(the_plan, model, optimizer, runtime, cluster, tune, max_grad_norm)
        _check_choice(model, the_plan.chosen, replica_env, cluster)
    chosen = _agree(the_plan.chosen, runtime, strategy, cluster)
    if chosen.tight and runtime.rank == 0:
        log.warning("hybrid: %s %s", chosen.label, chosen.reason)
    mesh = build_mesh(chosen.parallel, runtime, cluster.gpus_per_node, cluster.domain)
    gradient_accumulation = chosen.spec.gradient_accumulation      # the plan's (searched at a global batch)
    options = LoopOptions(gradient_accumulation, max_grad_norm, bool(find_unused_parameters))
    parallel = parallelize(model, chosen.layout, mesh, chosen.spec, runtime, options)
    engine = build_engine(parallel, chosen.layout, mesh, chosen.spec, runtime, optimizer, options)
    model._hybrid_wrapped = True
    sched = scheduler(engine.user_optimizer) if scheduler is not None else None
    wrapped = Wrapped(engine, the_plan, chosen, mesh, runtime, gradient_accumulation, max_grad_norm, sched,
                      max_bad_steps)
    if replica_env is not None:
        from .runtime.ft import FaultTolerantReplicas
        from .runtime.mesh import default_timeout
        wrapped.ft = FaultTolerantReplicas(wrapped, replica_env, default_timeout(runtime.device.type == "cuda"))
    if verbose and runtime.rank == 0:
        log.info("%s", wrapped.describe())
    if resume is not None:
        _resume(wrapped, resume, runtime)
    return wrapped


def _check_choice(model, chosen, replica_env, cluster: Cluster) -> None:
    """What the chosen layout needs of the model (and of torchft), before any mesh is built."""
    if replica_env is not None:
        from .runtime.ft import check_layout
        check_layout(chosen)
    check_model(model, chosen.layout, chosen.spec, cluster.gpu.software)


def _check_world(cluster: Cluster, runtime) -> None:
    if cluster.world_size != runtime.world_size:
        raise HybridError(f"the cluster spec has {cluster.world_size} GPUs ({cluster.nodes} x "
                          f"{cluster.gpus_per_node}) but this job runs {runtime.world_size} ranks")


def _forced(the_plan, strategy: str, said: list):
    """A forced strategy whose candidates none fits: the least memory-hungry that can run, with a
    warning; when none can run at all, the reason the estimate gives (NotApplicable, the same line
    as the plan's row after its `not applicable: `), before anything starts."""
    usable = [c for c in the_plan.candidates if c.memory is not None]
    if not usable:
        reason = the_plan.candidates[0].reason
        if reason.startswith(NOT_APPLICABLE):
            raise NotApplicable(reason[len(NOT_APPLICABLE):])
        raise HybridError(f"strategy {strategy!r} cannot run this job: {reason}")
    chosen = min(usable, key=lambda c: c.memory.total)
    said.append(f"hybrid: warning: {strategy} is forced but {chosen.reason}")
    return dataclasses.replace(the_plan, chosen=chosen)


NOT_APPLICABLE = "not applicable: "
"""How a plan row that cannot run begins (planning/planner.judge), before the estimate's reason."""


def _resume(w: Wrapped, path, runtime) -> None:
    """Load the last committed version at `path` if there is one (every rank must see the same
    directory), saying where the job continues and whether its layout was planned afresh."""
    from .ckpt.folder import META
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise HybridError(f"resume must be the checkpoint directory w.save writes (a path), got {short(path)}")
    path = os.fspath(path)
    found = os.path.lexists(os.path.join(path, META))
    if runtime.world_size > 1:
        seen = [None] * runtime.world_size
        dist.all_gather_object(seen, found)
        if len(set(seen)) > 1:
            raise HybridError(f"resume={path!r}: ranks {[r for r, s in enumerate(seen) if s]} see a checkpoint there "
                              f"and ranks {[r for r, s in enumerate(seen) if not s]} do not; every rank must see the "
                              "same directory (a shared file system)")
    if not found:
        if runtime.rank == 0:
            log.info("hybrid: resume=%s holds no checkpoint yet: starting fresh at step 0", path)
        return
    meta = w.load_checkpoint(path)
    w.resumed_from = os.path.join(os.path.abspath(path), meta["data"])
    if runtime.rank == 0:
        saved = f"{meta['world_size']} ranks under {meta.get('strategy', '?')} (shard {meta.get('shard_size', '?')})"
        now = f"{runtime.world_size} ranks under {w.strategy.name} (shard {w.chosen.shard_size})"
        change = (f"the world changed: saved on {saved}, this job runs {now}: re-planned for {runtime.world_size} "
                  f"ranks" if meta["world_size"] != runtime.world_size else f"the same world: {now}")
        log.info("hybrid: resumed from %s at optimizer step %d; %s", w.resumed_from, w.step_count, change)


def _with_job_file(path: str, given: dict) -> Wrapped:
    """auto_wrap again with the job file's values for every argument still at its default."""
    from .config.jobfile import wrap_options

    kwargs, cluster, plan_only = wrap_options(path)
    defaults = {k: p.default for k, p in inspect.signature(auto_wrap).parameters.items()
                if p.default is not inspect.Parameter.empty}
    args = {k: v for k, v in given.items() if k in defaults or k in ("model", "optimizer")}
    args["config"] = None
    for k, v in kwargs.items():
        if args[k] == defaults[k]:
            args[k] = v
    if cluster is not None and args["cluster"] is None:
        args["cluster"] = cluster
    if plan_only:
        log.info("hybrid: %s: %s describe what `hybrid plan` estimates; auto_wrap uses the module and the "
                 "optimizer it is given", path, ", ".join(plan_only))
    return auto_wrap(**args)


def _choose_on_states(the_plan, profile, said: list):
    """A module whose activations nothing could estimate (no repeating block to measure): the
    fastest layout whose model states fit, said (on rank 0) with what is missing, never silently."""
    from .planning.planner import choose
    chosen = choose(the_plan.candidates, the_plan.tie, known=False)
    if chosen is None:
        return the_plan
    said.append(f"hybrid: warning: {', '.join(the_plan.missing)} of {profile.name} unknown (no repeating block to "
                f"measure): {chosen.label} chosen on its model states alone; pass strategy= to choose yourself")
    return dataclasses.replace(the_plan, chosen=chosen)


def _agree(chosen, runtime, strategy, cluster):
    """Every rank must apply the same strategy; if they did not choose the same, all of them say
    what each rank was given."""
    if runtime.world_size == 1:
        return chosen
    choices = [None] * runtime.world_size
    dist.all_gather_object(choices, (chosen.name, chosen.parallel.shape, strategy, cluster.capacity_bytes))
    if len({c[:2] for c in choices}) > 1:
        detail = "; ".join(f"rank {r}: strategy={c[2]!r}, capacity {c[3]} B -> {c[0]} x{c[1]}"
                           for r, c in enumerate(choices))
        raise HybridError(f"ranks chose different layouts ({detail}): pass the same strategy=, cluster= and "
                          "gpu_memory= on every rank")
    return chosen
