"""`hybrid tune` on one rank: the command's options in, the trials (hybrid/tune/trials.py) run, the
report out. Apart from tune/trials.py so that auto_wrap(tune=...) does not import the command's
pieces, nor these auto_wrap's."""
from __future__ import annotations

import argparse

import torch

from ..errors import HybridError
from ..tune.trials import format_tune, tokens_per_s_per_gpu, tune


def tune_plan(opts: dict, cluster):
    """(the model source, the plan) `hybrid tune` measures on `cluster`, the ranks' detected one; what no
    rank could run is refused here in the plan's one line (trials.check_runnable). The command asks it
    before it starts any rank, and every rank again before its trials."""
    from ..estimation.calibration import resolve
    from ..families.catalogue import load_catalogue
    from ..planning.planner import plan as make_plan
    from ..model.sources import resolve_model
    from ..tune.trials import check_runnable

    args = argparse.Namespace(**opts)
    if args.gpu is not None and cluster.gpu.name != args.gpu:
        raise HybridError(f"tune measures the accelerators it runs on ({cluster.gpu.name}), not --gpu {args.gpu}: "
                          "drop --gpu, or plan for it with `hybrid plan`")
    src, spec = resolve_model(args.model), args.spec
    cat = load_catalogue(args.strategies_dir)
    names = [s.strip() for s in args.strategies.split(",")] if args.strategies else None
    p = make_plan(src.profile, spec, cluster, cat, args.shard_size, strategies=names,
                  tp=args.tp if args.tp is not None else None, pp=args.pp if args.pp is not None else 1,
                  schedule=args.schedule, search_checkpointing=args.activation_checkpointing is None,
                  efficiency=args.efficiency, calibration=resolve(args.calibration),
                  cp=getattr(args, "cp", None), micro_batch=args.micro_batch, hold_batch=True)
    check_runnable(p)
    return src, p


def run_cli(opts: dict):
    """`hybrid tune` on one rank (under torchrun, or a rank spawned by the command): plan, run the
    trials, and on rank 0 return (text, JSON dict) and write the calibration; None elsewhere.
    `opts`: the command's options, with `spec` (the TrainSpec) and `progress` (the bar) added."""
    from ..auto import prepare_for_training
    from ..estimation.calibration import save
    from ..config.cluster import detect
    from ..measure.traced import optimizer_factory
    from ..runtime.mesh import init_distributed

    args = argparse.Namespace(**opts)
    try:                                 # its config warnings about synthetic presets, once per trial
        import transformers
        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    runtime = init_distributed()
    cluster = detect(args.gpu_memory)
    src, p = tune_plan(opts, cluster)
    spec = args.spec
    dtype = torch.bfloat16 if spec.precision == "bf16" else None

    def make_model():
        model, _ = src.build(device=runtime.device, attention=spec.attention, prefer_hf=args.implementation != "hybrid",
                             dtype=dtype)
        prepare_for_training(model)
        return model

    job = {"model": src.ref, "nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
           "micro_batch": spec.micro_batch, "seq_len": spec.seq_len, "precision": spec.precision,
           "gradient_accumulation": spec.gradient_accumulation, "global_batch": p.spec.global_batch,
           "steps": args.steps, "warmup": args.warmup}
    r = tune(p, make_model, optimizer_factory(spec), runtime, cluster, args.top, args.steps, args.warmup,
             progress=args.progress, job=job)
    if runtime.rank != 0:
        return None
    if args.save_calibration and r.calibration is not None:
        save(r.calibration, args.save_calibration)
    return format_tune(r), to_dict(r)


CANDIDATE_KEYS = ("name", "family", "shard_size", "parallel", "activation_checkpointing", "pipeline")
"""What names a candidate in every JSON row (plan, estimate, compare, tune): Layout.to_dict's keys,
"pipeline" (Layout.stages_dict) where the layout is staged."""


def to_dict(r) -> dict:
    p = r.plan
    out = {"model": p.model.name, "world_size": p.cluster.world_size, "gpu": p.cluster.gpu.name,
           "global_batch": p.global_batch, "seq_len": p.spec.seq_len,
           "steps": r.steps, "warmup": r.warmup, "plan_chosen": p.chosen.label if p.chosen else None,
           "chosen": r.chosen.label if r.chosen else None,
           "chosen_candidate": ({"name": r.chosen.name, "shard_size": r.chosen.shard_size,
                                 "parallel": r.chosen.parallel.to_dict(),
                                 "activation_checkpointing": r.chosen.spec.activation_checkpointing}
                                if r.chosen else None),
           "trials": [], "calibration": r.calibration.to_dict() if r.calibration else None}
    for t in r.trials:
        c = p.candidates[t.index]
        row = c.to_dict()
        out["trials"].append({
            **{k: row[k] for k in CANDIDATE_KEYS if k in row},
            "layout": c.label,      # deprecated in 0.2, gone in 0.3: the plan's keys above name the candidate
            "status": t.status, "detail": t.detail,
            "predicted_fits": c.fits, "predicted_step_s": c.cost.seconds if c.cost else None,
            "predicted_tokens_per_s_per_gpu": c.cost.tokens_per_s_per_gpu if c.cost else None,
            "predicted_allocated_bytes": c.memory.allocated if c.memory else None,
            "micro_batch": c.spec.micro_batch, "gradient_accumulation": c.spec.gradient_accumulation,
            "global_batch": c.spec.micro_batch * c.spec.gradient_accumulation * c.parallel.dp_size,
            "measured_step_s": t.seconds,
            "measured_tokens_per_s_per_gpu": tokens_per_s_per_gpu(c, t.seconds) if t.seconds else None,
            "measured_allocated_bytes": t.allocated, "measured_reserved_bytes": t.reserved})
    return out
