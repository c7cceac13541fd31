"""How close the estimates are: analytic vs traced at full scale, and traced (and analytic) vs a
measured run of the real job at small scale.

    .venv/bin/python benchmarks/estimator_accuracy.py            # full matrix (~15 min on 2 cores)
    .venv/bin/python benchmarks/estimator_accuracy.py --quick    # a few cells

Full scale: models x {ddp, fsdp, hsdp, zero3} x checkpointing {none, full} x world {8, 64}
(8 x h100-80gb per node, bf16-mixed, AdamW, micro-batch 1; ConvNet micro-batch 32). Errors are
relative to traced on the per-GPU peak of live tensors (overhead excluded: neither method
measures the CUDA context). Small scale: 2 CPU ranks (gloo), the real libraries (DeepSpeed
included), live tensors tracked at the dispatcher. Writes benchmarks/results/estimator_accuracy.md.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybrid.families.catalogue import load_catalogue
from hybrid.config.cluster import Cluster
from hybrid.estimation.memory.analytic import estimate
from hybrid.measure.measured import measured_estimate
from hybrid.measure.traced import traced_estimate
from hybrid.model.sources import resolve_model
from hybrid.config.spec import TrainSpec
from hybrid.units import GiB, MiB

OUT = Path(__file__).parent / "results" / "estimator_accuracy.md"
LARGE = {"gpt2": dict(micro_batch=4, seq_len=1024), "llama2-7b": dict(micro_batch=1, seq_len=4096),
         "mistral-7b": dict(micro_batch=1, seq_len=4096),
         "hybrid.model.convnet:convnet": dict(micro_batch=32, seq_len=1)}
# FSDP2's bf16 params with BatchNorm's fp32 running stats do not run on CPU: the ConvNet is fp32
SMALL = {"gpt2": dict(micro_batch=2, seq_len=256),
         "hybrid.model.convnet:small_convnet": dict(micro_batch=8, seq_len=1, precision="fp32")}


def full_scale(models, strategies, ckpts, worlds):
    cat = load_catalogue()
    rows = []
    for model in models:
        src = resolve_model(model)
        for world in worlds:
            cl = Cluster.build(world // 8, 8, "h100-80gb")
            for ckpt in ckpts:
                spec = TrainSpec(**LARGE[model], activation_checkpointing=ckpt)
                for name in strategies:
                    a = estimate(cat[name], src.profile, spec, cl)
                    t = traced_estimate(src, cat[name], spec, cl)
                    err = a.tensors / t.memory.tensors - 1
                    rows.append((model, name, ckpt, world, a.tensors, t.memory.tensors, err, t.implementation,
                                 t.seconds))
                    print(f"{model:22} {name:6} ac={ckpt:4} world={world:3}  analytic {a.tensors / GiB:7.2f} GiB  "
                          f"traced {t.memory.tensors / GiB:7.2f} GiB  {err:+6.1%}  "
                          f"({t.implementation}, {t.seconds:.1f}s)",
                          flush=True)
    return rows


def small_scale(models, strategies, ckpts):
    cat = load_catalogue()
    cl = Cluster.build(1, 2, "h100-80gb")
    rows = []
    for model in models:
        src = resolve_model(model)
        for ckpt in ckpts:
            spec = TrainSpec(**SMALL[model], activation_checkpointing=ckpt)
            for name in strategies:
                m = measured_estimate(src, cat[name], spec, cl)
                t = traced_estimate(src, cat[name], spec, cl)
                a = estimate(cat[name], src.profile, spec, cl)
                rows.append((model, name, ckpt, m.memory.tensors, t.memory.tensors, a.tensors))
                print(f"{model:28} {name:6} ac={ckpt:4}  measured {m.memory.tensors / MiB:8.1f} MiB  traced "
                      f"{t.memory.tensors / MiB:8.1f} ({t.memory.tensors / m.memory.tensors - 1:+6.1%})  analytic "
                      f"{a.tensors / MiB:8.1f} ({a.tensors / m.memory.tensors - 1:+6.1%})", flush=True)
    return rows


def write(large, small, seconds):
    lines = ["# Estimator accuracy", "",
             f"`.venv/bin/python benchmarks/estimator_accuracy.py` ({seconds / 60:.1f} min).",
             "Per-GPU peak of live tensors (overhead excluded), bf16-mixed (small ConvNet: fp32), AdamW.", "",
             "## Analytic vs traced at full scale (8 x h100-80gb per node)", "",
             "| model | strategy | ckpt | world | analytic GiB | traced GiB | error | traced as |",
             "|---|---|---|---|---|---|---|---|"]
    for model, name, ckpt, world, a, t, err, impl, _ in large:
        lines.append(f"| {model} | {name} | {ckpt} | {world} | {a / GiB:.2f} | {t / GiB:.2f} | {err:+.1%} | {impl} |")
    lines += ["", "## Traced and analytic vs measured, 2 CPU ranks (gloo), real libraries", "",
              "| model | strategy | ckpt | measured MiB | traced MiB | traced error | analytic MiB | analytic error |",
              "|---|---|---|---|---|---|---|---|"]
    for model, name, ckpt, m, t, a in small:
        lines.append(f"| {model} | {name} | {ckpt} | {m / MiB:.1f} | {t / MiB:.1f} | {t / m - 1:+.1%} | "
                     f"{a / MiB:.1f} | {a / m - 1:+.1%} |")
    OUT.write_text("\n".join(lines) + "\n")
    print(f"\nwrote {OUT}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a few cells only")
    args = ap.parse_args()
    start = time.time()
    if args.quick:
        large = full_scale(["llama2-7b"], ["fsdp", "zero3"], ["none"], [64])
        small = small_scale(["gpt2"], ["fsdp"], ["none"])
    else:
        large = full_scale(list(LARGE), ["ddp", "fsdp", "hsdp", "zero3"], ["none", "full"], [8, 64])
        small = small_scale(list(SMALL), ["ddp", "fsdp", "zero3"], ["none", "full"])
    write(large, small, time.time() - start)


if __name__ == "__main__":
    main()
