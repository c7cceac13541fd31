"""`hybrid demo`: the whole promise in one command, on a laptop with no GPU.

1. Plan Llama-2-7B for 8 nodes x 8 H100-80GB at sequence 4096: every strategy side by side, and
   the choice (analytic, instant).
2. Train a small GPT for real: 4 CPU ranks on gloo launched by torchrun, presented to the planner as
   2 simulated nodes x 2 "GPUs" of 56 MiB joined by a slow link, so plain DDP does not fit and the
   planner has to pick a sharded strategy on a 2D mesh. A progress bar, the loss going down, and
   the estimated against the measured peak memory of every rank.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from ..config.cluster import GB, Cluster, GPUSpec
from ..model.presets import DecoderConfig
from ..units import MiB, fmt_bytes

DEMO_MODEL = DecoderConfig("llama", 512, 256, 4, 8, 704, 64, kv_heads=4, tied=True)
DEMO_GPU = GPUSpec("demo-cpu", 56 * MiB, 4e10, 2 * GB, 0.02 * GB, cuda_context_bytes=0, is_cuda=False,
                   mem_bw=10 * GB, comm_overlap=0.0)
"""A pretend accelerator for the CPU ranks: 56 MiB, 40 GFLOP/s, 2 GB/s inside a 'node' and 0.02 GB/s
between the two 'nodes' (the gap NVLink vs. the network opens on real clusters, wide enough here
that HSDP's lead over ZeRO-1 is beyond the model's error)."""
MICRO_BATCH, SEQ, NPROC = 4, 64, 4


def demo_cluster(nproc: int = NPROC) -> Cluster:
    """The CPU ranks as the planner sees them: 2 nodes of nproc/2 demo GPUs."""
    return Cluster(nodes=2, gpus_per_node=nproc // 2, gpu=DEMO_GPU)


def plan_7b() -> str:
    from ..planning.planner import plan
    from ..model.sources import resolve_model
    from ..planning.report import format_plan
    from ..config.spec import TrainSpec

    p = plan(resolve_model("llama2-7b").profile, TrainSpec(1, 4096), Cluster.build(8, 8, "h100-80gb"),
             search_checkpointing=True)
    return format_plan(p, summary=True)


def _bar(done: int, total: int, width: int = 30) -> str:
    filled = int(width * done / total)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def chosen_and_traced(nproc: int = NPROC) -> tuple[str, int]:
    """Part 2's choice, planned here as the ranks will plan it, and its traced peak (the traced
    estimate needs its own fake process group, so it runs before the ranks start)."""
    from ..measure.traced import traced_estimate
    from ..planning.planner import plan
    from ..model.profile import profile_decoder
    from ..model.sources import ModelSource, _decoder_builder
    from ..config.spec import TrainSpec

    profile = profile_decoder(DEMO_MODEL, "demo-gpt")
    cluster = demo_cluster(nproc)
    p = plan(profile, TrainSpec(MICRO_BATCH, SEQ, precision="fp32"), cluster, search_checkpointing=True, pp=1,
             micro_batch=MICRO_BATCH, hold_batch=True)                   # as worker's auto_wrap plans
    c = p.chosen
    t = traced_estimate(ModelSource(profile, _decoder_builder(DEMO_MODEL)), c.strategy, c.spec, cluster,
                        c.shard_size if c.strategy.shard_is_free else None, prefer_hf=False)
    return c.label, t.memory.tensors


def worker(steps: int, traced: int = 0) -> None:
    """One rank of part 2 (run by torchrun)."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    from .. import auto_wrap
    from ..runtime.data import synthetic_corpus
    from ..measure.driver import tracked_steps
    from ..measure.tracker import MemoryTracker
    from ..runtime.mesh import shard_group_ranks, shutdown
    from ..model.decoder import build_decoder
    from ..planning.report import format_plan

    cluster = demo_cluster(int(os.environ.get("WORLD_SIZE", NPROC)))
    w = auto_wrap(build_decoder(DEMO_MODEL, seed=0), optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3),
                  micro_batch=MICRO_BATCH, seq_len=SEQ, cluster=cluster, precision="fp32", verbose=False,
                  pp=1)     # the loop below is w(batch) / backward / step: a pipeline would need w.train_step
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [None] * world
    dist.all_gather_object(groups, shard_group_ranks(w.mesh))
    if rank == 0:
        print(format_plan(w.plan, summary=True))
        dims = w.parallel
        print(f"\nmesh {dims.describe()} {tuple(w.mesh.shape)} (pp, dp_replicate, dp_shard, cp, tp): shard groups "
              f"{sorted(set(map(tuple, groups)))} stay inside a node; gradients are all-reduced across the "
              f"{dims.dp_replicate} replicas\n", flush=True)
    data = synthetic_corpus(steps * world * MICRO_BATCH, SEQ, DEMO_MODEL.vocab)
    sampler = DistributedSampler(data, num_replicas=w.dp_size, rank=w.dp_rank, shuffle=True, seed=0)
    sampler.set_epoch(0)
    batches = iter(DataLoader(data, batch_size=MICRO_BATCH, sampler=sampler, drop_last=True))
    # the first two steps run under the tensor tracker: the measured peak of this rank
    first = next(batches)[0]
    tracker = MemoryTracker()
    with tracker:
        tracker.register(list(w.module.parameters()), "params")
        tracker.reset_peak()
        tracked_steps(w.engine, {"input_ids": first, "labels": first}, tracker, steps=2)
    peaks = [None] * world
    dist.all_gather_object(peaks, tracker.peak)
    losses, start = [], time.perf_counter()
    for step in range(3, steps + 1):
        ids = next(batches)[0]
        loss = w(ids, labels=ids).loss
        w.backward(loss)
        w.step()
        w.zero_grad()
        losses.append(loss.item())
        if rank == 0:
            print(f"\r{_bar(step, steps)} step {step:3d}/{steps}  loss {loss.item():.3f}", end="", flush=True)
    if rank == 0:
        est = w.chosen.memory.tensors
        print(f"\n\nloss {losses[0]:.3f} -> {losses[-1]:.3f} in {steps} steps "
              f"({(time.perf_counter() - start) / max(len(losses), 1):.2f} s/step on {world} CPU ranks)")
        print(f"\npeak memory per rank, {w.chosen.label} (live tensors, overhead aside): estimated before "
              "training (analytic; traced on fake tensors) vs measured in the first two steps")
        print(f"  {'rank':>4}  {'analytic':>10}  {'traced':>10}  {'measured':>10}  "
              f"{'analytic err':>12}  {'traced err':>10}")
        for r, peak in enumerate(peaks):
            tr = f"{fmt_bytes(traced):>10}  " if traced else f"{'-':>10}  "
            terr = f"{traced / peak - 1:>+10.1%}" if traced else f"{'-':>10}"
            print(f"  {r:>4}  {fmt_bytes(est):>10}  {tr}{fmt_bytes(peak):>10}  {est / peak - 1:>+12.1%}  {terr}")
    shutdown()


