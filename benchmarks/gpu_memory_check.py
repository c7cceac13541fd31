"""On a GPU: estimated vs torch.cuda.max_memory_allocated for a ~1B Llama-shaped model in bf16
(ddp and fsdp at world size 1, with and without activation checkpointing), plus step times.

    .venv/bin/python benchmarks/gpu_memory_check.py            # needs CUDA; ~3 min on one H100/H200
    .venv/bin/python benchmarks/gpu_memory_check.py --dry-run  # the same code path on CPU, tiny model

Writes benchmarks/results/gpu_memory.md. The analytic and traced estimates are computed before
anything runs; 'measured' is what the CUDA caching allocator reports (max_memory_allocated: live
tensors, the quantity the estimates' tensor totals predict) and reserved (what the allocator took).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

OUT = Path(__file__).parent / "results" / "gpu_memory.md"
CASES = [("ddp", "none"), ("ddp", "full"), ("fsdp", "none"), ("fsdp", "full")]


def run_case(preset, strategy, ckpt, micro_batch, seq, steps):
    import torch

    from hybrid import auto_wrap
    from hybrid.runtime.data import synthetic_corpus
    from hybrid.model.sources import resolve_model
    src = resolve_model(preset)
    model, impl = src.build(device="meta", prefer_hf=True)
    cuda = torch.cuda.is_available()
    w = auto_wrap(model, strategy=strategy, activation_checkpointing=ckpt, micro_batch=micro_batch,
                  seq_len=seq, precision="bf16-mixed", verbose=False)
    ids = synthetic_corpus(micro_batch, seq, src.profile.decoder.vocab)[:][0].to(w.runtime.device)
    batch = {"input_ids": ids, "labels": ids}
    times = []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(steps):
        t0 = time.perf_counter()
        loss = w(batch).loss
        w.backward(loss)
        w.step()
        w.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    reserved = torch.cuda.max_memory_reserved() if cuda else 0
    return {"impl": impl, "peak": peak, "reserved": reserved, "step_s": statistics.median(times) if times else 0.0,
            "chosen": w.chosen.label, "gpu": torch.cuda.get_device_name() if cuda else "cpu"}


def measure(preset, mb, seq, steps, cases=CASES, cluster=None):
    """[(strategy, ckpt, analytic, traced, measured)] for each case: the estimates first, then one
    real run on this process's device (a rank launched by run_ranks)."""
    from hybrid.families.catalogue import load_catalogue
    from hybrid.config.cluster import detect
    from hybrid.runtime.launch import run_ranks
    from hybrid.estimation.memory.analytic import estimate
    from hybrid.measure.traced import traced_estimate
    from hybrid.model.sources import resolve_model
    from hybrid.config.spec import TrainSpec
    from hybrid.units import GiB

    cat = load_catalogue()
    src = resolve_model(preset)
    cluster = cluster or detect()
    rows = []
    for strategy, ckpt in cases:
        spec = TrainSpec(mb, seq, precision="bf16-mixed", activation_checkpointing=ckpt)
        a = estimate(cat[strategy], src.profile, spec, cluster)
        t = traced_estimate(src, cat[strategy], spec, cluster)
        m = run_ranks(1, run_case, preset, strategy, ckpt, mb, seq, steps)[0]
        rows.append((strategy, ckpt, a, t.memory, m))
        print(f"{strategy:5} {ckpt:5} analytic {a.tensors / GiB:6.2f} traced {t.memory.tensors / GiB:6.2f} "
              f"measured {m['peak'] / GiB:6.2f} reserved {m['reserved'] / GiB:6.2f} GiB  "
              f"{m['step_s'] * 1e3:.0f} ms/step",
              flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model: exercise the code path")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    import torch

    from hybrid.model.sources import resolve_model
    from hybrid.units import GiB

    if not torch.cuda.is_available() and not args.dry_run:
        sys.exit("gpu_memory_check: no CUDA device here; run it on a GPU machine (or --dry-run on CPU)")
    preset, mb, seq = ("tiny-llama", 2, 128) if args.dry_run else ("llama3.2-1b", 1, 4096)
    src = resolve_model(preset)
    cluster = __import__("hybrid").Cluster.build(1, 1, "h100-80gb") if args.dry_run else None
    rows = measure(preset, mb, seq, args.steps, cluster=cluster)
    gpu = rows[0][4]["gpu"]
    lines = ["# Estimated vs measured peak on a GPU", "",
             f"`.venv/bin/python benchmarks/gpu_memory_check.py` on {gpu}: {preset} "
             f"({src.profile.params:,} params, {rows[0][4]['impl']}), bf16-mixed, AdamW, micro-batch {mb} x "
             f"{seq}, world size 1.", "",
             "| strategy | ckpt | analytic GiB | traced GiB | max_memory_allocated GiB | analytic err | traced err "
             "| reserved GiB | estimated total (with overhead) GiB | step ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for strategy, ckpt, a, t, m in rows:
        peak = max(m["peak"], 1)
        lines.append(f"| {strategy} | {ckpt} | {a.tensors / GiB:.2f} | {t.tensors / GiB:.2f} | {m['peak'] / GiB:.2f} | "
                     f"{a.tensors / peak - 1:+.1%} | {t.tensors / peak - 1:+.1%} | {m['reserved'] / GiB:.2f} | "
                     f"{a.total / GiB:.2f} | {m['step_s'] * 1e3:.0f} |")
    if not args.dry_run:
        OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
