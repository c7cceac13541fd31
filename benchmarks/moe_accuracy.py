"""Mixture-of-experts memory: analytic vs traced (transformers' MoE models on fake tensors, FSDP2
over a fake process group of the real world size), per GPU, live tensors (overhead excluded).

    .venv/bin/python benchmarks/moe_accuracy.py          # writes benchmarks/results/moe_accuracy.md

Cells: Mixtral-8x7B, Qwen3-30B-A3B and OLMoE-1B-7B with FSDP over 8 x 8 h100-80gb at seq 4096,
without and with full checkpointing, at ep 1, 2 and 8; bf16-mixed, AdamW, micro-batch 1. At ep > 1
the trace runs hybrid/runtime/backends/ep.py on fake ranks: tokens spread evenly over the experts, what a
rank receives scaled by the default --moe-imbalance (a fake process group carries no counts).
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

OUT = Path(__file__).parent / "results" / "moe_accuracy.md"
CELLS = [(m, ckpt, ep) for m in ("mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b") for ckpt in ("none", "full")
         for ep in (1, 2, 8)]


def main():
    cat = load_catalogue()
    cl = Cluster.build(8, 8, "h100-80gb")
    rows = ["# MoE memory: analytic vs traced", "",
            "`.venv/bin/python benchmarks/moe_accuracy.py`: per-GPU peak of live tensors (overhead excluded), "
            "FSDP over 8 x 8 h100-80gb, seq 4096, micro-batch 1, bf16-mixed, AdamW; traced runs the transformers "
            "model under FakeTensorMode and a fake process group of 64 ranks; at ep > 1 the expert-parallel code with "
            "even routing times the default --moe-imbalance.", "",
            "| model | params (total / active) | checkpointing | ep | analytic GiB | traced GiB | error | trace s |",
            "|---|---|---|---|---|---|---|---|"]
    for model, ckpt, ep in CELLS:
        src = resolve_model(model)
        d = src.profile.decoder
        spec = TrainSpec(1, 4096, activation_checkpointing=ckpt)
        a = estimate(Layout.of(cat["fsdp"], cl, spec, ep=ep), src.profile, spec, cl)
        start = time.perf_counter()
        t = traced_estimate(src, cat["fsdp"], spec, cl, ep=ep)
        secs = time.perf_counter() - start
        line = (f"| {model} | {d.params / 1e9:.1f}B / {d.active_params / 1e9:.1f}B | {ckpt} | {ep} | "
                f"{a.tensors / GiB:.2f} | {t.memory.tensors / GiB:.2f} | {a.tensors / t.memory.tensors - 1:+.1%} | "
                f"{secs:.0f} |")
        print(line, flush=True)
        rows.append(line)
    OUT.write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