def run(steps: int = 60, train: bool = True, nproc: int = NPROC) -> int:
    print("=" * 100)
    print("1/2  Which strategy for Llama-2-7B on 8 nodes x 8 H100-80GB, sequence 4096? (one row per "
          "strategy: its best shard size and checkpointing)")
    print("=" * 100, flush=True)
    print(plan_7b())
    if not train:
        return 0
    print("\n" + "=" * 100)
    print(f"2/2  Training a {DEMO_MODEL.params / 1e6:.1f}M-parameter GPT for real: {nproc} CPU ranks (gloo) via "
          f"torchrun, planned as 2 nodes x {nproc // 2} GPUs of {fmt_bytes(DEMO_GPU.memory_bytes)}")
    print("=" * 100, flush=True)
    label, traced = chosen_and_traced(nproc)
    print(f"(traced estimate of {label} on fake tensors: {fmt_bytes(traced)} per rank)", flush=True)
    from ..runtime.launch import QUIET_CPP_LOGS
    env = {**QUIET_CPP_LOGS, **os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "hybrid.cli.demo", "--worker", "--steps", str(steps), "--traced", str(traced)]
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--traced", type=int, default=0)
    a = ap.parse_args()
    if a.worker:
        worker(a.steps, a.traced)
    else:
        sys.exit(run(a.steps))
