"""Tensor-parallel memory: analytic vs traced (our decoder with sequence parallelism, fake tensors,
fake process group of the real world size), per GPU, live tensors (overhead excluded).

    .venv/bin/python benchmarks/tp_accuracy.py          # writes benchmarks/results/tp_accuracy.md

Cells: llama3-70b tp 8 on 8 x 8 h100-80gb at seq 8192 (fsdp and fsdp + full checkpointing), and
llama2-7b tp 2 and tp 4 on 1 x 8 at seq 4096 (fsdp, hsdp). bf16-mixed, AdamW, micro-batch 1.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybrid.families.catalogue import load_catalogue
from hybrid.config.cluster import Cluster
from hybrid.layout.layout import Layout
from hybrid.estimation.memory.analytic import estimate
from hybrid.measure.traced import traced_estimate
from hybrid.model.sources import resolve_model
from hybrid.config.spec import TrainSpec
from hybrid.units import GiB

OUT = Path(__file__).parent / "results" / "tp_accuracy.md"
CELLS = [("llama3-70b", 8, 8192, 8, "fsdp", "none"), ("llama3-70b", 8, 8192, 8, "fsdp", "full"),
         ("llama2-7b", 1, 4096, 2, "fsdp", "none"), ("llama2-7b", 1, 4096, 4, "fsdp", "none"),
         ("llama2-7b", 1, 4096, 2, "hsdp", "full")]


def main():
    cat = load_catalogue()
    rows = ["# Tensor-parallel memory: analytic vs traced", "",
            "`.venv/bin/python benchmarks/tp_accuracy.py`: per-GPU peak of live tensors (overhead excluded), "
            "bf16-mixed, AdamW, micro-batch 1, 8 x h100-80gb per node; traced runs hybrid's decoder with "
            "sequence parallelism under FakeTensorMode and a fake process group of the real world size.", "",
            "| model | nodes | seq | tp | strategy | checkpointing | analytic GiB | traced GiB | error | trace s |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for model, nodes, seq, tp, name, ckpt in CELLS:
        src = resolve_model(model)
        cl = Cluster.build(nodes, 8, "h100-80gb")
        spec = TrainSpec(1, seq, activation_checkpointing=ckpt)
        a = estimate(Layout.of(cat[name], cl, spec, tp=tp), src.profile, spec, cl)
        start = time.perf_counter()
        t = traced_estimate(src, cat[name], spec, cl, tp=tp)
        secs = time.perf_counter() - start
        err = a.tensors / t.memory.tensors - 1
        line = (f"| {model} | {nodes} | {seq} | {tp} | {name} | {ckpt} | {a.tensors / GiB:.2f} | "
                f"{t.memory.tensors / GiB:.2f} | {err:+.1%} | {secs:.0f} |")
        print(line, flush=True)
        rows.append(line)
    OUT.write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
