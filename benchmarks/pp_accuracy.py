"""Pipeline memory per stage: analytic vs traced, every pipeline rank, per GPU, live tensors
(overhead excluded).

    .venv/bin/python benchmarks/pp_accuracy.py          # writes benchmarks/results/pp_accuracy.md (~6 min)

The traced side cuts the stage from our decoder on fake tensors, wraps it as the runtime does
(FSDP2 over the stage's ranks, tensor parallelism with sequence parallelism inside the node) on a
fake process group of the whole world, and runs the rank's micro-batches in the schedule's order
through torch.distributed.pipelining's own PipelineStage backward and step-end reduction
(hybrid/measure/stages.py: traced_stage_estimate). Each rank is traced in a fresh process.

Cells: llama3-70b at pp 4 x tp 8 on 16 x 8 h100-80gb, seq 8192, 8 micro-batches (1f1b), fsdp with
full and selective checkpointing; llama2-7b at pp 2 on 2 x 8, seq 4096, 4 micro-batches, fsdp.
"""
from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

OUT = Path(__file__).parent / "results" / "pp_accuracy.md"
CELLS = [("llama3-70b", 16, 8192, 8, 4, 8, "fsdp", "full"), ("llama3-70b", 16, 8192, 8, 4, 8, "fsdp", "selective"),
         ("llama2-7b", 2, 4096, 1, 2, 4, "fsdp", "none")]


def one_rank(cell, rank, queue):
    from hybrid.families.catalogue import load_catalogue
    from hybrid.config.cluster import Cluster
    from hybrid.layout.layout import Layout
    from hybrid.estimation.memory.analytic import estimate
    from hybrid.measure.stages import traced_stage_estimate
    from hybrid.layout.pipeline import stage_cluster
    from hybrid.planning.stages import stage_split
    from hybrid.model.sources import resolve_model
    from hybrid.config.spec import TrainSpec
    model, nodes, seq, tp, pp, m, name, ckpt = cell
    src, cl, s = resolve_model(model), Cluster.build(nodes, 8, "h100-80gb"), load_catalogue()[name]
    spec = TrainSpec(1, seq, activation_checkpointing=ckpt, gradient_accumulation=m)
    scl = stage_cluster(cl, pp)
    layout = Layout.of(s, cl, spec, tp=tp, pp=pp, schedule="1f1b")
    split = stage_split(layout, src.profile, spec, scl)
    a = estimate(layout.with_pipeline(split), src.profile, spec, scl, rank)
    t = traced_stage_estimate(src, s, spec, cl, None, tp, split, rank)
    queue.put((split.describe(), split.in_flight(rank), a.tensors, t.memory.tensors, t.seconds))


def main():
    rows = ["# Pipeline memory per stage: analytic vs traced", "",
            "`.venv/bin/python benchmarks/pp_accuracy.py`: per-GPU peak of live tensors (overhead excluded) on each "
            "pipeline rank, bf16-mixed, AdamW, micro-batch 1, 1f1b, 8 x h100-80gb per node; traced: the rank's stage "
            "of our decoder on fake tensors, run in the schedule's order through torch.distributed.pipelining's "
            "PipelineStage.", "",
            "| model | nodes | seq | tp | pp | micro-batches | strategy | checkpointing | pp rank | in flight | "
            "analytic GiB | traced GiB | error | trace s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ctx = mp.get_context("spawn")
    for cell in CELLS:
        model, nodes, seq, tp, pp, m, name, ckpt = cell
        for rank in range(pp):
            queue = ctx.Queue()
            p = ctx.Process(target=one_rank, args=(cell, rank, queue))
            p.start()
            layout, flight, a, t, secs = queue.get()
            p.join()
            line = (f"| {model} | {nodes} | {seq} | {tp} | {pp} | {m} | {name} | {ckpt} | {rank} | {flight} | "
                    f"{a / 2**30:.2f} | {t / 2**30:.2f} | {a / t - 1:+.1%} | {secs:.0f} |")
            print(line, flush=True)
            rows.append(line)
        rows.append(f"| | | | | | | | | layout: {layout} | | | | | |")
    OUT.write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
