"""Our traced estimate against torch's own FSDPMemTracker on the same job, side by side.

    .venv/bin/python benchmarks/fsdp_memtracker.py      # writes benchmarks/results/fsdp_memtracker.md (~1 min)

The job: transformers Llama-2-7B, HSDP 8 x 8 (dp_replicate 8 x dp_shard 8) on 8 x 8 h100-80gb,
bf16-mixed, AdamW (foreach), micro-batch 1 x seq 4096, no checkpointing, on fake tensors and a
fake process group of 64 ranks. Both sides run the same wrapping (hybrid's FSDP2 backend) and the
same two training steps; FSDPMemTracker's peak is taken over the second step (after
reset_mod_stats), as the traced estimate's is.

Order matters for torch's tracker, so it is fixed: FSDPMemTracker first, in this fresh process
(before anything else ran the job's operators under fake tensors), then ours (fast and full
trace), then FSDPMemTracker again with the two loops (the output freed before backward, or kept
as hybrid's driver keeps it). Prints each peak with FSDPMemTracker's optimizer category.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

OUT = Path(__file__).parent / "results" / "fsdp_memtracker.md"


def fsdp_memtracker_peak(src, strategy, spec, cluster, shard, keep_output=False):
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hybrid.model.decoder import prepare_for_training
    from hybrid.measure.traced import _real_mesh_arithmetic, unpacked_batches, make_batch, optimizer_factory
    from hybrid.runtime.mesh import Runtime, build_mesh
    from hybrid.layout.dims import ParallelDims

    world = cluster.world_size
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        runtime = Runtime(torch.device("cpu"), "fake", world, 0, cluster.gpus_per_node)
        mesh = build_mesh(ParallelDims(dp_replicate=world // shard, dp_shard=shard), runtime, cluster.gpus_per_node)
        with FakeTensorMode(allow_non_fake_inputs=True), unpacked_batches(), _real_mesh_arithmetic():
            model, _ = src.build(device="cpu", attention=spec.attention, prefer_hf=True)
            prepare_for_training(model)
            engine = strategy.family_obj.runtime().traced_apply(strategy, model, optimizer_factory(spec), mesh,
                                                                spec, runtime)
            batch = make_batch(model, spec, src.profile.decoder.vocab)
            tracker = FSDPMemTracker(model, engine.optimizer)
            tracker.track_inputs((batch["input_ids"],))
            with tracker:
                for step in range(2):
                    out = model(**batch)
                    loss = out.loss
                    if not keep_output:
                        del out
                    loss.backward()
                    out = loss = None
                    engine.optimizer.step()
                    engine.optimizer.zero_grad()
                    if step == 0:
                        tracker.reset_mod_stats()
            snap = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
            return {getattr(k, "name", str(k)): v for k, v in snap.items()}
    finally:
        dist.destroy_process_group()


def timed(fn):
    """(fn(), seconds it took)."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main():
    from hybrid.families.catalogue import load_catalogue
    from hybrid.config.cluster import Cluster
    from hybrid.measure.traced import traced_estimate
    from hybrid.model.sources import resolve_model
    from hybrid.config.spec import TrainSpec

    src, cluster = resolve_model("llama2-7b"), Cluster.build(8, 8, "h100-80gb")
    strategy, spec, shard = load_catalogue()["hsdp"], TrainSpec(1, 4096), 8

    cold, cold_s = timed(lambda: fsdp_memtracker_peak(src, strategy, spec, cluster, shard))
    fast, fast_s = timed(lambda: traced_estimate(src, strategy, spec, cluster, shard))
    full, full_s = timed(lambda: traced_estimate(src, strategy, spec, cluster, shard, fast=False))
    warm, warm_s = timed(lambda: fsdp_memtracker_peak(src, strategy, spec, cluster, shard))
    kept, kept_s = timed(lambda: fsdp_memtracker_peak(src, strategy, spec, cluster, shard, keep_output=True))
    gib = 2**30

    def row(name, total, seconds, opt=None):
        return f"| {name} | {total / gib:.3f} | {'' if opt is None else f'{opt / gib:.3f}'} | {seconds:.1f} |"

    rows = ["# Traced estimate vs torch's FSDPMemTracker, same job", "",
            "`.venv/bin/python benchmarks/fsdp_memtracker.py`: transformers Llama-2-7B, HSDP 8 x 8, bf16-mixed, AdamW "
            "(foreach), micro-batch 1 x seq 4096, no checkpointing; fake tensors, fake process group of 64 ranks; peak "
            "of live tensors in the second of two steps, in run order.", "",
            "| tracker (in run order) | peak GiB | FSDPMemTracker's OPT GiB | seconds |", "|---|---|---|---|",
            row("torch FSDPMemTracker, first in a fresh process, `loss = model(**batch).loss`", cold["Total"], cold_s,
                cold["OPT"]),
            row(f"hybrid traced, fast ({fast.implementation})", fast.memory.tensors, fast_s),
            row(f"hybrid traced, every block ({full.implementation})", full.memory.tensors, full_s),
            row("torch FSDPMemTracker, again, `loss = model(**batch).loss`", warm["Total"], warm_s, warm["OPT"]),
            row("torch FSDPMemTracker, again, the output kept through backward", kept["Total"], kept_s, kept["OPT"]),
            "",
            f"hybrid vs FSDPMemTracker with the same loop: {fast.memory.tensors / kept['Total'] - 1:+.2%}; "
            f"against the loop that frees the output: {fast.memory.tensors / warm['Total'] - 1:+.2%}.", "",
            "What the differences are. (1) The same loop agrees to the byte. hybrid's traced driver keeps the model "
            "output (the bf16 logits, b x s x vocab x 2 bytes = 0.24 GiB here) alive through backward, as a loop "
            "holding `out` does; `loss = model(**batch).loss` frees it before backward. (2) FSDPMemTracker's "
            "result depends on what ran before it in the process: run first, it counts the optimizer at "
            f"{cold['OPT'] / gib:.1f} GiB and puts the peak in the optimizer step, where AdamW holds "
            f"{warm['OPT'] / gib:.2f} GiB of state (two fp32 moments of the 842M-element shard) and its foreach "
            "step allocates one more fp32 copy of it (the square root of the second moment); run again in the "
            "same process it counts the optimizer right. Our tracker gives the same peak in either order. The "
            "36.64 GiB quoted in issue #14 is not reproduced here (its loop and torch version are not known); a "
            "figure from FSDPMemTracker depends on what ran before it in the process."]
    print("\n".join(rows))
    OUT.write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
